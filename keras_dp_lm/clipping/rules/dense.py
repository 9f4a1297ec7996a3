"""Fast-clipping rule for ``keras.layers.Dense``, LoRA adapters included."""

import keras
import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import batch_and_length
from keras_dp_lm.clipping._common import inbound_shape
from keras_dp_lm.clipping._common import lora_enabled
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import reduce_to_shape
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping.contributions import Linear
from keras_dp_lm.clipping.contributions import PerExample
from keras_dp_lm.clipping.ghost import static_linear
from keras_dp_lm.clipping.registry import register_clipping_rule


def _matmul_contribution(var, call, x):
    """The contribution of ``var`` [din, dout] used as ``z = x @ var`` (``call`` watches z)."""
    din, dout = (int(s) for s in var.shape)
    T = product_of([static_dim(s) for s in x.shape[1:-1]])

    def factors(g, x=x):
        B, L = batch_and_length(x, T)
        return (tf.reshape(x, [B, 1, L, din]),
                tf.reshape(tf.cast(g, x.dtype), [B, 1, L, dout]))

    def to_var(mat, batched):
        return tf.reshape(mat, ([-1] if batched else []) + [din, dout])

    return Linear(var, call, factors, to_var, (1, din, T, dout),
                   layout=("dense", din, dout), keys=(("dense-x", x.ref(), T, din), None))


def _lora_scale(layer):
    return layer.lora_alpha / layer.lora_rank


@register_clipping_rule(keras.layers.Dense)
class _DenseRule:
    """``z = x @ W + b``; with LoRA ``z = x @ W + s (x @ A) @ B + b``.

    Keras computes the LoRA output through the merged kernel
    ``W + s A B``; the recording pass computes the same function factored
    (``u = x @ A`` is watched, so ``A``'s per-example gradient is
    ``x^T du`` and ``B``'s is ``(s u)^T dz``): two thin linear contributions,
    and nothing at all for the frozen ``W``.
    """

    name = "Dense"
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
        if lora_enabled(layer):
            z = ops.matmul(x, layer._kernel)
            u = ops.matmul(x, ops.cast(layer.lora_kernel_a, x.dtype))
            call_u = rec.new_call(layer, u)
            su = ops.multiply(u, ops.cast(_lora_scale(layer), u.dtype))
            z = ops.add(z, ops.matmul(su, ops.cast(layer.lora_kernel_b, x.dtype)))
        else:
            z = ops.matmul(x, layer.kernel)
        if layer.bias is not None:
            z = ops.add(z, layer.bias)
        call = rec.new_call(layer, z)
        if call is not None:
            rec.add(_matmul_contribution(layer._kernel, call, x))
            if lora_enabled(layer):
                rec.add(_matmul_contribution(layer.lora_kernel_a, call_u, x))
                rec.add(_matmul_contribution(layer.lora_kernel_b, call, su))
            if layer.bias is not None:
                shape = tuple(int(s) for s in layer.bias.shape)
                rec.add(PerExample(layer.bias, call,
                                    lambda g, s=shape: reduce_to_shape(g, s)))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer.bias:
            return "instantiate"
        din, dout = (int(s) for s in var.shape)
        shape = inbound_shape(layer)
        if shape is not None:
            dims = [static_dim(s) for s in shape[1:-1]]
            T = 1 if not dims else (product_of(dims) or T)
        return static_linear(1, din, dout, T, B)
