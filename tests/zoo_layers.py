"""Layers the privacy tests build models from: each one broke fast clipping once."""

import keras


class WeightNormDense(keras.layers.Dense):
    """Reparametrised kernel: the rule for Dense does not describe it."""

    @property
    def kernel(self):
        return 3.0 * self._kernel / keras.ops.norm(self._kernel)


class DenseCell(keras.layers.Layer):
    """An RNN cell whose Dense runs inside the RNN's while-loop body."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units
        self.dense = keras.layers.Dense(units, activation="tanh")

    def build(self, shape):
        self.dense.build((shape[0], shape[-1] + self.units))

    def call(self, inputs, states):
        h = self.dense(keras.ops.concatenate([inputs, states[0]], axis=-1))
        return h, [h]
