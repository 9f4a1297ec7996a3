"""``NoiseCorrectedAdam``: Adam whose second moment has the DP noise taken out.

Under DP the averaged gradient is ``g + z`` with ``z ~ N(0, phi I)``,
``phi = (sigma C / B)^2``. The noise does not bias Adam's first moment but adds
``phi`` to every coordinate of the second: with the small clipping norms DP
fine-tuning uses, ``phi`` is usually larger than the signal's ``s^2``, so every
coordinate's step is about ``rate * m / sqrt(phi)`` and DP-Adam behaves like
DP-SGD with a rescaled rate (Tang, Shpilevskiy & Lecuyer, AAAI 2024,
"DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias
Correction)"). This optimizer divides by

    sqrt(max(v_hat - phi, floor_ratio * phi)) + epsilon

instead of ``sqrt(v_hat) + epsilon``. ``phi`` is set by the DP optimizer that
wraps it, before every update (:meth:`set_dp_noise_variance`), from the noise it
actually added; it depends only on ``sigma``, ``C`` and the divisor, so the
correction is post-processing and costs no privacy. With ``phi = 0`` (no DP
wrapper, or ``noise_multiplier=0``) it is Adam, except that ``epsilon`` is added
to ``sqrt(v_hat)`` (as in Tang et al.) where Keras's Adam adds it to ``sqrt(v)``: the
two differ only for gradients within a few orders of magnitude of ``epsilon``.

The floor bounds the step of a coordinate that holds only noise: its ``m``
has std ``sqrt(phi (1 - beta_1) / (1 + beta_1))`` (0.23 ``sqrt(phi)`` at
``beta_1 = 0.9``), so its step is about ``0.23 / sqrt(floor_ratio)`` times the
rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
from keras import ops

from keras_dp_lm.optimizers.privacy_parameters import _check_number

if TYPE_CHECKING:
    import tensorflow as tf


def _beta(name, value):
    beta = _check_number(name, value, allow_zero=True)
    if beta >= 1:
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
    return beta


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class NoiseCorrectedAdam(keras.optimizers.Optimizer):
    """Adam with the DP noise's variance removed from its second moment.

    Use it through :class:`~keras_dp_lm.optimizers.DPAdamBC` (or as the inner
    optimizer of :class:`~keras_dp_lm.optimizers.DPOptimizer`), which sets the
    noise variance ``(noise_multiplier * l2_norm_clip / B)^2`` before each update.

    Args:
        learning_rate: as Adam's. Because the noise no longer fills the
            denominator, the rate that works is close to the non-private one
            (square-root scaled for the batch), not DP-Adam's larger one.
        beta_1, beta_2, epsilon: as Adam's.
        floor_ratio: the corrected second moment is floored at
            ``floor_ratio * phi`` (``gamma'`` in Tang et al.). Smaller values let
            weak-signal coordinates move more, and pure-noise coordinates too.
        name: the optimizer's name (default ``"noise_corrected_adam"``).
        **kwargs: the other arguments of ``keras.optimizers.Optimizer``.

    Example:
        >>> import numpy as np
        >>> opt = NoiseCorrectedAdam(learning_rate=0.1)
        >>> w = keras.Variable(np.zeros(2, "float32"))
        >>> opt.set_dp_noise_variance(0.25)   # what a DP wrapper does
        >>> _ = opt.apply_gradients([(ops.convert_to_tensor([1.0, 0.1]), w)])
        >>> np.round(ops.convert_to_numpy(w), 3)   # |g|^2 > phi: Adam's step; else floored
        array([-0.115, -0.063], dtype=float32)
    """

    def __init__(self,
                 learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 1e-3,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                 floor_ratio: float = 0.1, name: str = "noise_corrected_adam",
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = _beta("beta_1", beta_1)
        self.beta_2 = _beta("beta_2", beta_2)
        self.epsilon = _check_number("epsilon", epsilon, allow_zero=True)
        # > 0: a coordinate holding only noise would otherwise take an unbounded step
        self.floor_ratio = _check_number("floor_ratio", floor_ratio)
        with keras.name_scope(self.name, caller=self):
            self.dp_noise_variance = keras.Variable(
                0.0, name="dp_noise_variance", dtype="float32", trainable=False,
                aggregation="only_first_replica")
        self._track_variable(self.dp_noise_variance)

    def set_dp_noise_variance(self, variance: float | tf.Tensor) -> None:
        """Set ``phi``, the per-coordinate variance of the noise in the gradients
        of the next update (called by the DP optimizer that wraps this one)."""
        if isinstance(variance, (int, float)):
            _check_number("variance", variance, allow_zero=True)
        self.dp_noise_variance.assign(ops.cast(variance, "float32"))

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        low = [v.path for v in var_list if v.dtype in ("float16", "bfloat16")]
        if low:
            raise ValueError(
                f"NoiseCorrectedAdam does not train 16-bit variables ({low[0]}): the noise "
                "variance and the second moment underflow or round away in 16 bits. Use "
                "the 'mixed_bfloat16' policy (float32 variables, bfloat16 compute).")
        super().build(var_list)
        self._first_moments = [self.add_variable_from_reference(v, "momentum")
                               for v in var_list]
        self._second_moments = [self.add_variable_from_reference(v, "velocity")
                                for v in var_list]

    def update_step(self, gradient: tf.Tensor, variable: keras.Variable,
                    learning_rate: float | tf.Tensor) -> None:
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        index = self._get_variable_index(variable)
        m, v = self._first_moments[index], self._second_moments[index]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                        1 - self.beta_2))
        m_hat = ops.divide(m, 1 - ops.power(ops.cast(self.beta_1, dtype), step))
        v_hat = ops.divide(v, 1 - ops.power(ops.cast(self.beta_2, dtype), step))
        phi = ops.cast(self.dp_noise_variance, dtype)
        corrected = ops.maximum(ops.subtract(v_hat, phi), self.floor_ratio * phi)
        self.assign_sub(variable, ops.divide(ops.multiply(lr, m_hat),
                                             ops.add(ops.sqrt(corrected), self.epsilon)))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2,
                       "epsilon": self.epsilon, "floor_ratio": self.floor_ratio})
        return config
