"""Fast per-example gradient clipping for Keras 3 / KerasHub models.

Ghost clipping (Li et al., 2022, "Large language models can be strong
differentially private learners") and book-keeping (Bu et al., 2023,
"Differentially private optimization on large model at small cost").

How it works
------------
One batched forward pass runs ``loss_fn(data)`` while every *covered* layer's
``call`` is temporarily replaced by a recording version that computes the same
output, records the layer input ``a`` and the pre-activation output ``z`` and
lets the gradient tape watch ``z``.  One backward pass,
``tape.gradient(sum(losses), [z...])``, gives every output gradient ``g``; it
never forms a weight gradient.  From ``a`` and ``g``:

* per-example gradient norms, per variable, by whichever is cheaper
  (a FLOP model with memory caps, decided at trace time from static shapes):

  - ghost norm: ``||a_i^T g_i||^2 = sum_{t,s} (a_t.a_s)(g_t.g_s)``
    (cost ~ T^2 (m + n) per example), or
  - instantiating the per-example gradient ``a_i^T g_i`` (cost ~ T m n) just
    long enough to take its norm;

  embedding lookups use ``sum_{t,s} [id_t == id_s] (g_t.g_s)``; a tied
  ``ReversibleEmbedding`` (lookup + ``reverse=True`` projection on one
  variable) adds the cross term ``2 sum_{t,s} dlogits_s[id_t] (g_t.h_s)``, so
  the norm is that of the *summed* per-example gradient;  LayerNorm / RMS norm
  scales and all biases instantiate their (tiny) per-example gradients;

* the clipped sum by book-keeping: ``sum_i c_i a_i^T g_i`` as one matmul over
  all ``B*T`` rows with ``c_i = min(1, C / ||grad_i||)`` folded into the
  smaller factor.  That matmul is the weight-gradient matmul a normal
  backward pass does anyway, so no second backward pass is needed.  (A second
  backward pass of ``sum_i c_i loss_i`` would recompute every activation
  gradient as well: about twice the work of book-keeping on CPU.)

Variables with no rule ("uncovered": e.g. a ``Conv1D`` kernel, LoRA or
quantized layers, layers whose ``call`` is overridden) get exact per-example
gradients from a ``tf.map_fn`` over one-example slices of ``data`` (exact but
slow) with ``method="auto"``; ``method="fast"`` raises
:class:`UncoveredLayersError` instead.  A covered variable that is also read
outside its layer's ``call`` is detected at trace time (a second tape watches
variable reads outside covered calls) and treated as uncovered.

Nothing here uses ``tf.vectorized_map`` / pfor, so it runs with oneDNN on
(see DESIGN.md), in eager mode, inside ``tf.function`` and with
``jit_compile=True``.

Notes:

* The model must be built (its variables must exist) before the call.
* A weight regularizer reads its variable outside the layer's ``call``, so
  that variable is treated as uncovered (exact in "auto", refused in "fast").
* With dropout and uncovered variables, the exact fallback's one-example
  forward passes draw their own dropout masks; the clipping bound still holds
  because the norm is that of exactly the vector that is clipped and summed.
* Thread-safe for ``tf.distribute`` replica threads: the wrappers are
  installed once and look up the recording of the calling thread.
"""

import collections
import contextlib
import functools
import string
import threading
import weakref

import keras
import tensorflow as tf
from keras import ops

__all__ = [
    "ClippedSum",
    "UncoveredLayersError",
    "clipping_coverage",
    "coverage_report",
    "fast_clipped_sum",
]

from keras_dp_lm.clipping import ClippedSum  # noqa: E402  (one result type)

# Caps on the transient memory of one variable's norm computation.  Above the
# cap the other method is used (if that one fits; else the smaller one).
_INSTANTIATE_MAX_BYTES = 256 * 2**20
_GHOST_MAX_BYTES = 256 * 2**20
# Sequence length assumed for cost decisions when it is not static.
_DEFAULT_T = 512


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
               "(layer.trainable = False), or use covered layers (Dense, "
               "EinsumDense, MultiHeadAttention, Embedding, ReversibleEmbedding, "
               "PositionEmbedding, LayerNormalization, RMS norms).")
        super().__init__(msg)


# --------------------------------------------------------------------------
# Small helpers


def _static(dim):
    return dim if isinstance(dim, int) else None


def _prod(dims):
    out = 1
    for d in dims:
        if d is None:
            return None
        out *= d
    return out


def _or(value, default):
    return default if value is None else value


def _as_float(x):
    x = tf.convert_to_tensor(x)
    return x if x.dtype.is_floating else tf.cast(x, tf.float32)


def _sum_except_batch(x):
    return tf.reduce_sum(x, axis=list(range(1, x.shape.rank)))


def _reduce_to_shape(g, shape):
    """Per-example gradient of a variable of ``shape`` broadcast (right-aligned)
    against ``g`` = ``[B, ...]``: sum ``g`` over the broadcast axes."""
    rank, r = g.shape.rank, len(shape)
    if rank - r < 1:
        return None
    lead = list(range(1, rank - r))
    if lead:
        g = tf.reduce_sum(g, axis=lead)
    trail = [1 + j for j in range(r) if shape[j] == 1 and g.shape[1 + j] != 1]
    if trail:
        g = tf.reduce_sum(g, axis=trail, keepdims=True)
    return tf.reshape(g, [-1] + list(shape))


def _var_path(v):
    return getattr(v, "path", None) or v.name


# --------------------------------------------------------------------------
# Contributions: one recorded use of a variable inside a covered layer call.


class _Call:
    """One call of a covered layer: its watched output ``z`` (and later ``g``)."""

    def __init__(self, layer, z):
        self.layer, self.z, self.g = layer, z, None


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

    def inst_cost(self):
        return _or(self.H, 1) * _or(self.T, _DEFAULT_T) * _or(self.m, 1) * _or(self.n, 1)

    def instantiate(self):
        return self.to_var(tf.einsum("bhtm,bhtn->bhmn", self.X, self.Y), True)

    def clipped(self, c):
        X, Y = self.X, self.Y
        c4 = tf.reshape(tf.cast(c, X.dtype), [-1, 1, 1, 1])
        if _or(self.n, 0) <= _or(self.m, 0):
            Y = Y * c4
        else:
            X = X * c4
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

    def inst_cost(self):
        return _or(self.T, _DEFAULT_T) * _or(self.d, 1)

    def instantiate(self):
        B = tf.shape(self.G)[0]
        offs = self.ids + tf.range(B)[:, None] * self.V
        flat = tf.math.unsorted_segment_sum(tf.reshape(self.G, [-1, self.d]),
                                            tf.reshape(offs, [-1]), B * self.V)
        return tf.reshape(flat, [-1, self.V, self.d])

    def clipped(self, c):
        G = self.G * tf.reshape(tf.cast(c, self.G.dtype), [-1, 1, 1])
        return tf.math.unsorted_segment_sum(tf.reshape(G, [-1, self.d]),
                                            tf.reshape(self.ids, [-1]), self.V)


class _PerExample:
    """A per-example gradient that is cheap to instantiate: ``fn(g) -> [B, *shape]``."""

    kind = "dense"

    def __init__(self, var, call, fn):
        self.var, self.call, self._fn = var, call, fn

    def prepare(self):
        self.P = tf.cast(self._fn(tf.convert_to_tensor(self.call.g)), tf.float32)

    def inst_cost(self):
        return _prod([_static(s) for s in self.var.shape]) or 1

    def instantiate(self):
        return self.P

    def clipped(self, c):
        return tf.tensordot(tf.cast(c, self.P.dtype), self.P, axes=1)


class _Grams:
    """Cache of per-example Gram matrices keyed by factor identity.

    A key names everything that determines the factor (the source tensor, the
    einsum that permutes it and the ``[B, H, T, m]`` reshape), so two layers
    share a Gram only when their factors are the same tensor (e.g. the query,
    key and value projections of one input); ``None`` is never cached.
    """

    def __init__(self):
        self._cache = {}

    def get(self, key_a, a, key_b, b):
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
        return _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T) * (_or(a.d, 1) + 1)
    lin, lk = (a, b) if a.kind == "linear" else (b, a)
    return _or(lin.T, _DEFAULT_T) * _or(lk.T, _DEFAULT_T) * (_or(lk.d, 1) + 2)


def _pair_mem(a, b):
    """Floats per example of the Gram matrices a ghost pair needs."""
    if a.kind == "linear" and b.kind == "linear":
        return 2 * _or(a.H, 1) * _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T)
    if a is b and a.kind == "lookup" and a.distinct:
        return 0
    return 2 * _or(a.T, _DEFAULT_T) * _or(b.T, _DEFAULT_T)


def _inner(a, b, grams):
    """Per-example inner product <grad_a_i, grad_b_i>, shape [B]."""
    if a.kind == "linear" and b.kind == "linear":
        xx = grams.get(a.keys[0], a.X, b.keys[0], b.X)
        yy = grams.get(a.keys[1], a.Y, b.keys[1], b.Y)
        return tf.reduce_sum(xx * yy, axis=[1, 2, 3])
    if a.kind == "lookup" and b.kind == "lookup":
        if a is b and a.distinct:
            return tf.reduce_sum(tf.square(a.G), axis=[1, 2])
        same = tf.cast(tf.equal(a.ids[:, :, None], b.ids[:, None, :]), a.G.dtype)
        return tf.reduce_sum(same * tf.matmul(a.G, b.G, transpose_b=True), axis=[1, 2])
    lin, lk = (a, b) if a.kind == "linear" else (b, a)
    # <sum_t e_{id_t} g_t^T, sum_s x_s h_s^T> = sum_{t,s} x_s[id_t] (g_t . h_s)
    x = lin.X[:, 0]                                            # [B, S, V]
    h = lin.Y[:, 0]                                            # [B, S, d]
    picked = tf.gather(x, lk.ids, axis=2, batch_dims=1)        # [B, S, T]
    return tf.reduce_sum(picked * tf.matmul(h, lk.G, transpose_b=True), axis=[1, 2])


def _choose(contribs, batch):
    """"ghost" or "instantiate" for one variable's contributions (static decision)."""
    if any(c.kind == "dense" for c in contribs):
        return "instantiate"
    pairs = [(a, b) for i, a in enumerate(contribs) for b in contribs[i:]]
    if not all(_ghostable(a, b) for a, b in pairs):
        return "instantiate"
    size = _prod([_static(s) for s in contribs[0].var.shape]) or 1
    ghost = sum(_pair_cost(a, b) for a, b in pairs)
    inst = sum(c.inst_cost() for c in contribs) + (len(contribs) + 1) * size
    b = _or(batch, 32)
    ghost_mem = 4 * b * max(_pair_mem(a, b_) for a, b_ in pairs)
    inst_mem = 4 * b * size
    ghost_ok, inst_ok = ghost_mem <= _GHOST_MAX_BYTES, inst_mem <= _INSTANTIATE_MAX_BYTES
    if ghost_ok and inst_ok:
        return "ghost" if ghost <= inst else "instantiate"
    if ghost_ok or inst_ok:
        return "ghost" if ghost_ok else "instantiate"
    return "ghost" if ghost_mem <= inst_mem else "instantiate"


def _sq_norm(contribs, choice, grams):
    if choice == "ghost":
        total = None
        for i, a in enumerate(contribs):
            for j in range(i, len(contribs)):
                term = _inner(a, contribs[j], grams)
                term = term if i == j else 2.0 * term
                total = term if total is None else total + term
        return tf.cast(total, tf.float32)
    per = contribs[0].instantiate()
    for c in contribs[1:]:
        per = per + c.instantiate()
    return tf.cast(_sum_except_batch(tf.square(per)), tf.float32)


# --------------------------------------------------------------------------
# Rules: which layers are covered, and their recording forward passes.


def _plain(layer):
    """No LoRA, no quantization, no per-instance ``call``: the class's computation."""
    return (getattr(layer, "quantization_mode", None) is None
            and not getattr(layer, "lora_enabled", False)
            and "call" not in layer.__dict__)


def _orig(layer):
    return functools.partial(type(layer).call, layer)


class _DenseRule:
    name = "Dense"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [v for v in (layer._kernel, layer.bias) if v is not None]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        z = ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = ops.add(z, layer.bias)
        call = rec.new_call(layer, z)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            din, dout = (int(s) for s in layer._kernel.shape)
            T = _prod([_static(s) for s in x.shape[1:-1]])

            def factors(g, x=x):
                return (tf.reshape(x, [-1, 1, _or(T, -1), din]),
                        tf.reshape(tf.cast(g, x.dtype), [-1, 1, _or(T, -1), dout]))

            def to_var(mat, batched):
                return tf.reshape(mat, ([-1] if batched else []) + [din, dout])

            rec.add(_Linear(layer._kernel, call, factors, to_var, (1, din, T, dout),
                            layout=("dense", din, dout),
                            keys=(("dense-x", x.ref(), T, din), None)))
            if layer.bias is not None:
                shape = tuple(int(s) for s in layer.bias.shape)
                rec.add(_PerExample(layer.bias, call,
                                    lambda g, s=shape: _reduce_to_shape(g, s)))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer.bias:
            return "instantiate"
        din, dout = (int(s) for s in var.shape)
        shape = _inbound_shape(layer)
        if shape is not None:
            dims = [_static(s) for s in shape[1:-1]]
            T = 1 if not dims else (_prod(dims) or T)
        return _static_linear(1, din, dout, T, B)


def _inbound_shape(layer):
    """Static input shape of a layer's first call in a functional graph, if any."""
    try:
        return tuple(layer._inbound_nodes[0].input_tensors[0].shape)
    except (AttributeError, IndexError, TypeError):
        return None


def _static_linear(H, m, n, T, B):
    ghost, inst = H * T * T * (m + n + 1), H * T * m * n + 2 * H * m * n
    ghost_ok = 4 * B * 2 * H * T * T <= _GHOST_MAX_BYTES
    inst_ok = 4 * B * H * m * n <= _INSTANTIATE_MAX_BYTES
    if ghost_ok and inst_ok:
        return "ghost" if ghost <= inst else "instantiate"
    if ghost_ok or inst_ok:
        return "ghost" if ghost_ok else "instantiate"
    return "ghost" if T * T <= m * n else "instantiate"


def _einsum_parts(equation, input_rank):
    """Split an EinsumDense equation into batch / shared / seq / in / out letters."""
    equation = equation.replace(" ", "")
    try:
        lhs, out = equation.split("->")
        inp, ker = lhs.split(",")
    except ValueError:
        return None
    if "..." in ker:
        return None
    if "..." in inp:
        n_ell = input_rank - (len(inp) - 3)
        if n_ell < 0:
            return None
        free = [c for c in string.ascii_letters if c not in equation][:n_ell]
        inp = inp.replace("...", "".join(free))
        out = out.replace("...", "".join(free))
    if "..." in out or len(inp) != input_rank or input_rank < 1:
        return None
    if any(len(set(s)) != len(s) for s in (inp, ker, out)):
        return None
    b = inp[0]
    if not out or out[0] != b or b in ker:
        return None
    shared = [c for c in ker if c in inp and c in out]
    ins = [c for c in ker if c in inp and c not in out]
    outs = [c for c in ker if c in out and c not in inp]
    seq = [c for c in inp[1:] if c in out and c not in ker]
    if sorted(out[1:]) != sorted(shared + outs + seq) or len(ker) != len(shared + ins + outs):
        return None
    return dict(inp=inp, ker=ker, out=out, b=b, shared=shared, ins=ins, outs=outs, seq=seq)


class _EinsumDenseRule:
    name = "EinsumDense"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [v for v in (layer._kernel, layer.bias) if v is not None]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        z = ops.einsum(layer.equation, inputs, layer.kernel)
        if layer.bias is not None:
            z = ops.add(z, layer.bias)
        call = rec.new_call(layer, z)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            p = _einsum_parts(layer.equation, x.shape.rank)
            kshape = [int(s) for s in layer._kernel.shape]
            if p is None:
                rec.mark_bad(layer._kernel, f"einsum equation {layer.equation!r}")
            else:
                size = dict(zip(p["ker"], kshape))
                sh = [size[c] for c in p["shared"]]
                ins = [size[c] for c in p["ins"]]
                outs = [size[c] for c in p["outs"]]
                H, m, n = _prod(sh), _prod(ins), _prod(outs)
                pos = dict(zip(p["inp"], x.shape))
                T = _prod([_static(pos[c]) for c in p["seq"]])
                xs = f"{p['inp']}->{p['b']}{''.join(p['shared'] + p['seq'] + p['ins'])}"
                ys = f"{p['out']}->{p['b']}{''.join(p['shared'] + p['seq'] + p['outs'])}"
                order = p["shared"] + p["ins"] + p["outs"]
                perm = [order.index(c) for c in p["ker"]]

                def factors(g, x=x):
                    X = tf.einsum(xs, x) if xs.split("->")[0] != xs.split("->")[1] else x
                    Y = tf.cast(g, x.dtype)
                    Y = tf.einsum(ys, Y) if ys.split("->")[0] != ys.split("->")[1] else Y
                    return (tf.reshape(X, [-1, H, _or(T, -1), m]),
                            tf.reshape(Y, [-1, H, _or(T, -1), n]))

                def to_var(mat, batched):
                    lead = [-1] if batched else []
                    mat = tf.reshape(mat, lead + sh + ins + outs)
                    if perm != sorted(perm):
                        mat = tf.transpose(mat, ([0] + [1 + q for q in perm]) if batched else perm)
                    return mat

                rec.add(_Linear(layer._kernel, call, factors, to_var, (H, m, T, n),
                                layout=("einsum", layer.equation, tuple(kshape)),
                                keys=(("einsum-x", x.ref(), xs, H, T, m), None)))
            if layer.bias is not None:
                shape = tuple(int(s) for s in layer.bias.shape)
                if z.shape.rank - len(shape) < 1:
                    rec.mark_bad(layer.bias, "bias spans the batch axis")
                else:
                    rec.add(_PerExample(layer.bias, call,
                                        lambda g, s=shape: _reduce_to_shape(g, s)))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer.bias:
            return "instantiate"
        inp = layer.equation.replace(" ", "").split(",")[0]
        rank = len(inp) - 1 if "..." in inp else len(inp)  # "..." -> batch + seq
        shape = _inbound_shape(layer)
        rank = len(shape) if shape is not None else rank
        p = _einsum_parts(layer.equation, rank)
        if p is None:
            return "exact"
        if shape is not None:
            known = _prod([_static(shape[p["inp"].index(c)]) for c in p["seq"]])
            T = known if known is not None else T
        size = dict(zip(p["ker"], (int(s) for s in var.shape)))
        H = _prod([size[c] for c in p["shared"]])
        m = _prod([size[c] for c in p["ins"]])
        n = _prod([size[c] for c in p["outs"]])
        return _static_linear(H, m, n, T if p["seq"] else 1, B)


class _EmbeddingRule:
    """keras Embedding and (keras / KerasHub) ReversibleEmbedding, tied or not."""

    name = "Embedding"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def _reversible(layer):
        rev = getattr(keras.layers, "ReversibleEmbedding", None)
        return rev is not None and isinstance(layer, rev)

    @staticmethod
    def variables(layer):
        vs = [layer._embeddings]
        if _EmbeddingRule._reversible(layer) and not layer.tie_weights:
            vs.append(layer.reverse_embeddings)
        return vs

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        reverse = False
        if _EmbeddingRule._reversible(layer):
            reverse = kwargs.pop("reverse", args[0] if args else False)
            args = ()
        if not reverse:
            z = _orig(layer)(inputs, *args, **kwargs)
            call = rec.new_call(layer, z)
            if call is not None:
                rec.add(_Lookup(layer._embeddings, call, inputs))
            return z
        x = tf.convert_to_tensor(inputs)
        if layer.tie_weights:
            kernel = ops.transpose(layer.embeddings)
        else:
            kernel = layer.reverse_embeddings
        if layer.reverse_dtype is not None:
            x = ops.cast(x, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        z = ops.matmul(x, kernel)
        call = rec.new_call(layer, z)
        if call is not None:
            V, d = layer.input_dim, layer.output_dim
            T = _prod([_static(s) for s in x.shape[1:-1]])

            if layer.tie_weights:
                def factors(g, x=x):
                    return (tf.reshape(tf.cast(g, x.dtype), [-1, 1, _or(T, -1), V]),
                            tf.reshape(x, [-1, 1, _or(T, -1), d]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [V, d])

                rec.add(_Linear(layer._embeddings, call, factors, to_var, (1, V, T, d),
                                layout=("rows", V, d), keys=(None, ("rev-h", x.ref(), T, d)),
                                rows=True))
            else:
                def factors(g, x=x):
                    return (tf.reshape(x, [-1, 1, _or(T, -1), d]),
                            tf.reshape(tf.cast(g, x.dtype), [-1, 1, _or(T, -1), V]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [d, V])

                rec.add(_Linear(layer.reverse_embeddings, call, factors, to_var,
                                (1, d, T, V), layout=("dense", d, V),
                                keys=(("dense-x", x.ref(), T, d), None)))
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            return ops.multiply(ops.tanh(ops.divide(z, cap)), cap)
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer._embeddings:
            return "ghost"
        return _static_linear(1, layer.output_dim, layer.input_dim, T, B)


def _keras_hub_class(path, name):
    try:
        import importlib
        return getattr(importlib.import_module(path), name)
    except Exception:  # pragma: no cover - keras_hub missing or moved
        return None


class _PositionEmbeddingRule:
    name = "PositionEmbedding"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [layer.position_embeddings]

    @staticmethod
    def forward(layer, rec, inputs, start_index=0, positions=None):
        z = _orig(layer)(inputs, start_index=start_index, positions=positions)
        call = rec.new_call(layer, z)
        if call is not None:
            if z.shape.rank != 3:
                rec.mark_bad(layer.position_embeddings, "input rank != 3")
                return z
            shape = tf.shape(z)
            if positions is None:
                ids = tf.cast(start_index, tf.int32) + tf.range(shape[1], dtype=tf.int32)
                distinct = True
            else:
                ids = tf.cast(positions, tf.int32)
                distinct = False
            ids = tf.broadcast_to(ids if ids.shape.rank == 2 else ids[None], shape[:2])
            ids.set_shape(z.shape[:2])
            rec.add(_Lookup(layer.position_embeddings, call, ids, distinct=distinct))
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        return "ghost"


def _norm_axes(axis, rank):
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return sorted(a % rank for a in axes)


def _scale_grad(g, xhat, axes):
    """Per-example gradient of an elementwise scale over ``axes``: sum of g*xhat."""
    other = [a for a in range(1, g.shape.rank) if a not in axes]
    prod = tf.cast(g, xhat.dtype) * xhat
    return tf.reduce_sum(prod, axis=other) if other else prod


def _shift_grad(g, axes):
    other = [a for a in range(1, g.shape.rank) if a not in axes]
    return tf.reduce_sum(g, axis=other) if other else g


class _LayerNormRule:
    name = "LayerNormalization"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [v for v in (layer.gamma, layer.beta) if v is not None]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = _orig(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            axes = _norm_axes(layer.axis, x.shape.rank)
            if 0 in axes:
                for v in _LayerNormRule.variables(layer):
                    rec.mark_bad(v, "normalises over the batch axis")
                return y
            eps, rms = layer.epsilon, layer.rms_scaling

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                mean, var = tf.nn.moments(x32, axes=axes, keepdims=True)
                if rms:
                    return x32 * tf.math.rsqrt(var + eps)
                return (x32 - mean) * tf.math.rsqrt(var + eps)

            if layer.gamma is not None:
                rec.add(_PerExample(layer.gamma, call,
                                    lambda g: _scale_grad(g, xhat(), axes)))
            if layer.beta is not None:
                rec.add(_PerExample(layer.beta, call, lambda g: _shift_grad(g, axes)))
        return y

    @staticmethod
    def static_method(layer, var, T, B):
        return "instantiate"


class _RMSNormRule:
    """LlamaLayerNorm (KerasHub Llama), keras.layers.RMSNormalization and
    keras_hub.layers.RMSNormalization: y = x * rsqrt(mean(x^2) + eps) * scale."""

    name = "RMSNorm"

    @staticmethod
    def _kind(layer):
        t = type(layer).call
        llama = _keras_hub_class("keras_hub.src.models.llama.llama_layernorm",
                                 "LlamaLayerNorm")
        if llama is not None and t is llama.call:
            return "llama"
        krms = getattr(keras.layers, "RMSNormalization", None)
        if krms is not None and t is krms.call:
            return "keras"
        hrms = _keras_hub_class("keras_hub.src.layers.modeling.rms_normalization",
                                "RMSNormalization")
        if hrms is not None and t is hrms.call:
            return "hub"
        return None

    @staticmethod
    def matches(layer):
        return _RMSNormRule._kind(layer) is not None

    @staticmethod
    def variables(layer):
        return [layer.scale]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = _orig(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            kind = _RMSNormRule._kind(layer)
            if kind == "llama":
                axes, eps = [x.shape.rank - 1], layer.epsilon
            elif kind == "keras":
                axes = _norm_axes(layer.axis, x.shape.rank)
                eps = layer.epsilon if layer.epsilon is not None else keras.config.epsilon()
            else:
                axes, eps = [x.shape.rank - 1], 1e-6
            if 0 in axes:
                rec.mark_bad(layer.scale, "normalises over the batch axis")
                return y

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                ms = tf.reduce_mean(tf.square(x32), axis=axes, keepdims=True)
                return x32 * tf.math.rsqrt(ms + eps)

            rec.add(_PerExample(layer.scale, call,
                                lambda g: _scale_grad(g, xhat(), axes)))
        return y

    @staticmethod
    def static_method(layer, var, T, B):
        return "instantiate"


_RULES_BY_CLASS = {}


def register_clipping_rule(layer_class, rule):
    """Declare how fast clipping handles ``layer_class`` (exactly that class).

    Fast clipping claims a layer only when ``type(layer)`` is a registered
    class: a subclass may change the forward computation (a reparametrised
    ``kernel``, an extra scale) that a rule's norm formula assumes, so it is
    never matched implicitly and falls back to exact per-example gradients.

    Args:
        layer_class: the class being declared.
        rule: a covered Keras layer class whose rule applies because
            ``layer_class`` computes exactly what that class computes (a
            declared contract: same ``call``, same use of the same variables),
            or a rule object with ``variables(layer)``, ``forward(layer,
            recorder, *args, **kwargs)``, ``static_method(layer, variable, T, B)``
            and ``matches(layer)`` as the built-in rules in this module have.

    Example:
        >>> import keras
        >>> class MyDense(keras.layers.Dense):   # same computation, extra config only
        ...     pass
        >>> register_clipping_rule(MyDense, keras.layers.Dense)
        >>> model = keras.Sequential([keras.Input((3,)), MyDense(2)])
        >>> "exact" in clipping_coverage(model).values()   # kernel ghost, bias instantiated
        False
    """
    if not isinstance(layer_class, type):
        raise TypeError(f"`layer_class` must be a class, got {layer_class!r}.")
    if isinstance(rule, type) and rule in _RULES_BY_CLASS:
        rule = _RULES_BY_CLASS[rule]
    for method in ("variables", "forward", "static_method", "matches"):
        if not callable(getattr(rule, method, None)):
            raise TypeError(
                f"`rule` must be a covered layer class ({', '.join(sorted(c.__name__ for c in _RULES_BY_CLASS))}) "
                f"or a rule object with a `{method}` method, got {rule!r}.")
    _RULES_BY_CLASS[layer_class] = rule


def _register_builtin_rules():
    rules = [(keras.layers.Dense, _DenseRule), (keras.layers.EinsumDense, _EinsumDenseRule),
             (keras.layers.Embedding, _EmbeddingRule),
             (keras.layers.LayerNormalization, _LayerNormRule)]
    for name in ("ReversibleEmbedding",):
        if hasattr(keras.layers, name):
            rules.append((getattr(keras.layers, name), _EmbeddingRule))
    if hasattr(keras.layers, "RMSNormalization"):
        rules.append((keras.layers.RMSNormalization, _RMSNormRule))
    hub = [("keras_hub.src.layers.modeling.position_embedding", "PositionEmbedding",
            _PositionEmbeddingRule, None),
           ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm", _RMSNormRule, None),
           ("keras_hub.src.layers.modeling.rms_normalization", "RMSNormalization",
            _RMSNormRule, None),
           # KerasHub's subclass adds preset plumbing only: the contract is that it
           # inherits Keras's computation unchanged, checked here.
           ("keras_hub.src.layers.modeling.reversible_embedding", "ReversibleEmbedding",
            _EmbeddingRule, getattr(keras.layers, "ReversibleEmbedding", None))]
    for path, name, rule, base in hub:
        cls = _keras_hub_class(path, name)
        if cls is None:
            continue
        if base is not None and not all(
                getattr(cls, attr, None) is getattr(base, attr, None)
                for attr in ("call", "embeddings", "build")):
            continue
        rules.append((cls, rule))
    for cls, rule in rules:
        _RULES_BY_CLASS.setdefault(cls, rule)


_register_builtin_rules()


def _rule_for(layer):
    if not getattr(layer, "built", False) or not _plain(layer):
        return None
    rule = _RULES_BY_CLASS.get(type(layer))
    try:
        return rule if rule is not None and rule.matches(layer) else None
    except AttributeError:
        return None


# --------------------------------------------------------------------------
# Plan, recording


def _layer_desc(layer):
    return f"{layer.path if getattr(layer, 'path', None) else layer.name} ({type(layer).__name__})"


class _Plan:
    def __init__(self, model):
        self.trainable = list(model.trainable_variables)
        t_ids = {id(v) for v in self.trainable}
        self.layers = {}      # id(layer) -> (layer, rule)
        self.covered = {}     # id(var) -> (layer, rule)
        owners = {}
        for layer in model._flatten_layers(include_self=True, recursive=True):
            for v in getattr(layer, "_trainable_variables", []):
                owners.setdefault(id(v), layer)
            rule = _rule_for(layer)
            if rule is None:
                continue
            vs = [v for v in rule.variables(layer) if id(v) in t_ids]
            if vs:
                self.layers[id(layer)] = (layer, rule)
                for v in vs:
                    self.covered[id(v)] = (layer, rule)
        self.owners = owners
        self.uncovered = [v for v in self.trainable if id(v) not in self.covered]

    def describe(self, variables):
        out = collections.OrderedDict()
        for v in variables:
            layer = self.owners.get(id(v))
            key = _layer_desc(layer) if layer is not None else "(no layer)"
            out.setdefault(key, []).append(_var_path(v))
        return out


class _Recorder:
    def __init__(self, plan, tape, detect):
        self.plan, self.tape, self.detect = plan, tape, detect
        self.calls, self.contribs, self.bad = [], [], {}
        self.depth = 0
        self.eager = tf.executing_eagerly()
        self.graph = None if self.eager else tf.compat.v1.get_default_graph()

    def foreign_context(self):
        """A reason when the current call runs in another graph than the
        recording (a ``tf.while_loop`` / ``tf.cond`` body, e.g. an RNN cell):
        its tensors cannot be watched from here."""
        if tf.executing_eagerly() != self.eager or (
                not self.eager and tf.compat.v1.get_default_graph() is not self.graph):
            return "called inside a control-flow body (e.g. an RNN cell or tf.cond)"
        return None

    def mark_layer_bad(self, layer, rule, reason):
        for v in rule.variables(layer):
            self.mark_bad(v, reason)

    def new_call(self, layer, z):
        if self.depth != 1:
            return None
        self.tape.watch(z)
        call = _Call(layer, z)
        self.calls.append(call)
        return call

    def add(self, contrib):
        if id(contrib.var) in self.plan.covered:
            self.contribs.append(contrib)

    def mark_bad(self, var, reason):
        if id(var) in self.plan.covered:
            self.bad[id(var)] = reason


_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()
_INSTALLED = {}   # id(layer) -> [layer, count]


def _active():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _make_wrapper(layer):
    def call(*args, **kwargs):
        rec = _active()
        entry = rec.plan.layers.get(id(layer)) if rec is not None else None
        if entry is None:
            return _orig(layer)(*args, **kwargs)
        reason = ("called inside another covered layer's computation (e.g. as its "
                  "activation)" if rec.depth > 0 else rec.foreign_context())
        if reason is not None:
            # The rule describes this layer's own call only: fall back to exact
            # per-example gradients for its variables.
            rec.mark_layer_bad(layer, entry[1], reason)
            return _orig(layer)(*args, **kwargs)
        rec.depth += 1
        try:
            ctx = rec.detect.stop_recording() if rec.detect is not None else contextlib.nullcontext()
            with ctx:
                return entry[1].forward(layer, rec, *args, **kwargs)
        finally:
            rec.depth -= 1
    call._keras_dp_lm_wrapper = True
    return call


@contextlib.contextmanager
def _recording(rec):
    """Install recording wrappers on the plan's layers (thread-safe, restored on exit)."""
    layers = [layer for layer, _ in rec.plan.layers.values()]
    with _INSTALL_LOCK:
        for layer in layers:
            entry = _INSTALLED.get(id(layer))
            if entry is None:
                object.__setattr__(layer, "call", _make_wrapper(layer))
                _INSTALLED[id(layer)] = [layer, 1]
            else:
                entry[1] += 1
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.pop()
        with _INSTALL_LOCK:
            for layer in layers:
                entry = _INSTALLED[id(layer)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _INSTALLED[id(layer)]
                    if getattr(layer.__dict__.get("call"), "_keras_dp_lm_wrapper", False):
                        object.__delattr__(layer, "call")


# --------------------------------------------------------------------------
# Exact fallback


def _slice_example(data, i):
    def one(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        return t[i:i + 1] if t.shape.rank else t
    return tf.nest.map_structure(one, data)


def _losses_and_outputs(result):
    """``loss_fn`` may return ``losses`` or ``(losses, model_outputs)``."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    return result, None


def _tf_variable(v):
    """The tf.Variable behind a Keras variable (TensorFlow backend)."""
    inner = getattr(v, "_value", None)
    return inner if isinstance(inner, tf.Variable) else v


def _per_example_grads(loss_fn, data, variables, batch):
    """Exact per-example gradients of ``variables``: ``[B, *v.shape]`` each."""

    tf_vars = [_tf_variable(v) for v in variables]

    def one(i):
        example = _slice_example(data, i)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(tf_vars)
            loss = tf.reduce_sum(_losses_and_outputs(loss_fn(example))[0])
        grads = tape.gradient(loss, tf_vars,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    spec = [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in variables]
    return tf.map_fn(one, tf.range(batch), fn_output_signature=spec)


# --------------------------------------------------------------------------
# Public API

_LAST_DECISIONS = weakref.WeakKeyDictionary()
_LAST_REASONS = weakref.WeakKeyDictionary()


def fast_clipped_sum(model, loss_fn, data, l2_norm_clip, method="auto", slot_mask=None):
    """Per-example gradient norms and the sum of clipped per-example gradients.

    Args:
        model: a built Keras 3 model (TensorFlow backend).
        loss_fn: ``loss_fn(data) -> [B]`` per-example losses, running the model
            forward (``training=True``) on the batch; each example's loss must
            depend on that example only.  It may also return
            ``(losses, model_outputs)``: the outputs of the batched forward
            pass are then returned as ``ClippedSum.outputs`` (e.g. for metrics,
            saving the DP step a second forward pass).
        data: nested structure of tensors with leading batch dimension ``B``.
        l2_norm_clip: clip norm ``C``; ``c_i = min(1, C / ||grad_i||)``.
        method: ``"auto"`` (fast rules for covered variables, exact per-example
            gradients for the rest) or ``"fast"`` (raise
            :class:`UncoveredLayersError` if any trainable variable is uncovered).
        slot_mask: optional ``[B]``, 0 on padding slots: their clip factor is 0,
            so they add exactly nothing to the clipped sum.

    Returns:
        :class:`ClippedSum` ``(grads, norms, losses, outputs)``: ``grads``
        aligned with ``model.trainable_variables`` (clipped sum, no noise, not
        divided; zeros for variables the loss does not touch), ``norms``
        ``[B]`` per-example global norms before clipping, ``losses`` ``[B]``,
        ``outputs`` as described under ``loss_fn`` (else ``None``).

    Raises:
        UncoveredLayersError: with ``method="fast"``, listing the layers and
            variables that have no fast rule (or that are read outside their
            layer's ``call``).
    """
    if method not in ("auto", "fast"):
        raise ValueError(f"method must be 'auto' or 'fast', got {method!r}")
    plan = _Plan(model)
    if method == "fast" and plan.uncovered:
        raise UncoveredLayersError(plan.describe(plan.uncovered))

    with tf.GradientTape(watch_accessed_variables=False) as tape:
        with tf.GradientTape(watch_accessed_variables=True) as detect:
            rec = _Recorder(plan, tape, detect)
            with _recording(rec):
                losses, outputs = _losses_and_outputs(loss_fn(data))
        losses = _as_float(losses)
        total = tf.reduce_sum(losses)

    outside = {v.ref() for v in detect.watched_variables()}

    def read_outside(v):
        tv = _tf_variable(v)
        try:
            return tv.ref() in outside
        except (AttributeError, TypeError):
            return False

    exact, reasons = [], {}
    for v in plan.trainable:
        if id(v) not in plan.covered:
            exact.append(v)
        elif id(v) in rec.bad:
            exact.append(v)
            reasons[id(v)] = rec.bad[id(v)]
        elif read_outside(v):
            exact.append(v)
            reasons[id(v)] = "read outside its layer's call"
    if method == "fast" and exact:
        raise UncoveredLayersError(
            plan.describe(exact),
            reason="; ".join(sorted(set(reasons.values()))) or None)
    exact_ids = {id(v) for v in exact}

    by_var = collections.OrderedDict()
    for c in rec.contribs:
        if id(c.var) not in exact_ids:
            by_var.setdefault(id(c.var), []).append(c)
    calls = [call for call in rec.calls
             if any(c.call is call for cs in by_var.values() for c in cs)]
    if calls:
        gz = tape.gradient(total, [call.z for call in calls],
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
        for call, g in zip(calls, gz):
            call.g = tf.convert_to_tensor(g)

    batch = _static(losses.shape[0]) if losses.shape.rank else None
    B = batch if batch is not None else tf.shape(losses)[0]
    sq = tf.zeros([B], tf.float32)
    grams = _Grams()
    decisions = {}
    for key, contribs in by_var.items():
        for c in contribs:
            c.prepare()
        choice = _choose(contribs, batch)
        decisions[_var_path(contribs[0].var)] = choice
        sq = sq + _sq_norm(contribs, choice, grams)

    per_example = {}
    if exact:
        pe = _per_example_grads(loss_fn, data, exact, B)
        for v, g in zip(exact, pe):
            per_example[id(v)] = g
            sq = sq + _sum_except_batch(tf.square(tf.cast(g, tf.float32)))
            decisions[_var_path(v)] = "exact"

    norms = tf.sqrt(sq)
    clip = tf.cast(l2_norm_clip, tf.float32)
    factors = clip / tf.maximum(norms, clip)
    if slot_mask is not None:
        factors = tf.where(tf.cast(slot_mask, tf.float32) > 0, factors, 0.0)

    grads = []
    for v in plan.trainable:
        if id(v) in per_example:
            g = tf.cast(per_example[id(v)], tf.float32)
            grads.append(tf.cast(tf.tensordot(factors, g, axes=1), tf.as_dtype(v.dtype)))
        elif id(v) in by_var:
            g = None
            for c in by_var[id(v)]:
                part = c.clipped(factors)
                g = part if g is None else g + part
            grads.append(tf.cast(g, tf.as_dtype(v.dtype)))
        else:
            grads.append(tf.zeros(v.shape, tf.as_dtype(v.dtype)))
    try:
        _LAST_DECISIONS[model] = decisions
        _LAST_REASONS[model] = {_var_path(v): r for v in plan.trainable
                                for r in [reasons.get(id(v))] if r}
    except TypeError:  # pragma: no cover
        pass
    return ClippedSum(grads=grads, norms=norms, losses=losses, outputs=outputs)


def clipping_coverage(model, sequence_length=None, batch_size=None):
    """How each trainable variable's per-example norm will be computed.

    Returns a dict ``var.path -> "ghost" | "instantiate" | "exact"``:

    * ``"ghost"``: norm from Gram matrices of layer inputs and output
      gradients, never forming the per-example gradient;
    * ``"instantiate"``: per-example gradient formed (transiently, or kept when
      tiny: norm scales, biases) to take its norm;
    * ``"exact"``: no fast rule; exact per-example gradients from one
      forward/backward pass per example (``method="auto"``) or an
      :class:`UncoveredLayersError` (``method="fast"``).

    Covered variables' clipped sums always use book-keeping (one
    ``sum_i c_i a_i^T g_i`` matmul, or ``sum_i c_i grad_i`` when instantiated).
    Without ``sequence_length``, the decisions of the last
    :func:`fast_clipped_sum` call on this model are reported if there was one,
    else they are estimated for ``sequence_length=128, batch_size=32``.  The
    ghost / instantiate choice is made per call from static shapes.
    """
    plan = _Plan(model)
    last = _LAST_DECISIONS.get(model) if sequence_length is None else None
    T = sequence_length or 128
    B = batch_size or 32
    out = {}
    for v in plan.trainable:
        path = _var_path(v)
        if id(v) not in plan.covered:
            out[path] = "exact"
        elif last is not None and path in last:
            out[path] = last[path]
        else:
            layer, rule = plan.covered[id(v)]
            out[path] = rule.static_method(layer, v, T, B)
    return out


def exact_reason(model, variable):
    """Why ``variable`` gets exact per-example gradients ("" when it does not)."""
    reason = _LAST_REASONS.get(model, {}).get(_var_path(variable))
    if reason:
        return reason
    plan = _Plan(model)
    if id(variable) in plan.covered:
        return ""
    layer = plan.owners.get(id(variable))
    if layer is None:
        return "not created by a layer"
    if not _plain(layer):
        return "LoRA, quantized or per-instance call"
    if type(layer) not in _RULES_BY_CLASS:
        parents = [c.__name__ for c in type(layer).__mro__[1:] if c in _RULES_BY_CLASS]
        if parents:
            return (f"{type(layer).__name__} subclasses {parents[0]} but is not registered "
                    "(register_clipping_rule): a subclass may change the computation")
        return f"no rule for {type(layer).__name__}"
    return "the rule does not cover this variable"


def coverage_report(model, sequence_length=None, batch_size=None):
    """A readable table of :func:`clipping_coverage` with layer names and sizes."""
    cov = clipping_coverage(model, sequence_length, batch_size)
    plan = _Plan(model)
    rows = []
    counts = collections.Counter()
    for v in plan.trainable:
        path = _var_path(v)
        layer = plan.owners.get(id(v))
        size = _prod([_static(s) for s in v.shape]) or 0
        counts[cov[path]] += size
        rows.append((path, _layer_desc(layer) if layer is not None else "-",
                     "x".join(str(s) for s in v.shape), cov[path],
                     exact_reason(model, v) if cov[path] == "exact" else ""))
    header = ("variable", "layer", "shape", "method", "why exact")
    w = [max([len(r[i]) for r in rows] + [len(h)]) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % n for n in w)
    lines = [fmt.format(*header), fmt.format(*("-" * n for n in w))]
    lines += [fmt.format(*r) for r in rows]
    total = sum(counts.values()) or 1
    lines.append("")
    lines.append("parameters: " + ", ".join(
        f"{k} {n} ({100.0 * n / total:.1f}%)" for k, n in sorted(counts.items())))
    uncovered = plan.describe(plan.uncovered)
    if uncovered:
        lines.append("uncovered layers (exact per-example gradients with "
                     "method='auto', error with method='fast'): "
                     + "; ".join(uncovered))
    return "\n".join(lines)
