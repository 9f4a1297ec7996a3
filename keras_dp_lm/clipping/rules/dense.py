"""Fast-clipping rule for ``keras.layers.Dense``."""

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
