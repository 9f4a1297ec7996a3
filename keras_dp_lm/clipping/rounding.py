"""Float32 rounding in per-example norms, bounded so that clipping holds.

A clip factor ``min(1, C / norm)`` bounds one example's clipped gradient by
``C`` only if ``norm`` is not below the norm of the vector that is summed. A
float32 reading of a squared norm can be below it: a sum of ``n`` squares is
off by up to ``n`` roundings whatever the summation order, and a ghost norm
(a difference of large numbers) by far more. This module holds the pieces
both engines use to read squared norms and to add a worst-case allowance:

- :func:`sum_squares`: per-example ``sum x^2``, float32 over the last axis
  only, the rest in float64 (the accumulation dtype);
- :func:`squares_allowance` / :func:`squares_error`: what that reading can miss;
- :func:`unit_norms`: the norm bound of one unit's gradients (exact engine);
- :func:`contract`: the products and sums behind ghost norms.

On TPUs, which have no float64, every sum runs in float32 and its full length
counts in the allowance.

Example:
    >>> import tensorflow as tf
    >>> from keras_dp_lm.clipping import rounding
    >>> per = tf.constant([[[3.0, 4.0]], [[0.0, 1.0]]])    # [B=2, 1, 2]
    >>> sq = rounding.sum_squares(per)
    >>> [float(s) for s in sq]
    [25.0, 1.0]
    >>> bound = sq + rounding.squares_allowance(per, sq)
    >>> bool(tf.reduce_all(bound > sq))
    True
"""

import tensorflow as tf

from keras_dp_lm.clipping._common import value_or
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import static_dim

# Roundings of a float32 sum of squares over an axis of unknown length.
_UNKNOWN_LENGTH = 2**16
# Roundings beyond the sums themselves: squaring, casts, the square root,
# the division of the clip factor and its product with the gradient.
_SLACK = 8


def unit_roundoff():
    """The unit roundoff of the float32 matmuls behind ghost norms: 2^-24, or
    2^-11 where TensorFloat-32 may round their inputs (TF's default on
    Ampere and newer GPUs)."""
    if (tf.config.experimental.tensor_float_32_execution_enabled()
            and tf.config.list_logical_devices("GPU")):
        return 2.0 ** -11
    return 2.0 ** -24


def exact_sums():
    """Whether sums of products and squares run in float64 (not on TPUs,
    which have no float64: there their length counts in the allowance)."""
    return not tf.config.list_logical_devices("TPU")


def accumulation_dtype():
    """The dtype squared norms are accumulated in across variables: float64
    where available, so that adding hundreds of variables' terms adds no
    error worth counting (:func:`summed_terms_allowance` counts it on TPUs)."""
    return tf.float64 if exact_sums() else tf.float32


def contract(a, b):
    """``sum_{...} a * b`` per example (all axes but the first), in
    :func:`accumulation_dtype`: the products and their sum over the last axis
    in float32 (off by at most that axis's length plus one in roundings of
    ``sum |a b|``, which ``ghost._rounding_allowance`` counts), the rest in
    float64, without a float64 copy of the ``[B, H, T, T]`` operands."""
    prod = a * b
    if exact_sums():
        last = tf.cast(tf.reduce_sum(prod, axis=-1), tf.float64)
        axes = list(range(1, last.shape.rank))
        return tf.reduce_sum(last, axis=axes) if axes else last
    return tf.reduce_sum(prod, axis=list(range(1, prod.shape.rank)))


def sum_squares(per):
    """``sum per^2`` per example (``per`` is ``[B, ...]``), in
    :func:`accumulation_dtype`: over the last axis in float32 (at most its
    length in roundings, see :func:`squares_allowance`), the rest in float64."""
    per = tf.cast(per, tf.float32)
    if per.shape.rank == 1:                 # one value per example: exact
        return tf.cast(tf.square(per), accumulation_dtype())
    last = tf.cast(tf.reduce_sum(tf.square(per), axis=-1), accumulation_dtype())
    axes = list(range(1, last.shape.rank))
    return tf.reduce_sum(last, axis=axes) if axes else last


def squares_allowance(per, sq_norm):
    """``[B]``: what :func:`sum_squares` of ``per`` may miss of the exact sum.

    A float32 sum of ``n`` non-negative terms is off by at most ``n u`` of the
    sum (``u`` the unit roundoff) in any order; ``n`` is the last axis's
    length where the rest sums in float64, else every non-batch axis's.
    """
    dims = [static_dim(s) for s in per.shape[1:]]
    size = product_of([value_or(d, _UNKNOWN_LENGTH) for d in dims]) if dims else 1
    if not dims:
        length = 0
    elif exact_sums():
        length = value_or(dims[-1], _UNKNOWN_LENGTH)
    else:
        length = size
    return squares_error(sq_norm, length, size)


def squares_error(sq, length, count):
    """What a float32 reading ``sq`` of a sum of ``count`` squares may miss,
    ``length`` of them added in float32 in one run: ``(length + 8) u`` of it
    for rounding (any order), and ``2^-126`` per square flushed to zero
    (partial sums of non-negative terms are never subnormal, so only the
    squares flush)."""
    sq = tf.abs(sq)
    length, count = value_or(length, _UNKNOWN_LENGTH), value_or(count, _UNKNOWN_LENGTH)
    return (tf.cast(unit_roundoff() * (length + _SLACK), sq.dtype) * sq
            + tf.cast(count * 2.0 ** -126, sq.dtype))


def summed_terms_allowance(count, sq_norm):
    """``[B]``: the error of adding ``count`` non-negative per-variable terms
    in :func:`accumulation_dtype` (nothing worth counting in float64)."""
    if exact_sums():
        return tf.zeros_like(sq_norm)
    return tf.cast(2.0 ** -24 * count, sq_norm.dtype) * tf.abs(sq_norm)


def unit_norms(grads):
    """An upper bound of the norm of one unit's (example's or user's)
    gradients, as the exact engine clips them: each variable's sum of squares
    plus its allowance, accumulated in :func:`accumulation_dtype`.

    Example:
        >>> import tensorflow as tf
        >>> from keras_dp_lm.clipping.rounding import unit_norms
        >>> norm = unit_norms([tf.constant([3.0]), tf.constant([[4.0]])])
        >>> 5.0 <= float(norm) < 5.0 + 1e-5
        True
    """
    total = None
    for g in grads:
        per = tf.cast(g, tf.float32)[None]
        sq = sum_squares(per)
        sq = sq + squares_allowance(per, sq)
        total = sq if total is None else total + sq
    total = total + summed_terms_allowance(len(grads), total)
    return tf.cast(tf.sqrt(total[0]), tf.float32)
