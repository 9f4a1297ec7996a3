"""Small models, data and layers shared by the privacy test files (padding,
per-example losses, mixing, the independence probe, the ledger, non-private fits...).

The test files import them under short private names (``dense_model as _dense``).
"""

import keras
import numpy as np
import tensorflow as tf

import keras_dp_lm as kdp

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_model(seed=0, **optimizer_kwargs):
    """A 4 -> 3 Dense model compiled with DPSGD (clip norm 1, no noise unless
    ``noise_multiplier`` is given) and a from-logits sparse cross-entropy."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    kwargs = dict(l2_norm_clip=1.0, noise_multiplier=0.0)
    kwargs.update(optimizer_kwargs)
    model.compile(optimizer=kdp.DPSGD(1.0, **kwargs), loss=SCCE)
    return model


def trainable_weights(model):
    """Copies of the model's trainable variables, to compare before and after."""
    return [w.numpy().copy() for w in model.trainable_variables]


def random_data(n=16, seed=0):
    """``n`` examples of 4 normal float32 features, with integer labels in 0..2."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n)


class UnseededNoise(keras.layers.Layer):
    """Training only: noise from ``tf.random`` (no Keras seed generator)."""

    def call(self, x, training=False):
        return x + 1e-3 * tf.random.normal(tf.shape(x)) if training else x
