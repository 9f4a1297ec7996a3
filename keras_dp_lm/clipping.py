"""Per-example clipping: the exact reference, and the dispatch to fast rules.

Every method returns a :class:`ClippedSum`: the sum over the batch of each
example's gradient scaled by ``min(1, C / ||g_i||)``, with no noise and no
division, plus the per-example norms and losses.

``exact_clipped_sum`` computes each example's full gradient. It vectorises over
the batch with ``tf.vectorized_map`` when oneDNN is disabled
(``TF_ENABLE_ONEDNN_OPTS=0`` set before TensorFlow is imported); with oneDNN on,
``vectorized_map`` over attention layers crashes TensorFlow 2.21 (double free), so
it loops over examples with ``tf.while_loop`` instead: the same numbers, at
batch-of-one speed and with the memory of one example's gradient.
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


def _map(fn, structure):
    return tf.nest.map_structure(fn, structure)


def _flatten(structure):
    return tf.nest.flatten(structure)


def onednn_enabled():
    """Whether TensorFlow's oneDNN kernels are on (decided at TF import)."""
    return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false", "False")


def clip_factors(norms, l2_norm_clip, slot_mask=None):
    """``min(1, C / norm)`` per example (float32); 1 for a zero gradient, 0 on
    padding slots when ``slot_mask`` (1 real, 0 padding) is given."""
    norms = tf.cast(norms, tf.float32)
    clip = tf.cast(l2_norm_clip, tf.float32)
    factors = clip / tf.maximum(norms, clip)
    if slot_mask is not None:
        factors = tf.where(tf.cast(slot_mask, tf.float32) > 0, factors, 0.0)
    return factors


def batch_size_of(data):
    """Leading dimension of the first tensor in a nested structure."""
    first = next(t for t in _flatten(data) if t is not None)
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def _dense(grad, variable):
    """The gradient as a float32 tensor (norms and sums are taken in float32)."""
    if grad is None:
        return tf.zeros(variable.shape, tf.float32)
    return tf.cast(tf.convert_to_tensor(grad), tf.float32)


def _global_norm(grads):
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))


def _one_example_gradient(loss_fn, example, variables):
    with tf.GradientTape() as tape:
        loss = tf.reshape(loss_fn(example), [])
    grads = tape.gradient(loss, variables)
    return loss, [_dense(g, v) for g, v in zip(grads, variables)]


def _slice(data, index):
    # gather + expand_dims keeps a static [1, ...] shape under XLA, where a
    # dynamic t[i:i + 1] slice does not compile.
    return _map(
        lambda t: None if t is None else tf.expand_dims(tf.gather(t, index), 0), data)


def exact_clipped_sum(loss_fn, data, variables, l2_norm_clip, vectorize=None,
                      slot_mask=None):
    """Exact per-example clipping by computing every example's gradient.

    Args:
        loss_fn: ``loss_fn(batch) -> [b]`` per-example losses for any slice of
            ``data`` (forward pass in training mode).
        data: nested structure of tensors with a leading batch dimension.
        variables: the trainable variables to differentiate.
        l2_norm_clip: the clipping bound C.
        vectorize: ``True`` uses ``tf.vectorized_map`` (needs oneDNN off for
            attention layers), ``False`` a ``tf.while_loop``; ``None`` picks
            vectorisation exactly when oneDNN is off.
    """
    variables = list(variables)
    data = _map(lambda t: None if t is None else tf.convert_to_tensor(t), data)
    if vectorize is None:
        vectorize = not onednn_enabled()
    if vectorize:
        leaves = _flatten(data)  # tf.nest keeps None as a leaf
        present = [i for i, t in enumerate(leaves) if t is not None]

        def per_example(tensors):
            filled = list(leaves)
            for i, t in zip(present, tensors):
                filled[i] = t[None]
            example = tf.nest.pack_sequence_as(data, filled)
            loss, grads = _one_example_gradient(loss_fn, example, variables)
            return tf.cast(loss, tf.float32), _global_norm(grads), grads

        losses, norms, per_example_grads = tf.vectorized_map(
            per_example, [leaves[i] for i in present])
        factors = clip_factors(norms, l2_norm_clip, slot_mask)
        grads = [tf.tensordot(factors, g, axes=1) for g in per_example_grads]
        return ClippedSum(grads, norms, losses, None)

    size = batch_size_of(data)

    mask = tf.ones([size], tf.float32) if slot_mask is None else tf.cast(slot_mask, tf.float32)

    def body(i, sums, losses, norms):
        loss, grads = _one_example_gradient(loss_fn, _slice(data, i), variables)
        norm = _global_norm(grads)
        factor = clip_factors(norm, l2_norm_clip, tf.gather(mask, i))
        sums = [s + factor * g for s, g in zip(sums, grads)]
        return i + 1, sums, losses.write(i, tf.cast(loss, tf.float32)), norms.write(i, norm)

    sums = [tf.zeros(v.shape, tf.float32) for v in variables]
    losses = tf.TensorArray(tf.float32, size=size, element_shape=[])
    norms = tf.TensorArray(tf.float32, size=size, element_shape=[])
    _, sums, losses, norms = tf.while_loop(
        lambda i, *_: i < size, body, (tf.constant(0), sums, losses, norms),
        parallel_iterations=1)
    return ClippedSum(sums, norms.stack(), losses.stack(), None)


def _losses_only(loss_fn):
    def losses(part):
        result = loss_fn(part)
        return result[0] if isinstance(result, tuple) else result
    return losses


def clipped_sum(model, loss_fn, data, l2_norm_clip, method="auto", slot_mask=None):
    """Dispatch to the exact or fast per-example clipping.

    ``loss_fn(batch)`` returns ``[b]`` per-example losses, or ``(losses, outputs)``
    so that the fast path can hand the batched outputs back for metrics.
    ``slot_mask`` (``[B]``, 0 on padding slots) zeroes padding slots' clip
    factors. ``method``: ``"exact"`` computes every example's full gradient; ``"fast"``
    uses per-layer rules (:mod:`keras_dp_lm.fast_clipping`) and refuses uncovered
    layers; ``"auto"`` uses per-layer rules where they exist and exact
    per-example gradients for the remaining variables.
    """
    if method == "exact":
        result = exact_clipped_sum(_losses_only(loss_fn), data, model.trainable_variables,
                                   l2_norm_clip, slot_mask=slot_mask)
    else:
        from keras_dp_lm import fast_clipping  # imported lazily: it patches layer calls

        result = ClippedSum(*fast_clipping.fast_clipped_sum(
            model, loss_fn, data, l2_norm_clip, method=method, slot_mask=slot_mask))
    grads = [tf.cast(g, v.dtype) for g, v in zip(result.grads, model.trainable_variables)]
    return result._replace(grads=grads)
