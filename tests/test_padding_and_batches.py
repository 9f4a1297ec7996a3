"""Padding slots are inert, and the batches a DP fit really gets are checked
against what is accounted for them.

Each test failed on the code before its fix: the docstrings say what happened then.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp
from keras_dp_lm import data as sampling
from keras_dp_lm.callbacks import PrivacyAccountant
from keras_dp_lm.accounting import compute_epsilon
from keras_dp_lm.testing import tiny_gpt2_causal_lm
from privacy_helpers import SCCE
from privacy_helpers import dense_model as _dense
from privacy_helpers import random_data as _data
from privacy_helpers import trainable_weights as _weights


# -- padding is inert whatever preprocessing does ------------------------------
def test_padding_of_raw_string_batches_survives_keras_hub_preprocessing():
    """Before: GPT2CausalLMPreprocessor replaced sample_weight with its padding
    mask, so copies padding a Poisson batch of raw strings trained at full weight
    and an empty batch moved the weights."""
    texts = np.array(["to be or not to be", "that is the question"])

    def one_step(strings, real):
        lm = tiny_gpt2_causal_lm(sequence_length=8, num_layers=1, seed=1)
        lm.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0,
                                       expected_batch_size=2.0), sampler="greedy")
        marked = sampling.attach_real_slots(None, np.asarray(real, "float32"), 0.5)
        lm.fit(tf.data.Dataset.from_tensors((strings, None, marked)), verbose=0)
        return _weights(lm)

    start = _weights(tiny_gpt2_causal_lm(sequence_length=8, num_layers=1, seed=1))
    real_only = one_step(texts[:1], [1.0])
    padded = one_step(np.array([texts[0], texts[1], texts[1]]), [1.0, 0.0, 0.0])
    for a, b in zip(padded, real_only):
        np.testing.assert_allclose(a, b, atol=1e-6)
    empty = one_step(np.array([texts[1], texts[1]]), [0.0, 0.0])
    for a, b in zip(empty, start):
        np.testing.assert_array_equal(a, b)


def test_padding_is_inert_even_when_the_loss_ignores_sample_weight():
    class IgnoresWeights(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

        def compute_per_example_loss(self, x, y, y_pred, sample_weight):
            return keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)

    x, y = _data(6)
    results = []
    for rows, real in ((slice(0, 3), [1.0, 1.0, 1.0]), (slice(0, 6), [1.0] * 3 + [0.0] * 3)):
        keras.utils.set_random_seed(4)
        model = IgnoresWeights()
        model(x[:1])
        model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0,
                                          expected_batch_size=3.0))
        marked = sampling.attach_real_slots(None, np.asarray(real, "float32"))
        model.fit(tf.data.Dataset.from_tensors((x[rows], y[rows], marked)), verbose=0)
        results.append(_weights(model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-6)


# -- real batches are checked against what is accounted ------------------------
def test_poisson_batches_at_a_higher_rate_than_accounted_are_refused():
    """Before: batches drawn at q=0.5 were accounted at the accountant's q=0.125
    (reported 1.57, spent 5.46)."""
    x, y = _data(32)
    ds = sampling.poisson_batches((x, y), 0.5, 32, seed=0, num_steps=4)
    model = _dense(noise_multiplier=1.0, expected_batch_size=16.0)
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=32, batch_size=4,
                                   sampling="poisson", accountant="rdp")
    before = _weights(model)
    with pytest.raises(kdp.PrivacyRefusalError, match="refused a batch"):
        model.fit(ds, callbacks=[accountant], verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
    assert kdp.ledger_of(model).updates == 0


def test_the_sampler_hands_its_rate_to_the_accountant():
    x, y = _data(32)
    ds = sampling.poisson_batches((x, y), 0.25, 24, seed=0, num_steps=4)
    model = _dense(noise_multiplier=1.0, expected_batch_size=8.0)
    accountant = PrivacyAccountant(delta=1e-3, batches=ds, accountant="rdp")
    model.fit(ds, callbacks=[accountant], verbose=0)
    assert accountant.sampling_rate == 0.25
    assert accountant.epsilon == compute_epsilon(1.0, 0.25, 4, 1e-3, "rdp")


def test_every_batch_of_an_execution_is_checked():
    """Before: with steps_per_execution > 1 only the last batch of each
    execution was checked (reported 0.67, spent 2.61)."""
    x, y = _data(12)
    sizes = [4, 8, 4]  # the large batch sits in the middle of an execution of 3
    ds = tf.data.Dataset.from_generator(
        lambda: ((x[:n], y[:n]) for n in sizes),
        output_signature=(tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.int64)))
    model = _dense(noise_multiplier=1.0)
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE, steps_per_execution=3)
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=12, batch_size=4, accountant="rdp")
    with pytest.raises(kdp.PrivacyRefusalError, match="refused a batch"):
        model.fit(ds, callbacks=[accountant], verbose=0)
    assert kdp.ledger_of(model).updates <= 1


def test_padded_batches_need_an_expected_batch_size():
    x, y = _data(32)
    ds = sampling.poisson_batches((x, y), 0.25, 24, seed=0, num_steps=2)
    model = _dense(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        model.fit(ds, verbose=0)


# -- padding that depends on the drawn records ---------------------------------
def test_poisson_preprocessor_padding_to_the_longest_record_is_refused():
    """Before: a preprocessor padding to the longest drawn record let one record
    (then record 0, repeated in padding slots) change every example's normalisation."""
    from keras_dp_lm import data as sampling

    records = [("x " * (1 + i % 7)).strip() for i in range(200)]

    def pad_to_longest(text):
        words = tf.strings.split(text).to_tensor("")
        return tf.cast(tf.strings.length(words), tf.float32), tf.zeros(tf.shape(text)[:1])

    with pytest.raises(ValueError, match="fixed length"):
        sampling.poisson_batches(records, 0.1, 60, seed=0, num_steps=2,
                                 preprocessor=pad_to_longest)
