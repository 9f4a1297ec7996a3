"""The ghost-norm / book-keeping core: the norms of recorded contributions.

A covered layer's recording forward pass (see :mod:`keras_dp_lm.clipping.rules`)
adds one *contribution* per use of a variable
(:mod:`keras_dp_lm.clipping.contributions`): a linear map ``X^T Y`` of the
layer input and output gradient, a table lookup or a tiny per-example gradient.
From them this module computes each example's squared gradient norm, by the
ghost norm (Gram matrices, never forming the gradient) or by instantiating
the per-example gradient, whichever a FLOP model with memory caps finds
cheaper, and the clipped sum by book-keeping (one matmul with the clip
factors folded into the smaller factor).
"""

import tensorflow as tf

from keras_dp_lm.clipping._common import _in_xla
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping._common import value_or
from keras_dp_lm.clipping.contributions import _DEFAULT_T
from keras_dp_lm.clipping.contributions import Lookup
from keras_dp_lm.clipping.rounding import accumulation_dtype
from keras_dp_lm.clipping.rounding import contract
from keras_dp_lm.clipping.rounding import exact_sums
from keras_dp_lm.clipping.rounding import sum_squares
from keras_dp_lm.clipping.rounding import unit_roundoff

# Caps on the transient memory of one variable's norm computation.  Above the
# cap the other method is used (if that one fits; else the smaller one).
_INSTANTIATE_MAX_BYTES = 256 * 2**20
_GHOST_MAX_BYTES = 256 * 2**20


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
        return (value_or(a.H, 1) * value_or(a.T, _DEFAULT_T) * value_or(b.T, _DEFAULT_T)
                * (value_or(a.m, 1) + value_or(a.n, 1) + 1))
    if a.kind == "lookup" and b.kind == "lookup":
        if a is b and a.distinct:
            return value_or(a.T, _DEFAULT_T) * value_or(a.d, 1)
        if a is b and _sorts_ids():  # grouped by sorting the ids (Lookup.self_norm)
            return 4 * value_or(a.T, _DEFAULT_T) * value_or(a.d, 1)
        return value_or(a.T, _DEFAULT_T) * value_or(b.T, _DEFAULT_T) * (value_or(a.d, 1) + 1)
    lin, lk = (a, b) if a.kind == "linear" else (b, a)
    return value_or(lin.T, _DEFAULT_T) * value_or(lk.T, _DEFAULT_T) * (value_or(lk.d, 1) + 2)


def _pair_mem(a, b):
    """Floats per example of the Gram matrices a ghost pair needs."""
    if a.kind == "linear" and b.kind == "linear":
        return 2 * value_or(a.H, 1) * value_or(a.T, _DEFAULT_T) * value_or(b.T, _DEFAULT_T)
    if a is b and a.kind == "lookup" and a.distinct:
        return 0
    if a is b and a.kind == "lookup" and _sorts_ids():
        return 2 * value_or(a.T, _DEFAULT_T) * value_or(a.d, 1)
    return 2 * value_or(a.T, _DEFAULT_T) * value_or(b.T, _DEFAULT_T)


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
    return [Lookup.merged(lookups)] + [c for c in contribs if c.kind != "lookup"]


def _keepable(size, held, batch):
    """Whether a per-example gradient of ``size`` floats may be kept until the
    clipped sum: no larger than the factors it replaces (``held`` floats per
    example) and within the instantiation memory cap."""
    return size <= held and 4 * value_or(batch, 32) * size <= _INSTANTIATE_MAX_BYTES


def _choose(contribs, batch):
    """``(method, keep)`` for one variable's contributions (static decision).

    ``method`` is "ghost" or "instantiate"; ``keep`` means the instantiated
    per-example gradient is kept and the clipped sum is ``sum_i c_i grad_i``
    (no book-keeping matmul): chosen when it takes no more memory than the
    layer inputs and output gradients book-keeping would hold.
    """
    size = product_of([static_dim(s) for s in contribs[0].var.shape]) or 1
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
    b = value_or(batch, 32)
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
    coherently by a crafted record (one moved a model by 6.9 C through ``fit``). So
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
        depth += max(value_or(getattr(c, "T", 1), 2**16) for c in contribs) + 1
    else:   # no float64: all H T^2 products of a Gram pair add in float32
        depth += max(value_or(getattr(c, "H", 1), 1) * value_or(getattr(c, "T", 1), 2**16) ** 2
                     for c in contribs)
    dtype = accumulation_dtype()
    total, x1, y1 = (tf.add_n([tf.cast(b[i], dtype) for _, b in grounded]) for i in range(3))
    # Flushing to zero (CPUs and GPUs flush float32 subnormals) moves a dot
    # product of length L by at most 2 L 2^-126 whatever the size of its
    # terms: a huge input times a tiny output gradient (e.g. an input
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


def static_linear(H, m, n, T, B):
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
