"""Ledger workflows an audit found under-counting (issue 39): partial loads
(``load_weights(skip_mismatch=True)``) and Keras's legacy ``.h5`` format.

Each test reproduces the audit's workflow; the reported epsilon is compared
with dp_accounting called directly on every update the final weights received.
"""

import os

import dp_accounting
import keras
from dp_accounting.pld import privacy_loss_distribution as pld_lib
import numpy as np
import pytest

import keras_dp_lm as kdp
from keras_dp_lm.accounting.epsilon import ledger_epsilon

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, DELTA = 8, 1e-5


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, N)


def _dp_compile(model):
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)


_ONE_UPDATE = {}  # batch size -> the PLD of one update, as PLDAccountant builds it


def _true_epsilon(batches):
    """dp_accounting on one fixed-size update per entry of ``batches`` (its real
    batch size), each accounted as sampled at ``batch / N`` (how the ledger
    prices fixed-size batches): the composition of everything applied.

    PLDAccountant's own arithmetic, step by step (identity at its default
    discretization, then one composition per update), with each batch size's
    one-update PLD built once: the same value to the last bit (the accountant
    rebuilt it for every update, ~1 s each)."""
    pld = pld_lib.identity(value_discretization_interval=1e-4)
    for batch in batches:
        if batch not in _ONE_UPDATE:
            _ONE_UPDATE[batch] = pld_lib.from_gaussian_mechanism(
                standard_deviation=1.0, value_discretization_interval=1e-4,
                sampling_prob=batch / N,
                neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            ).self_compose(1)
        pld = pld.compose(_ONE_UPDATE[batch])
    return pld.get_epsilon_for_delta(DELTA)


def test_true_epsilon_is_pld_accountants():
    """The helper above computes what dp_accounting's PLDAccountant does."""
    batches = [2, 4, 2]  # two sizes, one of them composed again
    accountant = dp_accounting.pld.PLDAccountant()
    for batch in batches:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            batch / N, dp_accounting.GaussianDpEvent(1.0)))
    assert _true_epsilon(batches) == accountant.get_epsilon(DELTA)


def _reported(model):
    return ledger_epsilon(kdp.ledger_of(model).rows(), N, DELTA)


def _base_with_12_updates():
    x, y = _data()
    base = keras.layers.Dense(5, name="base")
    trainer = keras.Sequential([keras.Input((4,)), base, keras.layers.Dense(3)])
    _dp_compile(trainer)
    trainer.fit(x, y, batch_size=2, epochs=3, verbose=0)  # 12 updates of 2
    assert kdp.ledger_of(trainer).updates == 12
    return base


@pytest.mark.parametrize("file_kind", ["dp", "public"])
def test_a_partial_load_keeps_the_updates_of_the_weights_it_skipped(tmp_path, file_kind):
    """Audit: a DP file (3 updates) or a public file loaded with
    skip_mismatch=True into a model one of whose layers holds 12 DP updates,
    then 2 more updates (a head swap), reported 2.354 vs 3.391 (public file:
    1.917 vs 3.176): the file's ledger replaced the one the model held,
    although the skipped layer kept its DP-trained weights."""
    x, y = _data()
    base = _base_with_12_updates()
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="base"),
                              keras.layers.Dense(3, name="head")])
    applied = [2] * 12
    if file_kind == "dp":
        _dp_compile(other)
        other.fit(x, y, batch_size=4, verbose=0)
        other.fit(x, y, batch_size=8, verbose=0)
        applied += [4, 4, 8]
    path = os.path.join(tmp_path, "other.weights.h5")
    other.save_weights(path)
    model = keras.Sequential([keras.Input((4,)), base, keras.layers.Dense(3, name="head")])
    kept = [w.numpy().copy() for w in base.weights]
    with pytest.warns(UserWarning):
        model.load_weights(path, skip_mismatch=True)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(kept, base.weights))
    _dp_compile(model)
    model.fit(x, y, batch_size=4, verbose=0)
    applied += [4, 4]
    assert kdp.ledger_of(model).updates == len(applied)
    assert _reported(model) >= _true_epsilon(applied) * (1 - 1e-9)


def test_reloading_a_models_own_checkpoint_does_not_count_twice(tmp_path):
    """The file is an earlier state of the ledger that holds it: nothing new."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(model)
    model.fit(x, y, batch_size=4, verbose=0)
    path = os.path.join(tmp_path, "own.weights.h5")
    model.save_weights(path)
    model.fit(x, y, batch_size=4, verbose=0)
    model.load_weights(path)
    assert kdp.ledger_of(model).updates == 4  # all it spent; the file held 2


def test_a_copy_trained_further_adds_only_its_own_updates(tmp_path):
    """A file of a model that started from this model's state: the updates
    both hold are counted once, the copy's new ones are added."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(model)
    model.fit(x, y, batch_size=4, verbose=0)  # 2
    first = os.path.join(tmp_path, "first.weights.h5")
    model.save_weights(first)
    copy = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    copy.load_weights(first)
    _dp_compile(copy)
    copy.fit(x, y, batch_size=8, verbose=0)  # 1 more
    branch = os.path.join(tmp_path, "branch.weights.h5")
    copy.save_weights(branch)
    model.fit(x, y, batch_size=2, verbose=0)  # 4 more on this branch
    model.load_weights(branch)
    assert kdp.ledger_of(model).updates == 2 + 4 + 1
    # and the copy reloading the first file counts nothing new
    copy.load_weights(first)
    assert kdp.ledger_of(copy).updates == 3


@pytest.fixture(scope="module")
def file_at_another_unit(tmp_path_factory):
    """A weights file whose ledger holds DP updates at another privacy unit
    (written once; the cases below only read it)."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(model)
    model.fit(x, y, batch_size=4, verbose=0)
    path = os.path.join(tmp_path_factory.mktemp("unit"), "user.weights.h5")
    ledger = kdp.ledger_of(model)
    saved_unit = ledger.unit.numpy()
    ledger.unit.assign(2)  # as if trained at the user level
    model.save_weights(path)
    ledger.unit.assign(saved_unit)
    return path


@pytest.mark.parametrize("skip_mismatch", [False, True])
def test_a_file_at_another_privacy_unit_is_refused_by_a_trained_model(file_at_another_unit,
                                                                      skip_mismatch):
    """Keras reports a ledger's refusal as a ValueError, or only a warning under
    skip_mismatch=True with the weights loaded: the ledger then refuses every
    later use (training, reading its epsilon) instead of counting one unit."""
    x, y = _data()
    path = file_at_another_unit
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(other)
    other.fit(x, y, batch_size=4, verbose=0)
    if skip_mismatch:
        with pytest.warns(UserWarning, match="privacy unit"):
            other.load_weights(path, skip_mismatch=True)
    else:
        with pytest.raises(ValueError, match="privacy unit"):
            other.load_weights(path)
    before = [w.numpy().copy() for w in other.weights]
    with pytest.raises(kdp.PrivacyRefusalError, match="privacy unit"):
        other.fit(x, y, batch_size=4, verbose=0)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, other.weights))
    with pytest.raises(kdp.PrivacyRefusalError, match="privacy unit"):
        kdp.ledger_of(other).rows()


@pytest.mark.parametrize("save_kwargs", [{"include_optimizer": False}, {}])
def test_legacy_h5_save_of_a_dp_model_is_refused_before_writing(tmp_path, save_kwargs):
    """Audit: model.save('m.h5', include_optimizer=False) after 8 updates,
    load_model, 4 more: 2.229 vs 3.021 with no warning; plain model.save('m.h5')
    crashed after writing the weights but not the ledger."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(model)
    model.fit(x, y, batch_size=1, verbose=0)
    path = os.path.join(tmp_path, "m.h5")
    with pytest.raises(kdp.PrivacyRefusalError, match=r"model.save\('model.keras'\)"):
        model.save(path, **save_kwargs)
    assert not os.path.exists(path)
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(tmp_path, "c.h5"))
    with pytest.raises(kdp.PrivacyRefusalError):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[checkpoint])
    assert not os.path.exists(os.path.join(tmp_path, "c.h5"))


def test_every_other_legacy_h5_write_of_dp_weights_fails_closed(tmp_path):
    """keras.saving.save_model(...) directly, a model built later on a
    DP-trained layer, and a model reloaded from a .keras file: refused, and
    what Keras had created cannot be loaded."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(3)])
    _dp_compile(model)
    model.fit(x, y, batch_size=4, verbose=0)
    direct = os.path.join(tmp_path, "direct.h5")
    with pytest.raises(kdp.PrivacyRefusalError):
        keras.saving.save_model(model, direct, include_optimizer=False)
    with pytest.raises(ValueError, match="config"):
        keras.models.load_model(direct, compile=False)
    built_later = keras.Sequential([keras.Input((4,)), model.layers[0], keras.layers.Dense(2)])
    with pytest.raises(kdp.PrivacyRefusalError):
        built_later.save(os.path.join(tmp_path, "later.h5"))
    model.save(os.path.join(tmp_path, "m.keras"))
    reloaded = keras.models.load_model(os.path.join(tmp_path, "m.keras"), compile=False)
    assert kdp.ledger_of(reloaded).updates == 2
    with pytest.raises(kdp.PrivacyRefusalError):
        reloaded.save(os.path.join(tmp_path, "reloaded.h5"))


def test_models_without_dp_updates_still_save_legacy_h5(tmp_path):
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=SCCE)
    model.fit(x, y, verbose=0)
    model.save(os.path.join(tmp_path, "public.h5"))
    assert type(model).save is keras.Model.save  # the class is untouched
    assert "save" not in model.__dict__
    dp = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(dp)  # not trained yet, but Keras's .h5 writer cannot save its optimizer
    with pytest.raises(kdp.PrivacyRefusalError, match="compiled for"):
        dp.save(os.path.join(tmp_path, "untrained.h5"))
    assert not os.path.exists(os.path.join(tmp_path, "untrained.h5"))


def test_a_searched_file_loaded_into_a_trained_model_counts_every_update(tmp_path):
    """A file released by a private search (its ledger records the search's
    epsilon, covering its first updates) loaded into a model with its own DP
    updates: the search is kept, and its covered updates, now after the
    model's own, are counted as well (conservative)."""
    x, y = _data()
    searched = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(searched)
    searched.fit(x, y, batch_size=4, verbose=0)  # 2 updates: "the released trial"
    kdp.ledger_of(searched).record_selection(1.5, 1e-6)
    assert kdp.ledger_of(searched).accounted_rows() == []
    path = os.path.join(tmp_path, "searched.weights.h5")
    searched.save_weights(path)
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    fresh.load_weights(path)
    assert kdp.ledger_of(fresh).selection_events() == [(1.5, 1e-6)]
    assert kdp.ledger_of(fresh).accounted_rows() == []
    trained = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    _dp_compile(trained)
    trained.fit(x, y, batch_size=8, verbose=0)  # 1 update of its own
    trained.load_weights(path)
    ledger = kdp.ledger_of(trained)
    assert ledger.selection_events() == [(1.5, 1e-6)]
    assert sum(r[3] for r in ledger.accounted_rows()) == 3
    with pytest.raises(ValueError, match="no earlier search"):
        ledger.record_selection(1.0, 1e-6)
