"""Which layer classes fast clipping covers, and the public way to add one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keras_dp_lm.clipping._common import _plain
from keras_dp_lm.clipping._common import lora_enabled

if TYPE_CHECKING:
    import keras

_RULES_BY_CLASS = {}
# Registrations deferred to first use: ``keras_dp_lm.clipping.rules`` defers
# those of KerasHub's classes (finding them imports KerasHub, which
# ``import keras_dp_lm`` does not), through ``register_on_first_use``.
_DEFERRED = []


def register_on_first_use(register):
    """Run ``register()`` (which registers rules) once, before the next lookup
    or registration, so a user's later registration of the same class wins."""
    _DEFERRED.append(register)


def _rules():
    """``_RULES_BY_CLASS``, after running the deferred registrations."""
    while _DEFERRED:
        _DEFERRED.pop(0)()
    return _RULES_BY_CLASS


def register_clipping_rule(
        layer_class: type[keras.layers.Layer],
        rule: type[keras.layers.Layer] | object | None = None) -> Callable[[Any], Any] | None:
    """Declare how fast clipping handles ``layer_class`` (exactly that class).

    Called with ``layer_class`` alone, it is a class decorator that registers
    the rule class it decorates (and returns it unchanged), as the built-in
    rules in :mod:`keras_dp_lm.clipping.rules` are registered.

    Fast clipping claims a layer only when ``type(layer)`` is a registered
    class: a subclass may change the forward computation (a reparametrised
    ``kernel``, an extra scale) that a rule's norm formula assumes, so it is
    never matched implicitly and falls back to exact per-example gradients.

    Args:
        layer_class: the class being declared.
        rule: a covered Keras layer class whose rule applies because
            ``layer_class`` computes exactly what that class computes (a
            declared contract: same ``call``, same use of the same variables),
            or a rule object with ``variables(layer)``, ``forward(layer,
            recorder, *args, **kwargs)``, ``static_method(layer, variable, T, B)``
            and ``matches(layer)`` as the built-in rules in
            :mod:`keras_dp_lm.clipping.rules` have.

    Example:
        >>> import keras
        >>> from keras_dp_lm.clipping import clipping_coverage, register_clipping_rule
        >>> class MyDense(keras.layers.Dense):   # same computation, extra config only
        ...     pass
        >>> register_clipping_rule(MyDense, keras.layers.Dense)
        >>> model = keras.Sequential([keras.Input((3,)), MyDense(2)])
        >>> "exact" in clipping_coverage(model).values()   # kernel ghost, bias instantiated
        False
    """
    if not isinstance(layer_class, type):
        raise TypeError(f"`layer_class` must be a class, got {layer_class!r}.")
    if rule is None:
        def register(rule):
            register_clipping_rule(layer_class, rule)
            return rule
        return register
    rules = _rules()
    if isinstance(rule, type) and rule in rules:
        rule = rules[rule]
    for method in ("variables", "forward", "static_method", "matches"):
        if not callable(getattr(rule, method, None)):
            raise TypeError(
                f"`rule` must be a covered layer class ({', '.join(sorted(c.__name__ for c in rules))}) "
                f"or a rule object with a `{method}` method, got {rule!r}.")
    rules[layer_class] = rule


def _lora_unsupported(rule, layer):
    """A LoRA layer whose rule does not declare ``lora = True`` (it would describe
    the base computation only)."""
    return rule is not None and lora_enabled(layer) and not getattr(rule, "lora", False)


def _rule_for(layer):
    if not getattr(layer, "built", False) or not _plain(layer):
        return None
    rule = _rules().get(type(layer))
    if _lora_unsupported(rule, layer):
        return None
    try:
        return rule if rule is not None and rule.matches(layer) else None
    except AttributeError:
        return None
