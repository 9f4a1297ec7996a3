"""Per-example losses must be per example, and no state may carry an example
into other examples' losses or into the model's variables.

Each test failed on the code before its fix: the docstrings say what happened then.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp
from privacy_helpers import SCCE
from privacy_helpers import dense_model as _dense
from privacy_helpers import random_data as _data
from privacy_helpers import trainable_weights as _weights


# -- per-example losses must be per example ------------------------------------
def test_batch_reduced_loss_function_is_refused_before_any_update():
    """Before: a loss returning reduce_mean over the batch, with sample weights,
    gave neighbouring batches that differ by 7x C."""
    def batch_mean_loss(y_true, y_pred):
        return tf.reduce_mean(SCCE(y_true, y_pred))

    model = _dense()
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0),
                  loss=batch_mean_loss)
    before = _weights(model)
    x, y = _data(8)
    with pytest.raises(ValueError, match="reduces over the batch"):
        model.fit(x, y, sample_weight=np.ones(8), batch_size=8, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))


def test_custom_per_example_loss_of_wrong_shape_is_refused():
    class Summed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

        def compute_per_example_loss(self, x, y, y_pred, sample_weight):
            return tf.reduce_sum(y_pred, axis=0)  # [3], not [B]

    model = Summed()
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0))
    x, y = _data(8)
    with pytest.raises(ValueError, match="not the batch axis"):
        model.fit(x, y, batch_size=8, verbose=0)



def test_loss_normalised_by_a_dynamic_padded_length_is_refused():
    """sum_over_batch_size over [B, T] with T known only per batch divides each
    example's loss by the longest example's length: refused before any update."""
    import keras

    import keras_dp_lm as kdp

    inputs = keras.Input((None,), dtype="int32")
    outputs = keras.layers.Dense(3)(keras.layers.Embedding(10, 4)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ragged = tf.ragged.constant([[1, 2], [3, 4, 5, 6], [7]] * 4)
    ds = tf.data.Dataset.from_tensor_slices((ragged, ragged % 3)).map(
        lambda x, y: (x, y)).padded_batch(4)
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match="padded length"):
        model.fit(ds, epochs=1, verbose=0)
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(before, model.weights))



class _WeightsNormalisedOverTheBatch(keras.Model):
    """Each example's loss times its sample weight over the batch's mean weight."""

    def compute_per_example_loss(self, x, y, y_pred, sample_weight):
        per = keras.ops.mean(keras.ops.square(y - y_pred), axis=-1)
        if sample_weight is None:
            return per
        w = keras.ops.reshape(keras.ops.cast(sample_weight, per.dtype), (-1,))
        return per * w / keras.ops.mean(w)


def test_sample_weights_normalised_over_the_batch_are_refused_when_rows_0_and_1_agree():
    """Before: the probe replaced row 0 by row 1 with its weight; with
    equal weights in rows 0 and 1 the batch mean did not move and it trained
    (one example with weight 1e6 moved the sum by 4.4 C). Each compared row is
    now also evaluated in a batch of its own copies."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = _WeightsNormalisedOverTheBatch(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(3).normal(size=(8, 4)).astype("float32")
    y = np.ones((8, 2), "float32")
    weights = np.ones(8, "float32")
    weights[5] = 3.0  # rows 0 and 1 share their weight
    with pytest.raises(ValueError, match="mixes examples"):
        model.fit(x, y, sample_weight=weights, batch_size=8, verbose=0)
    assert kdp.ledger_of(model).updates == 0


# -- state that crosses examples -----------------------------------------------
def test_stateful_rnn_is_refused():
    """Before: stateful=True trained silently and leaked through its state (2.1x C)."""
    model = keras.Sequential([keras.Input((5, 2), batch_size=4),
                              keras.layers.SimpleRNN(3, stateful=True), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="stateful=True"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)


@pytest.mark.parametrize("layer", [keras.layers.MixUp, keras.layers.CutMix])
def test_layers_that_mix_examples_are_refused(layer):
    model = keras.Sequential([keras.Input((8, 8, 3)), layer(), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="mixes examples"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)


def test_normalization_over_the_batch_axis_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.UnitNormalization(axis=0),
                              keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="batch axis"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)


class _RunningMean(keras.layers.Layer):
    """Writes a non-trainable running statistic of the batch in training."""

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False)

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
        return x - self.mean


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_layers_writing_non_trainable_state_are_refused_before_any_update(run_eagerly):
    model = keras.Sequential([keras.Input((4,)), _RunningMean(), keras.layers.Dense(3)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.0),
                  loss=SCCE, run_eagerly=run_eagerly)
    before = _weights(model)
    x, y = _data(8)
    with pytest.raises(ValueError, match="writes model variables"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
    assert kdp.ledger_of(model).updates == 0


def test_dropout_seed_state_is_not_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5),
                              keras.layers.Dense(3)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)
    x, y = _data(8)
    model.fit(x, y, batch_size=8, verbose=0)
    assert kdp.ledger_of(model).updates == 1



class _Memorizer(keras.layers.Layer):
    """Copies the batch's first example into a variable in its forward pass."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def build(self, shape):
        self.mem = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                   trainable=self.how == "trainable")

    def call(self, x, training=None):
        row = tf.cast(x[0], self.mem.dtype)
        if self.how == "inference" and training:
            return x  # writes only in inference mode: only the probe's passes write
        if self.how == "cond":
            tf.cond(tf.reduce_sum(row) > -1e30, lambda: self.mem.assign(row),
                    lambda: self.mem.assign(row))
        elif self.how == "scatter":
            self.mem.value.scatter_nd_update([[0]], row[:1])
        else:
            self.mem.assign(row)
        return x


@pytest.mark.parametrize("how,clipping", [("assign", "exact"), ("cond", "auto"),
                                          ("cond", "exact"), ("scatter", "auto"),
                                          ("trainable", "auto")])
def test_forward_writes_to_variables_are_refused_wherever_they_hide(how, clipping):
    """Before: plain assigns under clipping='exact' (inside its per-example
    while loop), writes inside tf.cond, scatter updates and assigns to trainable
    variables ran, and the variable ended bit-equal to a training example."""
    model = keras.Sequential([keras.Input((4,)), _Memorizer(how), keras.layers.Dense(3)])
    model.compile(optimizer=kdp.DPSGD(0.0, l2_norm_clip=1.0, noise_multiplier=0.0,
                                      clipping=clipping), loss="mse")
    x = np.random.default_rng(3).normal(size=(4, 4)).astype("float32")
    with pytest.raises(ValueError, match="writes model variables"):
        model.fit(x, np.zeros((4, 3), "float32"), batch_size=4, verbose=0)
    assert not np.any(model.layers[0].mem.numpy())


@pytest.mark.parametrize("path", ["fit", "custom_loop", "run_eagerly"])
def test_the_probes_own_passes_may_not_write_variables(path):
    """Before: a layer writing a variable only in inference mode (so only
    the independence probe's passes run it) kept a training example in the model
    on the paths that probe inside the step (custom loops, run_eagerly)."""
    model = keras.Sequential([keras.Input((4,)), _Memorizer("inference"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.0),
                  loss="mse", run_eagerly=path == "run_eagerly")
    x = np.random.default_rng(3).normal(size=(4, 4)).astype("float32")
    y = np.zeros((4, 3), "float32")
    with pytest.raises(ValueError, match="writes model variables"):
        if path == "custom_loop":
            kdp.make_private(model)((x, y))
        else:
            model.fit(x, y, batch_size=4, verbose=0)
    assert not np.any(model.layers[0].mem.numpy())
    assert kdp.ledger_of(model).updates == 0
