"""Fast-clipping rule for ``keras.layers.EinsumDense`` (and so MultiHeadAttention), LoRA included."""

import string

import keras
import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import batch_and_length
from keras_dp_lm.clipping._common import inbound_shape
from keras_dp_lm.clipping._common import lora_enabled
from keras_dp_lm.clipping._common import value_or
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import reduce_to_shape
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping.contributions import Linear
from keras_dp_lm.clipping.contributions import PerExample
from keras_dp_lm.clipping.ghost import static_linear
from keras_dp_lm.clipping.registry import register_clipping_rule


def _split(equation):
    """``(input, kernel, output)`` letters of a two-operand equation, or None."""
    try:
        lhs, out = equation.replace(" ", "").split("->")
        inp, ker = lhs.split(",")
    except ValueError:
        return None
    return inp, ker, out


def _einsum_parts(equation, input_rank):
    """Split an EinsumDense equation into batch / shared / seq / in / out letters."""
    split = _split(equation)
    if split is None:
        return None
    inp, ker, out = split
    equation = equation.replace(" ", "")
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


def _einsum_contribution(rec, var, call, x, equation):
    """Add the contribution of ``var`` used as ``z = einsum(equation, x, var)``
    (``call`` watches z), or mark it bad when the equation has no linear form."""
    p = _einsum_parts(equation, x.shape.rank)
    kshape = [int(s) for s in var.shape]
    if p is None:
        rec.mark_bad(var, f"einsum equation {equation!r}")
        return
    size = dict(zip(p["ker"], kshape))
    sh = [size[c] for c in p["shared"]]
    ins = [size[c] for c in p["ins"]]
    outs = [size[c] for c in p["outs"]]
    H, m, n = product_of(sh), product_of(ins), product_of(outs)
    pos = dict(zip(p["inp"], x.shape))
    T = product_of([static_dim(pos[c]) for c in p["seq"]])
    xs = f"{p['inp']}->{p['b']}{''.join(p['shared'] + p['seq'] + p['ins'])}"
    ys = f"{p['out']}->{p['b']}{''.join(p['shared'] + p['seq'] + p['outs'])}"
    order = p["shared"] + p["ins"] + p["outs"]
    perm = [order.index(c) for c in p["ker"]]

    def factors(g, x=x):
        X = tf.einsum(xs, x) if xs.split("->")[0] != xs.split("->")[1] else x
        Y = tf.cast(g, x.dtype)
        Y = tf.einsum(ys, Y) if ys.split("->")[0] != ys.split("->")[1] else Y
        B, L = batch_and_length(X, T)
        return tf.reshape(X, [B, H, L, m]), tf.reshape(Y, [B, H, L, n])

    def to_var(mat, batched):
        lead = [-1] if batched else []
        mat = tf.reshape(mat, lead + sh + ins + outs)
        if perm != sorted(perm):
            mat = tf.transpose(mat, ([0] + [1 + q for q in perm]) if batched else perm)
        return mat

    rec.add(Linear(var, call, factors, to_var, (H, m, T, n),
                    layout=("einsum", equation, tuple(kshape)),
                    keys=(("einsum-x", x.ref(), xs, H, T, m), None)))


def _lora_equations(equation):
    """``(eq_a, eq_b)`` with ``einsum(equation, x, A @ B) ==
    einsum(eq_b, einsum(eq_a, x, A), B)``, or None.

    Keras's LoRA kernel is ``A @ B`` with ``A`` the kernel's shape but a rank
    ``r`` last axis and ``B`` ``[r, last]``; the factorisation needs the
    kernel's last letter to be an output letter only (as in every attention
    and feed-forward projection).
    """
    split = _split(equation)
    if split is None:
        return None
    inp, ker, out = split
    eq = equation.replace(" ", "")
    last = ker[-1:]
    if not last or last == "." or last in inp or last not in out:
        return None
    r = next(c for c in string.ascii_letters if c not in eq)
    out_a = out.replace(last, r)
    return f"{inp},{ker[:-1]}{r}->{out_a}", f"{out_a},{r}{last}->{out}"


@register_clipping_rule(keras.layers.EinsumDense)
class _EinsumDenseRule:
    """``z = einsum(eq, x, W) + b``; with LoRA ``einsum(eq, x, W)`` plus
    ``einsum(eq_b, s einsum(eq_a, x, A), B)`` (the same function as Keras's
    merged kernel ``W + s A B``, factored so the adapters are two thin linear
    contributions and the frozen ``W`` none)."""

    name = "EinsumDense"
    lora = True

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        vs = [layer._kernel, layer.bias]
        if lora_enabled(layer):
            vs += [layer.lora_kernel_a, layer.lora_kernel_b]
        return [v for v in vs if v is not None]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        x = tf.convert_to_tensor(inputs)
        lora = lora_enabled(layer)
        eqs = _lora_equations(layer.equation) if lora else None
        if lora and eqs is None:
            z = ops.einsum(layer.equation, x, layer.kernel)   # Keras's merged kernel
        elif lora:
            z = ops.einsum(layer.equation, x, layer._kernel)
            u = ops.einsum(eqs[0], x, ops.cast(layer.lora_kernel_a, x.dtype))
            call_u = rec.new_call(layer, u)
            su = ops.multiply(u, ops.cast(layer.lora_alpha / layer.lora_rank, u.dtype))
            z = ops.add(z, ops.einsum(eqs[1], su, ops.cast(layer.lora_kernel_b, x.dtype)))
        else:
            z = ops.einsum(layer.equation, x, layer.kernel)
        if layer.bias is not None:
            z = ops.add(z, layer.bias)
        call = rec.new_call(layer, z)
        if call is not None:
            _einsum_contribution(rec, layer._kernel, call, x, layer.equation)
            if lora and eqs is None:
                for v in (layer.lora_kernel_a, layer.lora_kernel_b):
                    rec.mark_bad(v, f"LoRA on einsum equation {layer.equation!r}")
            elif lora:
                _einsum_contribution(rec, layer.lora_kernel_a, call_u, x, eqs[0])
                _einsum_contribution(rec, layer.lora_kernel_b, call, su, eqs[1])
            if layer.bias is not None:
                shape = tuple(int(s) for s in layer.bias.shape)
                if z.shape.rank - len(shape) < 1:
                    rec.mark_bad(layer.bias, "bias spans the batch axis")
                else:
                    rec.add(PerExample(layer.bias, call,
                                        lambda g, s=shape: reduce_to_shape(g, s)))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer.bias:
            return "instantiate"
        inp = layer.equation.replace(" ", "").split(",")[0]
        rank = len(inp) - 1 if "..." in inp else len(inp)  # "..." -> batch + seq
        shape = inbound_shape(layer)
        rank = len(shape) if shape is not None else rank
        p = _einsum_parts(layer.equation, rank)
        if p is None:
            return "exact"
        # Letter sizes: the kernel's, and the input's where static.
        sizes = dict(zip(p["ker"], (int(s) for s in layer._kernel.shape)))
        if shape is not None:
            sizes.update({c: static_dim(d) for c, d in zip(p["inp"], shape) if c not in sizes})
        equation, in_letters = layer.equation, p["inp"]
        if var is not layer._kernel:   # a LoRA factor
            eqs = _lora_equations(layer.equation)
            if eqs is None:
                return "exact"
            r = eqs[0].split(",")[1].split("->")[0][-1]
            sizes[r] = int(layer.lora_rank)
            if var is layer.lora_kernel_a:
                equation = eqs[0]
            else:
                equation = eqs[1]
                in_letters = p["out"].replace(p["ker"][-1], r)
        q = _einsum_parts(equation, len(in_letters))
        if q is None:
            return "exact"
        size = dict(zip(q["ker"], (int(s) for s in var.shape)))
        H = product_of([size[c] for c in q["shared"]])
        m = product_of([size[c] for c in q["ins"]])
        n = product_of([size[c] for c in q["outs"]])
        seq = product_of([value_or(sizes.get(c), T) for c in q["seq"]]) if q["seq"] else 1
        return static_linear(H, m, n, seq, B)
