"""The one interface of per-example clipping: its result type, clip factors and dispatch.

Every engine returns a :class:`ClippedSum`: the sum over the batch of each
example's gradient scaled by ``min(1, C / ||g_i||)`` (no noise, not divided),
the per-example norms and losses. :func:`clipped_sum` picks the engine:
exact per-example gradients (:mod:`keras_dp_lm.clipping.exact`) or per-layer
fast rules with exact fallback (:mod:`keras_dp_lm.clipping.fast`).
"""

import collections
import os

import tensorflow as tf

ClippedSum = collections.namedtuple(
    "ClippedSum", ["grads", "norms", "losses", "outputs"], defaults=(None,))
ClippedSum.__doc__ = """Result of per-example clipping.

grads: list aligned with the variables: sum_i clip(g_i) (no noise, not divided).
norms: [B] per-example gradient L2 norms before clipping.
losses: [B] per-example losses.
outputs: model outputs of a batched forward pass, or None when none was made.
"""


class UncoveredLayersError(ValueError):
    """Raised by ``method="fast"`` when some trainable variables have no fast rule.

    ``uncovered`` maps a layer description to the list of its variable paths.
    """

    def __init__(self, uncovered, reason=None):
        self.uncovered = dict(uncovered)
        lines = [f"  {layer}: {', '.join(paths)}"
                 for layer, paths in self.uncovered.items()]
        msg = ("Fast per-example clipping has no rule for these trainable "
               "variables" + (f" ({reason})" if reason else "") + ":\n"
               + "\n".join(lines)
               + "\nUse method='auto' to compute exact (slow) per-example "
               "gradients for just these variables, freeze them "
               "(layer.trainable = False), use covered layers (Dense, "
               "EinsumDense, MultiHeadAttention, Embedding, ReversibleEmbedding, "
               "PositionEmbedding, LayerNormalization, RMS norms), or declare a "
               "rule with keras_dp_lm.clipping.register_clipping_rule.")
        super().__init__(msg)


def onednn_enabled():
    """Whether TensorFlow's oneDNN kernels are on (decided at TF import)."""
    return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false", "False")


def clip_factors(norms, l2_norm_clip, slot_mask=None):
    """``min(1, C / norm)`` per example, in float32.

    1 for a zero gradient; 0 on padding slots when ``slot_mask`` (1 real,
    0 padding) is given, so they add exactly nothing to the clipped sum.

    Example:
        >>> from keras_dp_lm.clipping import clip_factors
        >>> clip_factors([0.5, 2.0, 4.0], 1.0, slot_mask=[1, 1, 0]).numpy().tolist()
        [1.0, 0.5, 0.0]
    """
    norms = tf.cast(norms, tf.float32)
    clip = tf.cast(l2_norm_clip, tf.float32)
    factors = clip / tf.maximum(norms, clip)
    if slot_mask is not None:
        factors = tf.where(tf.cast(slot_mask, tf.float32) > 0, factors, 0.0)
    return factors


def batch_size_of(data):
    """Leading dimension of the first tensor in a nested structure."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def losses_and_outputs(result):
    """``loss_fn`` may return ``losses`` or ``(losses, model_outputs)``."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    return result, None


def clipped_sum(model, loss_fn, data, l2_norm_clip, method="auto", slot_mask=None):
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

    Returns:
        :class:`ClippedSum` with ``grads`` in the variables' dtypes.

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
        from keras_dp_lm.clipping.exact import exact_clipped_sum

        def losses_only(part):
            return losses_and_outputs(loss_fn(part))[0]

        result = exact_clipped_sum(losses_only, data, model.trainable_variables,
                                   l2_norm_clip, slot_mask=slot_mask)
    elif method in ("auto", "fast"):
        from keras_dp_lm.clipping.fast import fast_clipped_sum

        result = fast_clipped_sum(model, loss_fn, data, l2_norm_clip, method=method,
                                  slot_mask=slot_mask)
    else:
        raise ValueError(f"method must be 'auto', 'fast' or 'exact', got {method!r}.")
    grads = [tf.cast(g, v.dtype) for g, v in zip(result.grads, model.trainable_variables)]
    return result._replace(grads=grads)
