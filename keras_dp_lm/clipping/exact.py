"""The exact engine: every example's full gradient, from one-example forward/backward passes.

It is the definition of per-example clipping (the fast rules are checked
against it) and the fallback for variables no fast rule covers. It vectorises
over the batch with ``tf.vectorized_map`` when oneDNN is disabled
(``TF_ENABLE_ONEDNN_OPTS=0`` set before TensorFlow is imported); with oneDNN on,
``vectorized_map`` over attention layers crashes TensorFlow 2.21 (double free),
so it loops over examples instead: the same numbers, at batch-of-one speed.
Gradients, norms and sums are taken in float32 whatever the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from keras_dp_lm.clipping.interface import ClippedSum
from keras_dp_lm.clipping.interface import batch_size_of
from keras_dp_lm.clipping.interface import check_examples_per_user
from keras_dp_lm.clipping.interface import clip_factors
from keras_dp_lm.clipping.interface import losses_and_outputs
from keras_dp_lm.clipping.interface import onednn_enabled
from keras_dp_lm.clipping.interface import scale_examples
from keras_dp_lm.clipping.interface import user_slot_mask
from keras_dp_lm.clipping.rounding import unit_norms

if TYPE_CHECKING:
    import keras


def tf_variable(v):
    """The tf.Variable behind a Keras variable (TensorFlow backend)."""
    inner = getattr(v, "_value", None)
    return inner if isinstance(inner, tf.Variable) else v


def _one_example(data, index, examples_per_user=1):
    """Example ``index`` of ``data`` as a batch of one (with ``k =
    examples_per_user > 1``: user ``index``'s rows ``index*k .. index*k+k-1``).

    gather + expand_dims keeps a static ``[1, ...]`` shape under XLA, where a
    dynamic ``t[i:i + 1]`` slice does not compile; rank-0 leaves pass through.
    """
    k = examples_per_user

    def one(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        if not t.shape.rank:
            return t
        if k == 1:
            return tf.expand_dims(tf.gather(t, index), 0)
        return tf.gather(t, index * k + tf.range(k))
    return tf.nest.map_structure(one, data)


def one_example_gradient(loss_fn, example, variables):
    """``(losses, grads)`` of one example (or one user's rows): the float32
    per-row losses and the gradient of their sum, zeros where unconnected."""
    tf_vars = [tf_variable(v) for v in variables]
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(tf_vars)
        losses = tf.cast(tf.reshape(losses_and_outputs(loss_fn(example))[0], [-1]),
                         tf.float32)
        loss = tf.reduce_sum(losses)
    grads = tape.gradient(loss, tf_vars, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return losses, [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads]


def per_example_gradients(loss_fn: Callable[[Any], tf.Tensor], data: Any,
                          variables: Sequence[keras.Variable | tf.Variable],
                          batch_size: int | tf.Tensor | None = None) -> list[tf.Tensor]:
    """Exact per-example gradients: one float32 ``[B, *v.shape]`` tensor per variable.

    ``loss_fn(batch)`` returns the per-example losses of any slice of ``data``
    (a nested structure of tensors with a leading batch dimension); example
    ``i``'s gradient is that of its summed loss with respect to ``variables``
    (zeros where unconnected). ``batch_size``: B, the number of examples taken
    from the front of ``data``; None reads it from ``data``
    (:func:`batch_size_of`).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.clipping.exact import per_example_gradients
        >>> layer = keras.layers.Dense(1, use_bias=False)
        >>> layer.build((None, 2))
        >>> x = np.array([[1.0, 0.0], [0.0, 2.0]], "float32")
        >>> (g,) = per_example_gradients(lambda b: keras.ops.sum(layer(b), axis=-1), x,
        ...                              [layer.kernel])
        >>> g.numpy()[:, :, 0].tolist()
        [[1.0, 0.0], [0.0, 2.0]]
    """
    variables = list(variables)
    size = batch_size_of(data) if batch_size is None else batch_size

    def one(i):
        return one_example_gradient(loss_fn, _one_example(data, i), variables)[1]

    spec = [tf.TensorSpec(v.shape, tf.float32) for v in variables]
    return tf.map_fn(one, tf.range(size), fn_output_signature=spec)


def exact_clipped_sum(loss_fn: Callable[[Any], tf.Tensor | tuple[tf.Tensor, Any]], data: Any,
                      variables: Sequence[keras.Variable | tf.Variable],
                      l2_norm_clip: float | tf.Tensor, vectorize: bool | None = None,
                      slot_mask: tf.Tensor | None = None, examples_per_user: int = 1) -> ClippedSum:
    """Exact per-example clipping by computing every example's gradient.

    Args:
        loss_fn: ``loss_fn(batch) -> [b]`` per-example losses for any slice of
            ``data`` (forward pass in training mode).
        data: nested structure of tensors with a leading batch dimension.
        variables: the trainable variables to differentiate.
        l2_norm_clip: the clipping bound C.
        vectorize: ``True`` uses ``tf.vectorized_map`` (needs oneDNN off for
            attention layers), ``False`` a ``tf.while_loop`` that keeps only the
            running sum (memory of one example's gradient); ``None`` picks
            vectorisation exactly when oneDNN is off.
        slot_mask: optional ``[B]``, 0 on padding slots (they add nothing).
        examples_per_user: ``k``: rows ``u*k .. u*k+k-1`` are user ``u``, whose
            summed gradient is the unit that is clipped (``norms`` is ``[B/k]``).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.clipping import exact_clipped_sum
        >>> layer = keras.layers.Dense(1, use_bias=False)
        >>> layer.build((None, 2))
        >>> x = np.array([[3.0, 4.0], [0.3, 0.4]], "float32")
        >>> result = exact_clipped_sum(lambda b: keras.ops.sum(layer(b), axis=-1), x,
        ...                            [layer.kernel], l2_norm_clip=1.0)
        >>> [round(float(n), 4) for n in result.norms]
        [5.0, 0.5]
        >>> [round(float(g), 4) for g in result.grads[0][:, 0]]   # 0.2 * g1 + g2
        [0.9, 1.2]
    """
    variables = list(variables)
    data = tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t),
                                 data)
    k = check_examples_per_user(examples_per_user)
    if vectorize is None:
        vectorize = not onednn_enabled()
    if vectorize:
        leaves = tf.nest.flatten(data)  # tf.nest keeps None as a leaf
        present = [i for i, t in enumerate(leaves) if t is not None]

        def per_unit(tensors):
            filled = list(leaves)
            for i, t in zip(present, tensors):
                filled[i] = t if k > 1 else t[None]
            unit = tf.nest.pack_sequence_as(data, filled)
            losses, grads = one_example_gradient(loss_fn, unit, variables)
            return losses, unit_norms(grads), grads

        def by_user(t):
            return t if k == 1 else tf.reshape(t, tf.concat([[-1, k], tf.shape(t)[1:]], 0))

        losses, norms, grads = tf.vectorized_map(per_unit,
                                                 [by_user(leaves[i]) for i in present])
        units = None if slot_mask is None else user_slot_mask(slot_mask, k)
        factors = clip_factors(norms, l2_norm_clip, units)
        return ClippedSum([tf.reduce_sum(scale_examples(g, factors), axis=0) for g in grads],
                          norms, tf.reshape(losses, [-1]))

    size = batch_size_of(data) // k
    mask = tf.ones([size], tf.float32) if slot_mask is None else user_slot_mask(slot_mask, k)

    def body(i, sums, losses, norms):
        rows, grads = one_example_gradient(loss_fn, _one_example(data, i, k), variables)
        norm = unit_norms(grads)
        factor = clip_factors(norm, l2_norm_clip, tf.gather(mask, i))
        sums = [s + scale_examples(g[None], factor[None])[0] for s, g in zip(sums, grads)]
        return i + 1, sums, losses.write(i, rows), norms.write(i, norm)

    sums = [tf.zeros(v.shape, tf.float32) for v in variables]
    losses = tf.TensorArray(tf.float32, size=size, element_shape=[k])
    norms = tf.TensorArray(tf.float32, size=size, element_shape=[])
    _, sums, losses, norms = tf.while_loop(
        lambda i, *_: i < size, body, (tf.constant(0), sums, losses, norms),
        parallel_iterations=1)
    return ClippedSum(sums, norms.stack(), tf.reshape(losses.stack(), [-1]))
