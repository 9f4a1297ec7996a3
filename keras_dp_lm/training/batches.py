"""A batch as the DP step gets it: the real-slot mask, the sampling rate and micro-batches.

:func:`_unpack` splits a batch into ``(x, y, sample_weight)``, its real-slot
mask (attached by :func:`keras_dp_lm.data.attach_real_slots`), its Poisson
rate and, for a user batch, its examples per user; the other helpers pad a
batch to whole micro-batches and split it into them.
"""

import keras
import tensorflow as tf

from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.data import split_real_slots
from keras_dp_lm.errors import PrivacyRefusalError

tree = internals.tree


def _batch_size(batch):
    first = next(t for t in tree.flatten(batch) if t is not None)
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def _pad_to_multiple(data, mask, num_micro):
    """Pad every leaf (and the mask) with inert slots up to a multiple of k."""
    size = _batch_size(mask)
    if isinstance(size, int):
        pad = (-size) % num_micro
        if pad == 0:
            return data, mask
    else:
        pad = tf.math.floormod(-size, num_micro)

    def grow(t):
        if t is None:
            return None
        filler = tf.gather(t, tf.zeros([pad], tf.int32))  # copies of slot 0, masked out
        return tf.concat([t, filler], 0)

    return tree.map_structure(grow, data), tf.concat([mask, tf.zeros([pad], mask.dtype)], 0)


def _split_micro_batches(data, num_micro):
    """Reshape each leaf ``[B, ...]`` to ``[k, B / k, ...]``."""
    def split(t):
        if t is None:
            return None
        shape = tf.concat([[num_micro, tf.shape(t)[0] // num_micro], tf.shape(t)[1:]], 0)
        return tf.reshape(t, shape)
    return tree.map_structure(split, data)


def _micro_batch(data, index):
    return tree.map_structure(lambda t: None if t is None else t[index], data)


def _has_real_slots(data):
    _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    return split_real_slots(sample_weight)[0] is not None


def _unpack(data):
    """``(x, y, sample_weight, real-slot mask [B], sampling rate, examples_per_user)``.

    A real-slot mask of shape ``[U, k]`` (from
    :func:`keras_dp_lm.data.poisson_user_batches`) marks a user batch:
    ``examples_per_user`` is then ``k``; else it is ``None``.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask, rate, sample_weight = split_real_slots(sample_weight)
    x, y, sample_weight = tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight))
    size = _batch_size((x, y, sample_weight))
    per_user = None
    if mask is None:
        mask = tf.ones([size], tf.float32)
    else:
        mask = tf.convert_to_tensor(mask)
        if mask.shape.rank is None:
            raise PrivacyRefusalError(
                "The real-slot mask has an unknown rank (Keras relaxed the traced shapes "
                "after batches of different kinds): a model trains on example batches "
                "(mask [B]) or on user batches (mask [users, examples_per_user], one "
                "examples_per_user), not both.")
        if mask.shape.rank == 2:
            per_user = mask.shape[1]
            if per_user is None:
                raise PrivacyRefusalError(
                    "A user batch's real-slot mask [users, examples_per_user] needs a "
                    "static examples_per_user (keras_dp_lm.data.poisson_user_batches "
                    "gives one).")
        elif mask.shape.rank != 1:
            raise PrivacyRefusalError(
                f"The real-slot mask must be [B] (examples) or [users, "
                f"examples_per_user]; got shape {tuple(mask.shape)}.")
        if per_user is not None and isinstance(size, int) and size % per_user:
            raise PrivacyRefusalError(
                f"A user batch with examples_per_user={per_user} has {size} rows, not "
                "a multiple of it: its rows no longer line up with its users. Under "
                "tf.distribute, pass num_replicas=strategy.num_replicas_in_sync to "
                "keras_dp_lm.data.poisson_user_batches, so that splitting the batch "
                "keeps each user's rows on one replica.")
        # A slot is real or padding: 0/1, whatever values the mask holds (a
        # fractional mask must not shrink the counted batch).
        mask = tf.cast(tf.reshape(mask, [-1]) > 0, tf.float32)
        mask_size = mask.shape[0]
        if isinstance(size, int) and mask_size is not None and mask_size != size:
            raise PrivacyRefusalError(
                f"The batch has {size} slots but its real-slot mask has {mask_size}: "
                "a preprocessing step changed the number of rows. keras_dp_lm "
                "needs row-wise preprocessing (one output row per input row).")
        if not isinstance(size, int) or mask_size is None:
            mask = _one_per_row(mask, size)
    return x, y, sample_weight, mask, rate, per_user


def _batch_rate(rate, ctx):
    """The batch's Poisson rate: the largest attached to any of its rows, on
    any replica (0 when none is attached). Rates travel one per row so that
    ``tf.distribute`` can split a batch; a replica may get no rows."""
    if rate is None:
        return tf.constant(0.0, tf.float64)
    rate = tf.reshape(tf.cast(rate, tf.float64), [-1])
    rate = tf.reduce_max(tf.concat([rate, tf.zeros([1], tf.float64)], 0))
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        rate = tf.reduce_max(ctx.all_gather(tf.reshape(rate, [1]), axis=0))
    return rate


def _one_per_row(mask, rows):
    """``mask`` checked at run time to have one entry per row.

    A smaller mask must never broadcast over the rows (one user's slot would
    then cover all of them). In graph mode a mismatch raises; under XLA, which
    drops assertions, the mask becomes all padding, so the step adds nothing
    but noise. (``tf.reshape(mask, [rows])`` is not enough: grappler removes
    a reshape between two shapes it cannot tell apart.)
    """
    count = tf.size(mask)
    check = tf.debugging.assert_equal(
        count, rows, message="keras_dp_lm: the real-slot mask must have one entry per "
                             "row (example batches) or per examples_per_user rows (user "
                             "batches) of the batch: preprocess row-wise, and under "
                             "tf.distribute pass num_replicas= to poisson_user_batches")
    with tf.control_dependencies([check]):
        index = tf.minimum(tf.range(rows), tf.maximum(count - 1, 0))
        return tf.gather(mask, index) * tf.cast(tf.equal(count, rows), mask.dtype)


def _loss_weights(mask, examples_per_user):
    """Per-row loss weights: the real-slot mask, divided in a user batch by the
    user's number of real rows (each user's gradient is the mean over its
    examples, computed from that user's rows alone)."""
    k = examples_per_user
    if k == 1:
        return mask
    per_user = tf.reshape(mask, [-1, k])
    counts = tf.reduce_sum(per_user, axis=1, keepdims=True)
    return tf.reshape(per_user / tf.maximum(counts, 1.0), [-1])


def _micro_batch_rows(model, mask, examples_per_user=None):
    """The rows of one micro-batch of ``mask``'s batch (the size the model is
    trained at with gradient accumulation): the probe runs at that size."""
    unit = (examples_per_user or 1) * model.optimizer.dp_accumulation_steps
    units = (tf.shape(mask)[0] + unit - 1) // unit
    return units * (examples_per_user or 1)
