"""Fast-clipping rule for ``keras.layers.EinsumDense`` (and so MultiHeadAttention)."""

import string

import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import _inbound_shape
from keras_dp_lm.clipping._common import _or
from keras_dp_lm.clipping._common import _prod
from keras_dp_lm.clipping._common import _reduce_to_shape
from keras_dp_lm.clipping._common import _static
from keras_dp_lm.clipping.ghost import _Linear
from keras_dp_lm.clipping.ghost import _PerExample
from keras_dp_lm.clipping.ghost import _static_linear


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
