"""Which layer classes fast clipping covers, and the public way to add one."""

import keras

from keras_dp_lm.clipping._common import _keras_hub_class
from keras_dp_lm.clipping._common import _lora_enabled
from keras_dp_lm.clipping._common import _plain
from keras_dp_lm.clipping.rules.conv import _ConvRule
from keras_dp_lm.clipping.rules.dense import _DenseRule
from keras_dp_lm.clipping.rules.einsum_dense import _EinsumDenseRule
from keras_dp_lm.clipping.rules.embedding import _EmbeddingRule
from keras_dp_lm.clipping.rules.embedding import _PositionEmbeddingRule
from keras_dp_lm.clipping.rules.masked_lm_head import _MaskedLMHeadRule
from keras_dp_lm.clipping.rules.normalization import _GroupNormRule
from keras_dp_lm.clipping.rules.normalization import _LayerNormRule
from keras_dp_lm.clipping.rules.normalization import _RMSNormRule

_RULES_BY_CLASS = {}


def register_clipping_rule(layer_class, rule):
    """Declare how fast clipping handles ``layer_class`` (exactly that class).

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
    if isinstance(rule, type) and rule in _RULES_BY_CLASS:
        rule = _RULES_BY_CLASS[rule]
    for method in ("variables", "forward", "static_method", "matches"):
        if not callable(getattr(rule, method, None)):
            raise TypeError(
                f"`rule` must be a covered layer class ({', '.join(sorted(c.__name__ for c in _RULES_BY_CLASS))}) "
                f"or a rule object with a `{method}` method, got {rule!r}.")
    _RULES_BY_CLASS[layer_class] = rule


def _register_builtin_rules():
    rules = [(keras.layers.Dense, _DenseRule), (keras.layers.EinsumDense, _EinsumDenseRule),
             (keras.layers.Embedding, _EmbeddingRule),
             (keras.layers.LayerNormalization, _LayerNormRule),
             (keras.layers.GroupNormalization, _GroupNormRule),
             (keras.layers.Conv1D, _ConvRule), (keras.layers.Conv2D, _ConvRule)]
    for name in ("ReversibleEmbedding",):
        if hasattr(keras.layers, name):
            rules.append((getattr(keras.layers, name), _EmbeddingRule))
    if hasattr(keras.layers, "RMSNormalization"):
        rules.append((keras.layers.RMSNormalization, _RMSNormRule))
    hub = [("keras_hub.src.layers.modeling.position_embedding", "PositionEmbedding",
            _PositionEmbeddingRule, None),
           ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm", _RMSNormRule, None),
           ("keras_hub.src.layers.modeling.rms_normalization", "RMSNormalization",
            _RMSNormRule, None),
           ("keras_hub.src.models.gemma.rms_normalization", "RMSNormalization",
            _RMSNormRule, None),
           ("keras_hub.src.layers.modeling.masked_lm_head", "MaskedLMHead",
            _MaskedLMHeadRule, None),
           # KerasHub's subclass adds preset plumbing only: the contract is that it
           # inherits Keras's computation unchanged, checked here.
           ("keras_hub.src.layers.modeling.reversible_embedding", "ReversibleEmbedding",
            _EmbeddingRule, getattr(keras.layers, "ReversibleEmbedding", None))]
    for path, name, rule, base in hub:
        cls = _keras_hub_class(path, name)
        if cls is None:
            continue
        if base is not None and not all(
                getattr(cls, attr, None) is getattr(base, attr, None)
                for attr in ("call", "embeddings", "build")):
            continue
        rules.append((cls, rule))
    for cls, rule in rules:
        _RULES_BY_CLASS.setdefault(cls, rule)


_register_builtin_rules()


def _lora_unsupported(rule, layer):
    """A LoRA layer whose rule does not declare ``lora = True`` (it would describe
    the base computation only)."""
    return rule is not None and _lora_enabled(layer) and not getattr(rule, "lora", False)


def _rule_for(layer):
    if not getattr(layer, "built", False) or not _plain(layer):
        return None
    rule = _RULES_BY_CLASS.get(type(layer))
    if _lora_unsupported(rule, layer):
        return None
    try:
        return rule if rule is not None and rule.matches(layer) else None
    except AttributeError:
        return None
