"""Naive, one-example-at-a-time references the fast and vectorized code is checked against."""

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree


def naive_per_unit(model, loss_fn, data, examples_per_unit=1):
    """Each unit's gradient, one unit at a time: rows ``u*k .. u*k+k-1`` (one example
    when ``k == 1``, a user's rows otherwise) differentiated together. A list over
    units of float64 lists aligned with ``model.trainable_variables``."""
    k = examples_per_unit
    size = len(tf.nest.flatten(data)[0])
    variables = model.trainable_variables
    out = []
    for u in range(size // k):
        rows = tf.nest.map_structure(lambda t: t[u * k:(u + 1) * k], data)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(rows))
        grads = tape.gradient(loss, variables)
        out.append([np.zeros(v.shape) if g is None else
                    np.asarray(tf.convert_to_tensor(g), np.float64)
                    for g, v in zip(grads, variables)])
    return out


def naive_clip(per_unit, clip):
    """``(norms, clipped sums)`` of per-unit gradients from :func:`naive_per_unit`."""
    norms = np.array([np.sqrt(sum(float(np.sum(g * g)) for g in grads))
                      for grads in per_unit])
    sums = [np.zeros_like(g) for g in per_unit[0]]
    for grads, norm in zip(per_unit, norms):
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        sums = [s + factor * g for s, g in zip(sums, grads)]
    return norms, sums


def token_loss(model, ids, mask):
    """Per-example next-token CE, padding-weighted, normalised by the example's own tokens."""
    logits = model({"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, training=True)
    weights = tf.cast(mask[:, 1:], tf.float32)
    ce = keras.losses.sparse_categorical_crossentropy(ids[:, 1:], logits, from_logits=True)
    return tf.reduce_sum(ce * weights, axis=1) / tf.reduce_sum(weights, axis=1)


def naive_clipped_sum(model, x, y, sample_weight, l2_norm_clip):
    """Loop over examples: Keras's own compute_loss on a batch of one, clip, sum."""
    size = len(tree.flatten(x)[0])
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    norms, losses = [], []
    for i in range(size):
        xi = tree.map_structure(lambda t: t[i:i + 1], x)
        yi = tree.map_structure(lambda t: t[i:i + 1], y)
        swi = None if sample_weight is None else sample_weight[i:i + 1]
        with tf.GradientTape() as tape:
            pred = model(xi, training=True)
            loss = model.compute_loss(x=xi, y=yi, y_pred=pred, sample_weight=swi)
        grads = [np.asarray(tf.convert_to_tensor(g) if g is not None else tf.zeros_like(v),
                            np.float64)
                 for g, v in zip(tape.gradient(loss, variables), variables)]
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
        factor = min(1.0, l2_norm_clip / norm) if norm > 0 else 1.0
        total = [t + factor * g for t, g in zip(total, grads)]
        norms.append(norm)
        losses.append(float(loss))
    return total, np.array(norms), np.array(losses)


def max_relative_error(actual, expected):
    """Relative L2 error of a list of tensors, over all of them together.

    (Per-variable ratios are meaningless for variables whose gradient is zero in
    exact arithmetic, such as attention key biases.)
    """
    diff = sum(float(np.sum((np.asarray(a, np.float64) - e) ** 2)) for a, e in zip(actual, expected))
    total = sum(float(np.sum(np.asarray(e, np.float64) ** 2)) for e in expected)
    return np.sqrt(diff) / max(np.sqrt(total), 1e-30)
