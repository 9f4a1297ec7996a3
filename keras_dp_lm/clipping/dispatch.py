"""``clipped_sum``: per-example clipping of a model by the engine its DP optimizer names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from keras_dp_lm.clipping.exact import exact_clipped_sum
from keras_dp_lm.clipping.fast import fast_clipped_sum
from keras_dp_lm.clipping.interface import losses_and_outputs
from keras_dp_lm.clipping.interface import sum_dtype

if TYPE_CHECKING:
    import keras

    from keras_dp_lm.clipping.interface import ClippedSum


def clipped_sum(model: keras.Model, loss_fn: Callable[[Any], tf.Tensor | tuple[tf.Tensor, Any]],
                data: Any, l2_norm_clip: float, method: str = "auto",
                slot_mask: tf.Tensor | None = None, examples_per_user: int = 1) -> ClippedSum:
    """Per-example clipping of ``model``'s trainable variables by the chosen engine.

    Args:
        model: a built Keras 3 model (TensorFlow backend).
        loss_fn: ``loss_fn(batch) -> [b]`` per-example losses (training-mode
            forward pass) for any slice of ``data``, or ``(losses, outputs)``
            so that the fast path can hand the batched outputs back for metrics.
        data: nested structure of tensors with a leading batch dimension.
        l2_norm_clip: the clipping bound ``C``.
        method: ``"exact"`` computes every example's full gradient; ``"fast"``
            uses per-layer rules and raises :class:`UncoveredLayersError` for
            uncovered variables; ``"auto"`` uses the rules where they exist and
            exact per-example gradients for the remaining variables.
        slot_mask: optional ``[B]``, 0 on padding slots (zero clip factor).
        examples_per_user: ``k``: rows ``u*k .. u*k+k-1`` belong to user ``u``,
            and each user's summed gradient is clipped (user-level DP);
            ``norms`` is then ``[B/k]``.

    Returns:
        :class:`ClippedSum` with ``grads`` in the variables' dtypes (float32 for
        16-bit variables: the optimizer adds the noise before any rounding).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.clipping import clipped_sum
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> x, y = np.ones((3, 2), "float32"), np.zeros((3, 1), "float32")
        >>> def loss_fn(batch):
        ...     return keras.ops.mean(keras.ops.square(model(batch[0]) - batch[1]), axis=-1)
        >>> result = clipped_sum(model, loss_fn, (x, y), l2_norm_clip=1e-3)
        >>> float(keras.ops.norm(result.grads[0])) <= 3 * 1e-3 + 1e-9
        True
    """
    if method == "exact":
        def losses_only(part):
            return losses_and_outputs(loss_fn(part))[0]

        result = exact_clipped_sum(losses_only, data, model.trainable_variables,
                                   l2_norm_clip, slot_mask=slot_mask,
                                   examples_per_user=examples_per_user)
    elif method in ("auto", "fast"):
        result = fast_clipped_sum(model, loss_fn, data, l2_norm_clip, method=method,
                                  slot_mask=slot_mask, examples_per_user=examples_per_user)
    else:
        raise ValueError(f"method must be 'auto', 'fast' or 'exact', got {method!r}.")
    grads = [tf.cast(g, sum_dtype(v))
             for g, v in zip(result.grads, model.trainable_variables)]
    return result._replace(grads=grads)
