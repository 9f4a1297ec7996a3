"""Weights that received DP updates are not trained without clipping and noise:
not by compile(optimizer="sgd") after a DP fit, a plain optimizer assigned, another
model holding them, a train function or train_step called by hand, nor weights
loaded from a DP file. ``allow_non_private_fit`` (public data) permits it, for the
DP updates the weights had when it was given.
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


def _refused_until_permitted(model, x, y, match):
    """``fit`` and ``train_on_batch`` refuse (``match``) and leave the weights as
    they were; after ``allow_non_private_fit`` (the data is public), ``fit`` trains."""
    weights = _weights(model)
    with pytest.raises(RuntimeError, match=match):
        model.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(RuntimeError, match=match):
        model.train_on_batch(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))
    kdp.training.allow_non_private_fit(model)
    model.fit(x, y, batch_size=8, verbose=0)
    assert not all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))


def test_a_non_private_compile_after_dp_updates_refuses_to_train(tmp_path):
    """Before: after DP updates, compile(optimizer="sgd") (or KerasHub's
    compile(sampler=...), which builds a new Adam) trained with no clipping or
    noise, and a later DP fit reported a finite epsilon (4.02; true: infinite).
    With that check at compile time, DP weights (and their ledger) loaded after
    the compile still trained without privacy: the check now runs when training
    starts."""
    x, y = _data(8)
    model = _dense(noise_multiplier=1.0)
    model.fit(x, y, batch_size=8, verbose=0)
    model.save_weights(tmp_path / "dp.weights.h5")
    model.compile(optimizer="sgd", loss=SCCE)
    _refused_until_permitted(model, x, y, "holds 1 DP updates.*allow_non_private_fit")
    assert kdp.ledger_of(model).updates == 1
    model.compile(optimizer="sgd", loss=SCCE)  # the permission lasts one compile
    with pytest.raises(RuntimeError, match="refused to train"):
        model.fit(x, y, batch_size=8, verbose=0)
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)
    model.fit(x, y, batch_size=8, verbose=0)
    assert kdp.ledger_of(model).updates == 2
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    fresh.compile(optimizer="sgd", loss=SCCE)  # no DP updates: Keras as usual
    fresh.fit(x, y, batch_size=8, verbose=0)
    fresh.load_weights(tmp_path / "dp.weights.h5")  # now it has DP updates
    with pytest.raises(RuntimeError, match="holds 1 DP updates"):
        fresh.fit(x, y, batch_size=8, verbose=0)



def test_a_plain_optimizer_assigned_to_a_dp_model_is_refused_with_a_clear_error():
    """Before: assigning a non-DP optimizer after compile failed closed with
    "AttributeError: 'SGD' object has no attribute 'freeze_privacy_parameters'"."""
    x, y = _data(8)
    model = _dense(noise_multiplier=1.0)
    model.optimizer = keras.optimizers.SGD()
    with pytest.raises(RuntimeError, match="Assigning model.optimizer does not recompile"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert kdp.ledger_of(model).updates == 0


def test_dp_trained_weights_are_not_trained_unnoised_through_another_model(tmp_path):
    """Before: a model compiled without DP and fitted once, then assigned a DP
    optimizer without compile, trained with Keras's traced plain step (weights
    moved 0.041, epsilon logged 0.0). A model wrapping or sharing a DP
    model's layers, compiled without DP, trained them unnoised (a later DP fit
    reported 5.46; true: infinite)."""
    x, y = _data(8)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    plain.compile(optimizer="sgd", loss=SCCE)
    plain.fit(x, y, batch_size=8, verbose=0)
    plain.optimizer = kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0)
    weights = _weights(plain)
    # A model compiled without DP runs Keras's own code (issue 39): its fit is
    # plain training and its ledger says so (0 updates); what would report an
    # epsilon for it, an accountant, refuses before any update.
    accountant = kdp.PrivacyAccountant(dataset_size=8, batch_size=8, delta=1e-3,
                                       verbose=0)
    with pytest.raises(RuntimeError, match="Assigning model.optimizer does not recompile"):
        plain.fit(x, y, batch_size=8, verbose=0, callbacks=[accountant])
    assert all(np.array_equal(a, b) for a, b in zip(weights, _weights(plain)))
    assert kdp.ledger_of(plain).updates == 0

    dp_model = _dense(noise_multiplier=1.0)
    dp_model.fit(x, y, batch_size=8, verbose=0)
    weights = _weights(dp_model)
    wrapper = keras.Sequential([dp_model])
    wrapper.compile(optimizer="sgd", loss=SCCE)
    with pytest.raises(RuntimeError, match="contains the model"):
        wrapper.fit(x, y, batch_size=8, verbose=0)
    sharing = keras.Model(dp_model.inputs, dp_model.outputs)
    sharing.compile(optimizer="sgd", loss=SCCE)
    with pytest.raises(RuntimeError, match="hold weights from DP training"):
        sharing.fit(x, y, batch_size=8, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(weights, _weights(dp_model)))
    kdp.training.allow_non_private_fit(sharing)  # public data: allowed when said
    sharing.fit(x, y, batch_size=8, verbose=0)
    assert kdp.ledger_of(dp_model).updates == 1
    # The same patterns on DP weights loaded from a file (the marks
    # come with the ledger), and on weights trained only through make_private
    path = tmp_path / "dp.keras"
    dp_model.save(path)
    loaded = keras.models.load_model(path)
    new_head = keras.Model(loaded.inputs, keras.layers.Dense(2)(loaded.outputs[0]))
    new_head.compile(optimizer="adam", loss=SCCE)
    with pytest.raises(RuntimeError, match="hold weights from DP training"):
        new_head.fit(x, y % 2, batch_size=8, verbose=0)
    custom = _dense(seed=3, noise_multiplier=1.0)
    kdp.make_private(custom)((x, y))
    reuse = keras.Sequential(custom.layers)
    reuse.compile(optimizer="sgd", loss=SCCE)
    with pytest.raises(RuntimeError, match="hold weights from DP training"):
        reuse.fit(x, y, batch_size=8, verbose=0)


def test_train_functions_and_train_step_called_by_hand_are_checked():
    """Before: the guards ran in fit and train_on_batch only. A train function
    made (or traced by a plain fit) before DP updates arrived, or Keras's
    train_step called in a custom loop, trained DP-trained weights with a
    plain optimizer, unclipped and unnoised."""
    x, y = _data(8)
    dp_model = _dense(noise_multiplier=1.0)
    sharing = keras.Model(dp_model.inputs, dp_model.outputs)
    sharing.compile(optimizer="sgd", loss=SCCE)
    sharing.fit(x, y, batch_size=8, verbose=0)  # traced before any DP update
    dp_model.fit(x, y, batch_size=8, verbose=0)
    weights = _weights(dp_model)
    batch = (tf.constant(x), tf.constant(y))
    with pytest.raises(RuntimeError, match="refused to train"):
        sharing.train_function(iter([batch]))
    dp_model.compile(optimizer="sgd", loss=SCCE)
    dp_model.make_train_function()
    with pytest.raises(RuntimeError, match="holds 1 DP updates"):
        dp_model.train_function(iter([batch]))
    with pytest.raises(RuntimeError, match="holds 1 DP updates"):
        dp_model.train_step(batch)  # a custom loop's step
    assert all(np.array_equal(a, b) for a, b in zip(weights, _weights(dp_model)))
    kdp.training.allow_non_private_fit(dp_model)  # public data: allowed when said
    dp_model.train_step(batch)
    assert not all(np.array_equal(a, b) for a, b in zip(weights, _weights(dp_model)))
    fresh = _dense(seed=1)
    fresh.compile(optimizer="sgd", loss=SCCE)
    fresh.make_train_function()
    fresh.train_function(iter([batch]))  # no DP weights: Keras as usual
    fresh.train_step(batch)


def test_the_permission_ends_when_dp_weights_arrive(tmp_path):
    """Before: allow_non_private_fit(model) outlived a later load_weights of
    another DP file into the same model, whose private weights then trained
    unnoised. The permission covers the DP updates the weights had when it was
    given: other DP weights loaded, or DP updates through a model sharing the
    variables, end it; the model's own checkpoint reloaded (BackupAndRestore)
    does not (a resumed public fine-tuning was refused when it did)."""
    x, y = _data(8)
    other = _dense(seed=1, noise_multiplier=1.0)
    other.fit(x, y, batch_size=4, verbose=0)  # 2 DP updates: another DP file
    other.save_weights(tmp_path / "other.weights.h5")
    model = _dense(noise_multiplier=1.0)
    model.fit(x, y, batch_size=8, verbose=0)
    model.compile(optimizer="sgd", loss=SCCE)
    kdp.training.allow_non_private_fit(model)
    model.fit(x, y, batch_size=8, verbose=0)  # public data, as said
    model.save_weights(tmp_path / "own.weights.h5")
    model.load_weights(tmp_path / "own.weights.h5")  # its own checkpoint: still allowed
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    model.load_weights(tmp_path / "other.weights.h5")
    _refused_until_permitted(model, x, y, "have received others since")
    # DP updates through a model sharing the variables, its step already traced
    dp_model = _dense(seed=2, noise_multiplier=1.0)
    dp_model.fit(x, y, batch_size=8, verbose=0)
    public = keras.Model(dp_model.inputs, dp_model.outputs)
    public.compile(optimizer="sgd", loss=SCCE)
    kdp.training.allow_non_private_fit(public)
    public.fit(x, y, batch_size=8, verbose=0)
    dp_model.fit(x, y, batch_size=8, verbose=0)  # no new trace: same train function
    with pytest.raises(RuntimeError, match="have received others since"):
        public.fit(x, y, batch_size=8, verbose=0)
    # A model with no ledger yet, on DP weights: creating its ledger
    # (saving, a checkpoint, reading it) is not new DP weights arriving
    head = keras.Model(dp_model.inputs, keras.layers.Dense(2)(dp_model.outputs[0]))
    head.compile(optimizer="sgd", loss=SCCE)
    kdp.training.allow_non_private_fit(head)
    assert head.dp_ledger.updates == 2  # the updates its base received
    head.fit(x, y % 2, batch_size=8, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "head.keras"))])
