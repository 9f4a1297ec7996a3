"""The ghost-norm / book-keeping core: recorded contributions and their norms.

A covered layer's recording forward pass (see :mod:`keras_dp_lm.clipping.rules`)
adds one *contribution* per use of a variable: a linear map ``X^T Y`` of the
layer input and output gradient (:class:`_Linear`), a table lookup
(:class:`_Lookup`) or a tiny per-example gradient (:class:`_PerExample`).
From them this module computes each example's squared gradient norm, by the
ghost norm (Gram matrices, never forming the gradient) or by instantiating
the per-example gradient, whichever a FLOP model with memory caps finds
cheaper, and the clipped sum by book-keeping (one matmul with the clip
factors folded into the smaller factor).
"""

import tensorflow as tf

from keras_dp_lm.clipping._common import _in_xla
from keras_dp_lm.clipping._common import _or
from keras_dp_lm.clipping._common import _prod
from keras_dp_lm.clipping._common import _static
from keras_dp_lm.clipping._common import _weighted_sum
from keras_dp_lm.clipping.interface import scale_examples
from keras_dp_lm.clipping.interface import sum_user_rows
from keras_dp_lm.clipping.rounding import accumulation_dtype
from keras_dp_lm.clipping.rounding import contract
from keras_dp_lm.clipping.rounding import exact_sums
from keras_dp_lm.clipping.rounding import squares_error
from keras_dp_lm.clipping.rounding import sum_squares
from keras_dp_lm.clipping.rounding import unit_roundoff

# Caps on the transient memory of one variable's norm computation.  Above the
# cap the other method is used (if that one fits; else the smaller one).
_INSTANTIATE_MAX_BYTES = 256 * 2**20
_GHOST_MAX_BYTES = 256 * 2**20
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


class _Linear:
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
        return _or(self.m, 2**16), _or(self.n, 2**16)

    def positions(self):
        return _or(self.H, 1) * _or(self.T, 2**16)

    def depth(self):
        """``m + n + 2 T``: the lengths of the float32 sums behind its norm."""
        return _or(self.m, 2**16) + _or(self.n, 2**16) + 2 * _or(self.T, 2**16)

    def inst_cost(self):
        return _or(self.H, 1) * _or(self.T, _DEFAULT_T) * _or(self.m, 1) * _or(self.n, 1)

    def held(self):
        """Floats per example held for the book-keeping sum: the two factors."""
        return _or(self.H, 1) * _or(self.T, _DEFAULT_T) * (_or(self.m, 1) + _or(self.n, 1))

    def sum_cost(self):
        return self.inst_cost()

    def instantiate(self):
        return self.to_var(tf.matmul(self.X, self.Y, transpose_a=True), True)

    def clipped(self, c, safe=True):
        # The smaller factor carries the clip factor. With ``safe`` both
        # factors' rows of a dropped example are zeroed (not multiplied:
        # 0 * nan is nan); without, all factors are finite and a zero factor
        # zeroes the example's rows exactly.
        if _or(self.n, 0) <= _or(self.m, 0):
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


class _Lookup:
    """Per-example gradient ``sum_t onehot(ids[i,t]) g[i,t,:]^T`` of a ``[V, d]`` table."""

    kind = "lookup"

    def __init__(self, var, call, ids, distinct=False):
        self.var, self.call, self.distinct = var, call, distinct
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, tf.int32)
        self.ids_raw = ids
        self.V, self.d = (_static(s) for s in var.shape)
        self.T = _prod([_static(s) for s in ids.shape[1:]])

    def prepare(self):
        g = tf.cast(tf.convert_to_tensor(self.call.g), tf.float32)
        self.G = tf.reshape(g, [-1, _or(self.T, -1), self.d])
        self.ids = tf.reshape(tf.cast(self.ids_raw, tf.int32), [-1, _or(self.T, -1)])
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
        B = _or(_static(ids.shape[0]), shape[0])
        T = _or(_static(ids.shape[1]), shape[1])
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
        return g, tf.fill(tf.shape(g), float(_or(self.T, 2**16))), g

    def flush_lengths(self):
        return 1, _or(self.d, 2**16)

    def positions(self):
        return _or(self.T, 2**16)

    def depth(self):
        return _or(self.d, 2**16) + 2 * _or(self.T, 2**16)

    def inst_cost(self):
        return _or(self.T, _DEFAULT_T) * _or(self.d, 1)

    def held(self):
        return _or(self.T, _DEFAULT_T) * (_or(self.d, 1) + 1)

    def sum_cost(self):
        return _or(self.T, _DEFAULT_T) * _or(self.d, 1)

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


class _PerExample:
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
        return _prod([_static(s) for s in self.var.shape]) or 1

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


class _Grams:
    """Cache of per-example Gram matrices keyed by factor identity.

    A key names everything that determines the factor (the source tensor, the
    einsum that permutes it and the ``[B, H, T, m]`` reshape), so two layers
    share a Gram only when their factors are the same tensor (e.g. the query,
    key and value projections of one input); ``None`` is never cached.
    """

    def __init__(self):
        self._cache = {}
        self._own = {}   # id(t) -> (t, t t^T): the self-Gram of one tensor object

    def get(self, key_a, a, key_b, b):
        gram = self._get(key_a, a, key_b, b)
        if a is b:
            self._own[id(a)] = (a, gram)
        return gram

    def _get(self, key_a, a, key_b, b):
        if key_a is not None and key_b is not None:
            key = (key_a, key_b) if str(key_a) <= str(key_b) else (key_b, key_a)
            swap = key != (key_a, key_b)
            if key in self._cache:
                gram = self._cache[key]
                return tf.linalg.matrix_transpose(gram) if swap else gram
        gram = tf.matmul(a, b, transpose_b=True)
        if key_a is not None and key_b is not None:
            self._cache[key] = tf.linalg.matrix_transpose(gram) if swap else gram
        return gram

    def row_norms(self, t):
        """``|t[..., i, :]|^2``: the diagonal of ``t``'s Gram matrix if one was
        formed, else one contraction (no temporary of ``t``'s size)."""
        own = self._own.get(id(t))
        if own is not None and own[0] is t:
            return tf.linalg.diag_part(own[1])
        return tf.einsum("...i,...i->...", t, t)


def _sorts_ids():
    """Whether a lookup's own norm groups equal ids by sorting (O(T d)).

    Not under XLA: there the sort and segment sum took ~7 s per step for
    GPT-2's tied embedding (batch 32, T=128) on CPU, against milliseconds for
    the ``T x T`` Gram matrix of the output gradients, which is used instead.
    """
    return not _in_xla()


def _ghostable(a, b):
    if a.kind == "linear" and b.kind == "linear":
        return a.layout == b.layout
    if a.kind == "lookup" and b.kind == "lookup":
        return True
    if {a.kind, b.kind} == {"lookup", "linear"}:
        lin = a if a.kind == "linear" else b
        return lin.rows and lin.H == 1
    return False


def _pair_cost(a, b):
    if a.kind == "linear" and b.kind == "linear":
        return (_or(a.H, 1) * _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T)
                * (_or(a.m, 1) + _or(a.n, 1) + 1))
    if a.kind == "lookup" and b.kind == "lookup":
        if a is b and a.distinct:
            return _or(a.T, _DEFAULT_T) * _or(a.d, 1)
        if a is b and _sorts_ids():  # grouped by sorting the ids (_Lookup.self_norm)
            return 4 * _or(a.T, _DEFAULT_T) * _or(a.d, 1)
        return _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T) * (_or(a.d, 1) + 1)
    lin, lk = (a, b) if a.kind == "linear" else (b, a)
    return _or(lin.T, _DEFAULT_T) * _or(lk.T, _DEFAULT_T) * (_or(lk.d, 1) + 2)


def _pair_mem(a, b):
    """Floats per example of the Gram matrices a ghost pair needs."""
    if a.kind == "linear" and b.kind == "linear":
        return 2 * _or(a.H, 1) * _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T)
    if a is b and a.kind == "lookup" and a.distinct:
        return 0
    if a is b and a.kind == "lookup" and _sorts_ids():
        return 2 * _or(a.T, _DEFAULT_T) * _or(a.d, 1)
    return 2 * _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T)


def _inner(a, b, grams):
    """Per-example inner product <grad_a_i, grad_b_i>, shape [B]."""
    if a.kind == "linear" and b.kind == "linear":
        xx = grams.get(a.keys[0], a.X, b.keys[0], b.X)
        yy = grams.get(a.keys[1], a.Y, b.keys[1], b.Y)
        return contract(xx, yy)
    if a.kind == "lookup" and b.kind == "lookup":
        if a is b and (a.distinct or _sorts_ids()):
            return a.self_norm()
        same = tf.cast(tf.equal(a.ids[:, :, None], b.ids[:, None, :]), a.G.dtype)
        return contract(same, tf.matmul(a.G, b.G, transpose_b=True))
    lin, lk = (a, b) if a.kind == "linear" else (b, a)
    # <sum_t e_{id_t} g_t^T, sum_s x_s h_s^T> = sum_{t,s} x_s[id_t] (g_t . h_s)
    x = lin.X[:, 0]                                            # [B, S, V]
    h = lin.Y[:, 0]                                            # [B, S, d]
    picked = tf.gather(x, lk.ids, axis=2, batch_dims=1)        # [B, S, T]
    return contract(picked, tf.matmul(h, lk.G, transpose_b=True))


def _merge_lookups(contribs):
    """A variable's prepared contributions with its lookups merged into one."""
    lookups = [c for c in contribs if c.kind == "lookup"]
    if len(lookups) < 2:
        return list(contribs)
    return [_Lookup.merged(lookups)] + [c for c in contribs if c.kind != "lookup"]


def _keepable(size, held, batch):
    """Whether a per-example gradient of ``size`` floats may be kept until the
    clipped sum: no larger than the factors it replaces (``held`` floats per
    example) and within the instantiation memory cap."""
    return size <= held and 4 * _or(batch, 32) * size <= _INSTANTIATE_MAX_BYTES


def _choose(contribs, batch):
    """``(method, keep)`` for one variable's contributions (static decision).

    ``method`` is "ghost" or "instantiate"; ``keep`` means the instantiated
    per-example gradient is kept and the clipped sum is ``sum_i c_i grad_i``
    (no book-keeping matmul): chosen when it takes no more memory than the
    layer inputs and output gradients book-keeping would hold.
    """
    size = _prod([_static(s) for s in contribs[0].var.shape]) or 1
    keep = _keepable(size, sum(c.held() for c in contribs), batch)
    if any(c.kind == "dense" for c in contribs):
        return "instantiate", keep
    pairs = [(a, b) for i, a in enumerate(contribs) for b in contribs[i:]]
    if not all(_ghostable(a, b) for a, b in pairs):
        return "instantiate", keep
    summing = sum(c.sum_cost() for c in contribs)   # the book-keeping matmuls
    ghost = sum(_pair_cost(a, b) for a, b in pairs) + summing
    inst = sum(c.inst_cost() for c in contribs) + (len(contribs) + 1) * size
    inst += 2 * size if keep else summing
    b = _or(batch, 32)
    ghost_mem = 4 * b * max(_pair_mem(a, b_) for a, b_ in pairs)
    inst_mem = 4 * b * size
    ghost_ok, inst_ok = ghost_mem <= _GHOST_MAX_BYTES, inst_mem <= _INSTANTIATE_MAX_BYTES
    if ghost_ok and inst_ok:
        choice = "ghost" if ghost <= inst else "instantiate"
    elif ghost_ok or inst_ok:
        choice = "ghost" if ghost_ok else "instantiate"
    else:
        choice = "ghost" if ghost_mem <= inst_mem else "instantiate"
    return choice, keep and choice == "instantiate"


def _sq_norm(contribs, choice, grams):
    """``(squared norms [B], per-example gradient [B, *var.shape] or None)``."""
    if choice == "ghost":
        total = None
        for i, a in enumerate(contribs):
            for j in range(i, len(contribs)):
                term = _inner(a, contribs[j], grams)
                term = term if i == j else 2.0 * term
                total = term if total is None else total + term
        return tf.cast(total, accumulation_dtype()), None
    per = contribs[0].instantiate()
    for c in contribs[1:]:
        per = per + c.instantiate()
    per = tf.cast(per, tf.float32)
    return sum_squares(per), per


def _rounding_allowance(contribs, grams, sq_norm):
    """``[B]`` added to a variable's squared norm so that it bounds the norm
    of the per-example gradient book-keeping sums, not only its float32
    reading; ``None`` when that reading is of exactly the vector summed.

    A ghost norm ``sum_{t,s} (x_t.x_s)(y_t.y_s)`` is a difference of large
    numbers where the gradient cancels across positions; float32 then reads
    it low, or negative, and rounding errors can be made to add up
    coherently by a crafted record (review r31: 6.9 C through ``fit``). So
    the allowance is a worst-case bound, not a model of typical errors: a
    float32 dot product of length ``L`` is off by at most ``L u |x_t| |x_s|``
    whatever the summation order, the sums of Gram products over positions
    are off by at most ``(T + 1) u M^2`` (:func:`rounding.contract`), and with
    ``M_c = sum_t |x_t| |y_t|``
    of each contribution ``c`` (which bounds its gradient's norm) the squared
    norm is off by at most ``u (m + n) (sum_c M_c)^2``; an instantiated
    gradient (a sum over ``T`` positions, off by at most ``T u M`` in norm)
    by ``2 T u M (sum_c M_c)``. The allowance is
    ``1.05 u (m + n + 3 T + 9) (sum_c M_c)^2 + 8 u norm^2``: about
    ``u (m + n + 3T) T`` of an ordinary squared norm (``M^2`` is about ``T``
    times it), e.g. 1e-3 at m + n = 1280, T = 128; larger where the
    reading cancels, never below the error. Flushed subnormals add
    ``2^-124 (m (sum_t |Y_t|)^2 + n (sum_t |X_t|)^2) + 2^-120 (H T)^2``
    (see the comment below): negligible unless row norms approach 2^60.
    """
    grounded = [(c, c.bounds(grams)) for c in contribs]
    grounded = [(c, b) for c, b in grounded if b is not None]
    if not grounded:
        return None
    u = unit_roundoff()
    depth = max(c.depth() for c in contribs) + 8
    if exact_sums():   # a Gram pair's products add in float32 over one axis
        depth += max(_or(getattr(c, "T", 1), 2**16) for c in contribs) + 1
    else:   # no float64: all H T^2 products of a Gram pair add in float32
        depth += max(_or(getattr(c, "H", 1), 1) * _or(getattr(c, "T", 1), 2**16) ** 2
                     for c in contribs)
    dtype = accumulation_dtype()
    total, x1, y1 = (tf.add_n([tf.cast(b[i], dtype) for _, b in grounded]) for i in range(3))
    # Flushing to zero (CPUs and GPUs flush float32 subnormals) moves a dot
    # product of length L by at most 2 L 2^-126 whatever the size of its
    # terms: a huge input times a tiny output gradient (review r32: an input
    # in the kernel's null space, then a LayerNorm) is a large gradient whose
    # Gram entries flush to exactly 0. Over all pairs of contributions that
    # costs at most 2^-125 (m (sum |Y_t|)^2 + n (sum |X_t|)^2), and the
    # contraction's flushed products 2 (positions)^2 2^-126.
    m = max(c.flush_lengths()[0] for c, _ in grounded)
    n = max(c.flush_lengths()[1] for c, _ in grounded)
    positions = float(sum(c.positions() for c, _ in grounded))
    flushed = ((2.0 ** -124) * (m * tf.square(y1) + n * tf.square(x1))
               + (2.0 ** -120) * positions ** 2)
    sq_norm = tf.cast(sq_norm, dtype)
    return (1.05 * u * depth) * tf.square(total) + flushed + (8.0 * u) * tf.abs(sq_norm)


def _row_bound(sq, length):
    """``|t|`` bounded above from ``sq``, its float32 reading of ``|t|^2``
    (a sum of ``length`` squares, :func:`rounding.squares_error`); ``inf``
    when it overflowed (the example is then dropped)."""
    return tf.sqrt(sq + squares_error(sq, length, length))


def _static_linear(H, m, n, T, B):
    keep = _keepable(H * m * n, H * T * (m + n), B)
    ghost = H * T * T * (m + n + 1) + H * T * m * n
    inst = H * T * m * n + 2 * H * m * n + (2 * H * m * n if keep else H * T * m * n)
    ghost_ok = 4 * B * 2 * H * T * T <= _GHOST_MAX_BYTES
    inst_ok = 4 * B * H * m * n <= _INSTANTIATE_MAX_BYTES
    if ghost_ok and inst_ok:
        return "ghost" if ghost <= inst else "instantiate"
    if ghost_ok or inst_ok:
        return "ghost" if ghost_ok else "instantiate"
    return "ghost" if T * T <= m * n else "instantiate"
