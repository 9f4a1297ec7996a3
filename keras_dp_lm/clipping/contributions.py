"""Contributions: what a covered layer's recording forward pass records.

A fast-clipping rule (:mod:`keras_dp_lm.clipping.rules`) adds one
contribution per use of a variable: a linear map ``X^T Y`` of the layer input
and output gradient (:class:`Linear`), a table lookup (:class:`Lookup`) or a
tiny per-example gradient (:class:`PerExample`). Each gives every example's
squared gradient norm and, once the clip factors are known, the clipped sum.
This module is the internal interface between the rules and the engine
(:mod:`keras_dp_lm.clipping.ghost`, :mod:`keras_dp_lm.clipping.fast`).
"""

import tensorflow as tf

from keras_dp_lm.clipping._common import _weighted_sum
from keras_dp_lm.clipping._common import batch_and_length
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping._common import value_or
from keras_dp_lm.clipping.interface import scale_examples
from keras_dp_lm.clipping.interface import sum_user_rows
from keras_dp_lm.clipping.rounding import squares_error
from keras_dp_lm.clipping.rounding import sum_squares

# Sequence length assumed for cost decisions when it is not static.
_DEFAULT_T = 512


def _dims(t):
    """``t``'s shape as a list: static ints where known, else scalar tensors."""
    dynamic = tf.shape(t)
    return [d if d is not None else dynamic[i] for i, d in enumerate(t.shape.as_list())]


def _users(rows, k):
    return rows // k if isinstance(rows, int) else None


class _Call:
    """One call of a covered layer: its watched output ``z`` (and later ``g``)."""

    def __init__(self, layer, z):
        self.layer, self.z, self.g = layer, z, None


def _zero_dropped(t, c):
    """``t`` with the rows of examples whose clip factor is 0 set to exactly 0."""
    keep = tf.reshape(tf.cast(c, tf.float32) > 0, [-1] + [1] * (t.shape.rank - 1))
    # A broadcast scalar, not zeros_like(t): grappler would fold a full-size
    # zeros tensor into a constant kept in memory between steps.
    return tf.where(keep, t, tf.zeros([], t.dtype))


def _scale(t, c, safe):
    """``c[i] * t[i]`` (float32).

    With ``safe``, rows with ``c[i] == 0`` are exactly 0 even when ``t[i]`` is
    not finite (:func:`scale_examples`). Without, one multiply: only for
    factors known to be finite (every per-example norm was finite, and a
    non-finite entry of an example's factor makes its norm non-finite).
    """
    if safe:
        return scale_examples(t, c)
    t = tf.cast(t, tf.float32)
    return t * tf.reshape(tf.cast(c, tf.float32), [-1] + [1] * (t.shape.rank - 1))


def _row_bound(sq, length):
    """``|t|`` bounded above from ``sq``, its float32 reading of ``|t|^2``
    (a sum of ``length`` squares, :func:`rounding.squares_error`); ``inf``
    when it overflowed (the example is then dropped)."""
    return tf.sqrt(sq + squares_error(sq, length, length))


class Linear:
    """Per-example gradient ``to_var(sum_{h,t} X[i,h,t,:]^T Y[i,h,t,:])``.

    ``factors(g) -> (X [B,H,T,m], Y [B,H,T,n])``.  ``rows=True`` means the
    variable is ``[m, n]`` with ``X`` indexing its rows (the tied reverse
    projection: X = dlogits over the vocabulary, Y = hidden states), which a
    lookup contribution on the same variable can form a cross term with.
    ``keys`` identify X and Y for sharing Gram matrices between contributions
    whose factors are the same tensor (query/key/value projections of one x).
    """

    kind = "linear"

    def __init__(self, var, call, factors, to_var, hmtn, layout, keys,
                 rows=False):
        self.var, self.call, self._factors, self.to_var = var, call, factors, to_var
        self.H, self.m, self.T, self.n = hmtn
        self.layout, self.keys, self.rows = layout, keys, rows

    def prepare(self):
        # float32 whatever the compute dtype: the norm is that of exactly the
        # vector summed, to float32 rounding (mixed_bfloat16 included).
        self.X, self.Y = (tf.cast(t, tf.float32) for t in self._factors(self.call.g))

    def regroup(self, k):
        """Rows of one user (``k`` consecutive examples) become one example:
        ``[B, H, T, m] -> [B/k, H, k*T, m]``, so the norm is that of the
        user's summed gradient and the clipped sum is unchanged in form."""
        def group(t):
            B, H, T, m = _dims(t)
            static = t.shape.as_list()
            t = tf.reshape(t, [-1, k, H, T, m])
            if static[1] != 1:
                t = tf.transpose(t, [0, 2, 1, 3, 4])
            out = tf.reshape(t, [-1, H, k * T, m])
            out.set_shape([_users(static[0], k), static[1],
                           None if static[2] is None else k * static[2], static[3]])
            return out
        self.X, self.Y = group(self.X), group(self.Y)
        self.T = None if self.T is None else k * self.T

    def bounds(self, grams):
        """``(M, sum_t |X_t|, sum_t |Y_t|)`` per example, with ``M = sum_{h,t}
        |X_t| |Y_t|`` a bound on the norm of its per-example gradient; the
        scales of the float32 rounding and flushing in its norm
        (:func:`_rounding_allowance`). Row norms are bounded above from their
        float32 squares (:func:`_row_bound`)."""
        x = _row_bound(grams.row_norms(self.X), self.m)
        y = _row_bound(grams.row_norms(self.Y), self.n)
        return (tf.reduce_sum(x * y, axis=[1, 2]), tf.reduce_sum(x, axis=[1, 2]),
                tf.reduce_sum(y, axis=[1, 2]))

    def flush_lengths(self):
        """``(m, n)``: the lengths of the dot products of its two Grams."""
        return value_or(self.m, 2**16), value_or(self.n, 2**16)

    def positions(self):
        return value_or(self.H, 1) * value_or(self.T, 2**16)

    def depth(self):
        """``m + n + 2 T``: the lengths of the float32 sums behind its norm."""
        return value_or(self.m, 2**16) + value_or(self.n, 2**16) + 2 * value_or(self.T, 2**16)

    def inst_cost(self):
        return value_or(self.H, 1) * value_or(self.T, _DEFAULT_T) * value_or(self.m, 1) * value_or(self.n, 1)

    def held(self):
        """Floats per example held for the book-keeping sum: the two factors."""
        return value_or(self.H, 1) * value_or(self.T, _DEFAULT_T) * (value_or(self.m, 1) + value_or(self.n, 1))

    def sum_cost(self):
        return self.inst_cost()

    def instantiate(self):
        return self.to_var(tf.matmul(self.X, self.Y, transpose_a=True), True)

    def clipped(self, c, safe=True):
        # The smaller factor carries the clip factor. With ``safe`` both
        # factors' rows of a dropped example are zeroed (not multiplied:
        # 0 * nan is nan); without, all factors are finite and a zero factor
        # zeroes the example's rows exactly.
        if value_or(self.n, 0) <= value_or(self.m, 0):
            X = _zero_dropped(self.X, c) if safe else self.X
            Y = _scale(self.Y, c, safe)
        else:
            X = _scale(self.X, c, safe)
            Y = _zero_dropped(self.Y, c) if safe else self.Y
        if self.H == 1 and self.m is not None and self.n is not None:
            mat = tf.matmul(tf.reshape(X, [-1, self.m]), tf.reshape(Y, [-1, self.n]),
                            transpose_a=True)[None]
        else:
            mat = tf.einsum("bhtm,bhtn->hmn", X, Y)
        return self.to_var(mat, False)


class Lookup:
    """Per-example gradient ``sum_t onehot(ids[i,t]) g[i,t,:]^T`` of a ``[V, d]`` table."""

    kind = "lookup"

    def __init__(self, var, call, ids, distinct=False):
        self.var, self.call, self.distinct = var, call, distinct
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, tf.int32)
        self.ids_raw = ids
        self.V, self.d = (static_dim(s) for s in var.shape)
        self.T = product_of([static_dim(s) for s in ids.shape[1:]])

    def prepare(self):
        g = tf.cast(tf.convert_to_tensor(self.call.g), tf.float32)
        B, L = batch_and_length(g, self.T)
        self.G = tf.reshape(g, [B, L, self.d])
        self.ids = tf.reshape(tf.cast(self.ids_raw, tf.int32), [B, L])
        self.ids.set_shape(self.G.shape[:2])

    def regroup(self, k):
        """``[B, T] -> [B/k, k*T]``: one user's lookups as one example's. Ids
        that are distinct within an example (positions) repeat across a
        user's examples, so ``distinct`` no longer holds."""
        B, T, d = _dims(self.G)
        users, length = _users(self.G.shape[0], k), None if self.T is None else k * self.T
        self.G = tf.reshape(self.G, [-1, k * T, d])
        self.ids = tf.reshape(self.ids, [-1, k * T])
        self.G.set_shape([users, length, self.d])
        self.ids.set_shape([users, length])
        self.T, self.distinct = length, False

    @classmethod
    def merged(cls, lookups):
        """One lookup of all ``lookups`` (prepared, same table): ids and output
        gradients concatenated along the sequence, so the table's per-example
        gradient is the same sum and its norm one computation."""
        if len(lookups) == 1:
            return lookups[0]
        out = cls.__new__(cls)
        first = lookups[0]
        out.var, out.call, out.distinct = first.var, None, False
        out.V, out.d = first.V, first.d
        lengths = [c.T for c in lookups]
        out.T = None if None in lengths else sum(lengths)
        out.G = tf.concat([c.G for c in lookups], axis=1)
        out.ids = tf.concat([c.ids for c in lookups], axis=1)
        return out

    def self_norm(self):
        """``||sum_t onehot(id_t) g_t^T||^2`` per example, ``[B]``, in O(T d).

        Equal ids are grouped by sorting each example's ids; the squared norm
        is the sum over groups of ``||sum of the group's g_t||^2``, so neither
        the ``[V, d]`` gradient nor a ``T x T`` Gram matrix is formed.
        """
        if self.distinct:
            return sum_squares(self.G)
        ids = self.ids
        shape = tf.shape(ids)
        B = value_or(static_dim(ids.shape[0]), shape[0])
        T = value_or(static_dim(ids.shape[1]), shape[1])
        order = tf.argsort(ids, axis=1, stable=True)
        ranked = tf.gather(ids, order, batch_dims=1)
        first = tf.concat([tf.ones_like(ranked[:, :1], tf.bool),
                           tf.not_equal(ranked[:, 1:], ranked[:, :-1])], axis=1)
        group = tf.cumsum(tf.cast(first, tf.int32), axis=1) - 1   # in sorted order
        # Group of each token in its original position (inverse permutation).
        group = tf.gather(group, tf.argsort(order, axis=1), batch_dims=1)
        group = group + tf.range(B, dtype=tf.int32)[:, None] * T
        sums = tf.math.unsorted_segment_sum(tf.reshape(self.G, [-1, self.d]),
                                            tf.reshape(group, [-1]), B * T)
        return sum_squares(tf.reshape(sums, [B, -1, self.d]))

    def bounds(self, grams):
        """``(sum_t |g_t|, T, sum_t |g_t|)``: its gradient's norm is at most
        ``sum_t |g_t|``; one-hot rows have norm 1 (exact)."""
        g = tf.reduce_sum(_row_bound(grams.row_norms(self.G), self.d), axis=1)
        return g, tf.fill(tf.shape(g), float(value_or(self.T, 2**16))), g

    def flush_lengths(self):
        return 1, value_or(self.d, 2**16)

    def positions(self):
        return value_or(self.T, 2**16)

    def depth(self):
        return value_or(self.d, 2**16) + 2 * value_or(self.T, 2**16)

    def inst_cost(self):
        return value_or(self.T, _DEFAULT_T) * value_or(self.d, 1)

    def held(self):
        return value_or(self.T, _DEFAULT_T) * (value_or(self.d, 1) + 1)

    def sum_cost(self):
        return value_or(self.T, _DEFAULT_T) * value_or(self.d, 1)

    def instantiate(self):
        B = tf.shape(self.G)[0]
        offs = self.ids + tf.range(B)[:, None] * self.V
        flat = tf.math.unsorted_segment_sum(tf.reshape(self.G, [-1, self.d]),
                                            tf.reshape(offs, [-1]), B * self.V)
        return tf.reshape(flat, [-1, self.V, self.d])

    def clipped(self, c, safe=True):
        G = _scale(self.G, c, safe)
        return tf.math.unsorted_segment_sum(tf.reshape(G, [-1, self.d]),
                                            tf.reshape(self.ids, [-1]), self.V)


class PerExample:
    """A per-example gradient that is cheap to instantiate: ``fn(g) -> [B, *shape]``."""

    kind = "dense"

    def __init__(self, var, call, fn):
        self.var, self.call, self._fn = var, call, fn

    def prepare(self):
        self.P = tf.cast(self._fn(tf.convert_to_tensor(self.call.g)), tf.float32)

    def regroup(self, k):
        """``[B, ...] -> [B/k, ...]``: the sum of each user's ``k`` rows."""
        self.P = sum_user_rows(self.P, k)

    def bounds(self, grams):
        """None: its norm is that of exactly the vector summed (no Gram)."""
        return None

    def depth(self):
        return 0

    def inst_cost(self):
        return product_of([static_dim(s) for s in self.var.shape]) or 1

    def held(self):
        return self.inst_cost()

    def sum_cost(self):
        return self.inst_cost()

    def instantiate(self):
        return self.P

    def clipped(self, c, safe=True):
        if safe:
            return tf.reduce_sum(scale_examples(self.P, c), axis=0)
        return _weighted_sum(c, self.P)
