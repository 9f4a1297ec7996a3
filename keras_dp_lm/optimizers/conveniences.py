"""``DPSGD``, ``DPAdam``, ``DPAdamW``, ``DPAdamBC``: a :class:`DPOptimizer` around SGD /
Adam / AdamW / :class:`NoiseCorrectedAdam`.

They take the inner optimizer's arguments (``learning_rate``, ``momentum``,
``beta_1``, ``weight_decay``, ...) and the privacy arguments by keyword, the
argument names TensorFlow Privacy's ``DPKeras*Optimizer`` used.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras

from keras_dp_lm.optimizers.dp_optimizer import DPOptimizer
from keras_dp_lm.optimizers.noise_corrected_adam import NoiseCorrectedAdam


_ARGS_DOC = """
Args:
    *args: positional arguments of ``{inner}`` (the first is ``learning_rate``).
    l2_norm_clip: required, by keyword. Bound C on each example's gradient L2 norm.
    noise_multiplier: required, by keyword. sigma: the summed clipped gradient
        gets Gaussian noise of std ``sigma * C`` once per logical batch. With the
        sampling rate and the number of updates it decides epsilon:
        :func:`keras_dp_lm.recipes.suggest_recipe` chooses both (and the batch,
        the steps and a scaled learning rate) for a target epsilon, and
        :func:`keras_dp_lm.accounting.calibrate_noise_multiplier` gives sigma
        for a given epsilon, batch and number of updates.
    gradient_accumulation_steps: k micro-batches per train step, noised once
        (see :class:`DPOptimizer`; default 1).
    expected_batch_size: divisor of the noised sum; required with padded
        (Poisson) batches: ``q * N`` (default ``None``: the batch's examples).
    seed: integer seed for the noise; ``None`` (default) draws it from OS entropy.
    clipping: ``"auto"`` (default), ``"fast"`` or ``"exact"`` (see :class:`DPOptimizer`).
    name: the optimizer's name (default ``"dp_<inner name>"``).
    inner_optimizer: an already built ``{inner}`` instead of its arguments.
    **kwargs: other keyword arguments of ``{inner}`` ({examples}).
"""


def _missing_privacy_message(name, missing):
    names = " and ".join(f"`{m}`" for m in missing)
    return (
        f"{name} needs {names} (by keyword): the privacy arguments have no default, "
        f"because together with the batch size and the number of updates they decide "
        f"epsilon. For example {name}(learning_rate=1e-3, l2_norm_clip=1.0, "
        "noise_multiplier=1.1). To choose them for a target epsilon, "
        "`keras_dp_lm.recipes.suggest_recipe(dataset_size, target_epsilon=3.0, "
        "delta=...)` gives every DP hyperparameter (`recipe.optimizer()` builds the "
        "optimizer); `keras_dp_lm.calibrate_noise_multiplier(target_epsilon, delta, "
        "sampling_rate, steps)` gives the noise multiplier alone.")


class _InnerOptimizerConvenience(DPOptimizer):
    """A :class:`DPOptimizer` that builds its inner optimizer, ``_inner_class``, from
    the inner optimizer's own arguments (the base of :class:`DPSGD`, :class:`DPAdam`,
    :class:`DPAdamW` and :class:`DPAdamBC`)."""

    _inner_class = None

    def __init__(self, *args: Any, l2_norm_clip: float | None = None,
                 noise_multiplier: float | None = None, gradient_accumulation_steps: int = 1,
                 expected_batch_size: float | None = None, seed: int | None = None,
                 clipping: str = "auto", name: str | None = None,
                 inner_optimizer: keras.optimizers.Optimizer | None = None, **kwargs: Any) -> None:
        cls_name, inner_class = type(self).__name__, type(self)._inner_class
        missing = [arg for arg, value in (("l2_norm_clip", l2_norm_clip),
                                          ("noise_multiplier", noise_multiplier))
                   if value is None]
        if missing:
            raise TypeError(_missing_privacy_message(cls_name, missing))
        if inner_optimizer is None:
            inner_optimizer = inner_class(*args, **kwargs)
        elif args or kwargs:
            raise ValueError(f"{cls_name}: pass either inner_optimizer or its arguments, "
                             "not both.")
        elif not isinstance(inner_optimizer, inner_class):
            raise TypeError(
                f"{cls_name} wraps a {inner_class.__name__}, got "
                f"{type(inner_optimizer).__name__}: use DPOptimizer(inner_optimizer, ...) "
                "for another optimizer.")
        super().__init__(inner_optimizer, l2_norm_clip=l2_norm_clip,
                         noise_multiplier=noise_multiplier,
                         gradient_accumulation_steps=gradient_accumulation_steps,
                         expected_batch_size=expected_batch_size, seed=seed,
                         clipping=clipping, name=name)


# What the signature shows (help(), the API reference): the privacy arguments are
# required floats; None above only lets the missing ones be named in one clear error.
_init = _InnerOptimizerConvenience.__init__
_init.__signature__ = inspect.signature(_init).replace(parameters=[
    p.replace(default=inspect.Parameter.empty, annotation="float")
    if p.name in ("l2_norm_clip", "noise_multiplier") else p
    for p in inspect.signature(_init).parameters.values()])


def _doc(inner_class, example, inner_path=None, examples=""):
    """The docstring of the convenience around ``inner_class``."""
    name = "DP" + inner_class.__name__ if inner_class is not NoiseCorrectedAdam else "DPAdamBC"
    inner_path = inner_path or f"keras.optimizers.{inner_class.__name__}"
    return (f"Differentially private ``{inner_path}``.\n\n"
            f"``{name}(learning_rate, ..., l2_norm_clip=..., noise_multiplier=..., ...)``: "
            f"positional and other keyword arguments go to ``{inner_class.__name__}``; the "
            "privacy arguments are those of :class:`DPOptimizer`.\n"
            + _ARGS_DOC.format(inner=inner_class.__name__, examples=examples)
            + "\nExample:\n" + example)


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPSGD(_InnerOptimizerConvenience):
    _inner_class = keras.optimizers.SGD
    __doc__ = _doc(keras.optimizers.SGD, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPSGD(0.1, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.1)
    >>> float(opt.inner_optimizer.momentum), opt.l2_norm_clip
    (0.9, 1.0)
""", examples="``momentum``, ``nesterov``, ...")


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPAdam(_InnerOptimizerConvenience):
    _inner_class = keras.optimizers.Adam
    __doc__ = _doc(keras.optimizers.Adam, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=0.1, noise_multiplier=0.8,
    ...                  gradient_accumulation_steps=4)
    >>> opt.dp_accumulation_steps
    4
""", examples="``beta_1``, ``beta_2``, ``epsilon``, ...")


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPAdamW(_InnerOptimizerConvenience):
    _inner_class = keras.optimizers.AdamW
    __doc__ = _doc(keras.optimizers.AdamW, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdamW(learning_rate=1e-3, weight_decay=0.01, l2_norm_clip=1.0,
    ...                   noise_multiplier=1.0)
    >>> float(opt.inner_optimizer.weight_decay)
    0.01
""", examples="``weight_decay``, ``beta_1``, ...")


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPAdamBC(_InnerOptimizerConvenience):
    _inner_class = NoiseCorrectedAdam
    __doc__ = _doc(NoiseCorrectedAdam, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdamBC(learning_rate=1e-4, floor_ratio=0.1, l2_norm_clip=0.1,
    ...                    noise_multiplier=0.8)
    >>> type(opt.inner_optimizer).__name__, opt.inner_optimizer.floor_ratio
    ('NoiseCorrectedAdam', 0.1)
""", inner_path="keras_dp_lm.optimizers.NoiseCorrectedAdam",
        examples="``floor_ratio``, ``beta_1``, ...")
