"""Fast-clipping rule for ``keras.layers.Conv1D`` and ``keras.layers.Conv2D``."""

import itertools

import keras
import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import batch_and_length
from keras_dp_lm.clipping._common import inbound_shape
from keras_dp_lm.clipping._common import value_or
from keras_dp_lm.clipping._common import original_call
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import reduce_to_shape
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping.contributions import Linear
from keras_dp_lm.clipping.contributions import PerExample
from keras_dp_lm.clipping.ghost import static_linear
from keras_dp_lm.clipping.registry import register_clipping_rule


def _dim(x, axis):
    """``x.shape[axis]`` as an int when static, else a scalar tensor."""
    return value_or(static_dim(x.shape[axis]), tf.shape(x)[axis])


def _same_pads(size, out, k, s, d):
    """TensorFlow's "same" padding of one spatial axis: ``[before, after]``."""
    total = (out - 1) * s + (k - 1) * d + 1 - size
    total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
    return [total // 2, total - total // 2]


def _patches(layer, x, z, padding):
    """im2col of the channels_last input ``x`` [B, *S, cin] for output ``z``:
    ``[B, *out, prod(kernel_size), cin]``, entry ``[p, k, c]`` being the input
    value the kernel tap ``k`` reads for output position ``p`` (zero where it
    reads padding), so ``z[p] = sum_{k,c} P[p, k, c] W[k, c]`` and ``W``'s
    per-example gradient is ``P^T dz`` over the output positions."""
    r = layer.rank
    outs = [_dim(z, 1 + i) for i in range(r)]
    if padding == "same":
        pads = [_same_pads(_dim(x, 1 + i), outs[i], layer.kernel_size[i],
                           layer.strides[i], layer.dilation_rate[i]) for i in range(r)]
        x = tf.pad(x, [[0, 0]] + pads + [[0, 0]])
    taps = []
    for offsets in itertools.product(*(range(k) for k in layer.kernel_size)):
        index = [slice(None)]
        for o, s, d, n in zip(offsets, layer.strides, layer.dilation_rate, outs):
            index.append(slice(o * d, o * d + (n - 1) * s + 1, s))
        taps.append(x[tuple(index)])
    return tf.stack(taps, axis=-2)


def _conv_contribution(layer, call, x, z, padding):
    """The kernel ``[*k, cin, cout]`` as a linear map of the unfolded input."""
    kshape = [int(s) for s in layer._kernel.shape]
    m, n = product_of(kshape[:-1]), kshape[-1]
    T = product_of([static_dim(s) for s in z.shape[1:-1]])
    key = ("conv-x", x.ref(), tuple(layer.kernel_size), tuple(layer.strides),
           tuple(layer.dilation_rate), padding, T, m)

    def factors(g, x=x, z=z):
        P = _patches(layer, x, z, padding)
        B, L = batch_and_length(P, T)
        return (tf.reshape(P, [B, 1, L, m]),
                tf.reshape(tf.cast(g, x.dtype), [B, 1, L, n]))

    def to_var(mat, batched):
        return tf.reshape(mat, ([-1] if batched else []) + kshape)

    return Linear(layer._kernel, call, factors, to_var, (1, m, T, n),
                   layout=("conv", layer.rank, tuple(kshape)), keys=(key, None))


@register_clipping_rule(keras.layers.Conv2D)
@register_clipping_rule(keras.layers.Conv1D)
class _ConvRule:
    """``z = conv(x, W) + b`` (channels_last, ``groups=1``; padding "valid",
    "same" or Conv1D's "causal"; strides and dilation).

    ``W``'s per-example gradient is ``P^T dz`` with ``P`` the input unfolded
    into one row of ``prod(kernel_size) * cin`` values per output position
    (im2col, taps in the kernel's own order), a linear contribution as for
    Dense with the output positions as the sequence. Grouped or
    channels_first convolutions fall back to exact per-example gradients.
    """

    name = "Conv"

    @staticmethod
    def matches(layer):
        return layer.rank in (1, 2)

    @staticmethod
    def variables(layer):
        return [v for v in (layer._kernel, layer.bias) if v is not None]

    @staticmethod
    def _unsupported(layer, rank=None):
        if layer.data_format != "channels_last":
            return f"{type(layer).__name__} with data_format={layer.data_format!r}"
        if layer.groups != 1:
            return f"grouped {type(layer).__name__} (groups={layer.groups})"
        if layer.padding not in ("valid", "same", "causal"):
            return f"{type(layer).__name__} with padding={layer.padding!r}"
        if rank is not None and rank != layer.rank + 2:
            return f"{type(layer).__name__} input of rank {rank}"
        return None

    @staticmethod
    def forward(layer, rec, inputs):
        x = tf.convert_to_tensor(inputs)
        reason = _ConvRule._unsupported(layer, x.shape.rank)
        if reason is not None:
            rec.mark_layer_bad(layer, _ConvRule, reason)
            return original_call(layer)(inputs)
        padding = layer.padding
        if padding == "causal":   # Conv1D: left-pad, then a "valid" convolution
            left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
            x = ops.pad(x, [[0, 0], [left, 0], [0, 0]])
            padding = "valid"
        z = ops.conv(x, layer.kernel, strides=list(layer.strides), padding=padding,
                     dilation_rate=layer.dilation_rate, data_format=layer.data_format)
        if layer.use_bias:
            z = ops.add(z, ops.reshape(layer.bias, (1,) * (layer.rank + 1) + (layer.filters,)))
        call = rec.new_call(layer, z)
        if call is not None:
            rec.add(_conv_contribution(layer, call, tf.convert_to_tensor(x), z, padding))
            if layer.use_bias:
                rec.add(PerExample(layer.bias, call,
                                    lambda g, s=(layer.filters,): reduce_to_shape(g, s)))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        shape = inbound_shape(layer)
        if _ConvRule._unsupported(layer, len(shape) if shape is not None else None):
            return "exact"
        if var is layer.bias:
            return "instantiate"
        kshape = [int(s) for s in var.shape]
        if shape is not None:
            try:
                out = layer.compute_output_shape(shape)
                T = product_of([static_dim(s) for s in out[1:-1]]) or T
            except (ValueError, TypeError):
                pass
        return static_linear(1, product_of(kshape[:-1]), kshape[-1], T, B)
