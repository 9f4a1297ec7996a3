"""The privacy ledger belongs to the model and its weights: it survives
recompiles, optimizer assignment and saving; nested, shared and reused models
count the updates their weights received; weights trained at different privacy
units are refused; a full table of rows never reprices an update.
"""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp
from keras_dp_lm.callbacks import PrivacyAccountant
from keras_dp_lm.accounting import compute_epsilon
from privacy_helpers import SCCE
from privacy_helpers import dense_model as _dense
from privacy_helpers import random_data as _data


# -- the ledger belongs to the model -------------------------------------------
def test_ledger_survives_recompiles_and_optimizer_assignment():
    """Before: recompiling with a fresh DP optimizer reset the count (reported
    3.0, spent 5.3); assigning model.optimizer started a ledger at 0 and the
    accountant never stopped (spent 23)."""
    x, y = _data(16)
    model = _dense(noise_multiplier=1.0)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)                 # 4 updates
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)
    model.fit(x, y, batch_size=8, verbose=0)                           # 2 more
    model.optimizer = kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=2.0)
    model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=8, verbose=0)                           # 2 more
    # Keras keeps the traced train function of the previous optimizer: the ledger
    # records the sigma actually applied (1.0), not the attribute (2.0).
    assert kdp.ledger_of(model).rows() == [(1.0, 0.0, 8.0, 8)]
    accountant = PrivacyAccountant(target_epsilon=50.0, delta=1e-3, dataset_size=16,
                                   batch_size=8, accountant="rdp", verbose=0)
    with pytest.raises(kdp.PrivacyRefusalError, match="refused a batch"):
        model.fit(x, y, batch_size=8, callbacks=[accountant], verbose=0)  # assumes 2.0
    assert kdp.ledger_of(model).updates == 8
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=2.0),
                  loss=SCCE)
    model.fit(x, y, batch_size=8, callbacks=[accountant], verbose=0)
    # fixed-size updates keep the rate of the accountant that checked them
    assert kdp.ledger_of(model).rows() == [(1.0, 0.0, 8.0, 8), (2.0, 0.5, 8.0, 2)]
    assert accountant.dp_updates == 10
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.5, dp_accounting.GaussianDpEvent(1.0)), 8))
    direct.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.5, dp_accounting.GaussianDpEvent(2.0)), 2))
    assert accountant.epsilon == pytest.approx(direct.get_epsilon(1e-3), rel=1e-9)


def test_accountant_stops_on_the_models_ledger_after_a_recompile():
    x, y = _data(16)
    model = _dense(noise_multiplier=1.0)
    limit = kdp.max_steps(2.0, 1e-3, 1.0, 0.5, accountant="rdp")
    for _ in range(3):  # each fit with a fresh optimizer and accountant
        model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)
        accountant = PrivacyAccountant(target_epsilon=2.0, delta=1e-3, dataset_size=16,
                                       batch_size=8, accountant="rdp", verbose=0)
        try:
            model.fit(x, y, batch_size=8, epochs=limit, callbacks=[accountant], verbose=0)
        except kdp.PrivacyBudgetExhaustedError:
            pass
    assert kdp.ledger_of(model).updates == limit
    assert compute_epsilon(1.0, 0.5, limit, 1e-3, "rdp") <= 2.0


def test_ledger_is_saved_with_weights_and_loaded_without_compile(tmp_path):
    x, y = _data(16)
    model = _dense(noise_multiplier=1.0)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    reloaded = keras.models.load_model(tmp_path / "m.keras", compile=False)
    assert kdp.ledger_of(reloaded).rows() == [(1.0, 0.0, 8.0, 4)]
    fresh = _dense(noise_multiplier=1.0)
    fresh.load_weights(tmp_path / "m.weights.h5")
    assert kdp.ledger_of(fresh).updates == 4


# -- nested, shared and reused models ------------------------------------------
def test_a_model_trained_inside_a_dp_model_records_its_updates(tmp_path):
    """Before: a model trained as part of an outer DP model got its updates
    in the outer ledger only; saved or reused alone, its own ledger said 0
    updates (no epsilon, no marks after a load). The same when it was
    the base of a new head (not a layer of the outer model), wrapped in
    TimeDistributed or held by a custom layer: its weights moved 0.57-0.98,
    and a later DP fit of the loaded model reported 3.16 where 5.56 was spent."""
    x, y = _data(8)
    keras.utils.set_random_seed(0)

    def dense_model(name, units=3):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)], name=name)

    class Holder(keras.layers.Layer):
        def __init__(self, model, **kwargs):
            super().__init__(**kwargs)
            self.model = model

        def call(self, inputs):
            return self.model(inputs)

    inner, held, base = dense_model("inner"), dense_model("held"), dense_model("base")
    frozen = dense_model("frozen", 4)
    frozen.trainable = False  # a public encoder the step does not train
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=8, batch_size=4)
    outers = {
        "a layer": (inner, keras.Sequential([frozen, inner, keras.layers.Dense(3)])),
        "a custom layer's": (held, keras.Sequential([keras.Input((4,)), Holder(held)])),
        "a new head's base": (base, keras.Model(
            base.inputs, keras.layers.Dense(3)(base.outputs[0]))),
    }
    for case, (nested, outer) in outers.items():
        outer.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)
        outer.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[accountant])
        assert kdp.ledger_of(outer).rows() == [(1.0, 0.5, 4.0, 4)], case
        assert kdp.ledger_of(nested).rows() == kdp.ledger_of(outer).rows(), case
    assert kdp.ledger_of(frozen).updates == 0
    base.save(tmp_path / "base.keras")
    loaded = keras.models.load_model(tmp_path / "base.keras")
    assert kdp.ledger_of(loaded).rows() == [(1.0, 0.5, 4.0, 4)]
    new_head = keras.Model(loaded.inputs, keras.layers.Dense(2)(loaded.outputs[0]))
    new_head.compile(optimizer="adam", loss=SCCE)
    with pytest.raises(RuntimeError, match="hold weights from DP training"):
        new_head.fit(x, y % 2, batch_size=8, verbose=0)


def test_a_model_built_on_dp_trained_weights_counts_their_updates(tmp_path):
    """Before: a model built after a DP step trained its weights (a new
    head on a DP-pretrained base, a layer reused in a new model) started its
    ledger at zero: DP fine-tuning of the head reported eps 4.85 where 15.94 was
    spent, and the reused layer saved alone carried no updates and no marks.
    Its ledger now starts from the updates its weights received."""
    x, y = _data(8)
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="base")
    pretrain = keras.Sequential([base, keras.layers.Dense(3)])
    pretrain.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                     loss=SCCE)
    pretrain.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 4 updates
    head = keras.Model(base.inputs, keras.layers.Dense(2)(base.outputs[0]))
    head.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=2.0),
                 loss=SCCE)
    head.fit(x, y % 2, batch_size=4, verbose=0)  # 2 more on the base's weights
    assert kdp.ledger_of(head).rows() == [(1.0, 0.0, 4.0, 4), (2.0, 0.0, 4.0, 2)]
    assert kdp.ledger_of(base).updates == 6
    # the pretraining's step, traced before the head existed, trains the base
    # again: it is traced anew so that the head's ledger records it too
    pretrain.fit(x, y, batch_size=4, verbose=0)
    assert kdp.ledger_of(head).rows() == [
        (1.0, 0.0, 4.0, 4), (2.0, 0.0, 4.0, 2), (1.0, 0.0, 4.0, 2)]
    assert kdp.ledger_of(base).updates == kdp.ledger_of(pretrain).updates == 8
    reused = keras.Sequential([keras.Input((4,)), base.layers[0]])  # built after all
    reused.save(tmp_path / "reused.keras")
    loaded = keras.models.load_model(tmp_path / "reused.keras")
    # at least what the head's weights received; updates that two of its sources
    # both recorded (a model sharing the base records the other's steps) may
    # count twice: an over-report, never an under-report
    assert kdp.ledger_of(loaded).updates >= kdp.ledger_of(head).updates == 8
    loaded.compile(optimizer="sgd", loss=SCCE)
    with pytest.raises(RuntimeError, match="DP updates"):
        loaded.fit(x, y % 4, batch_size=8, verbose=0)


# -- inherited and merged ledger rows ------------------------------------------
def test_inherited_updates_are_not_lost_nor_repriced():
    """Before: a ledger took over another's rows and marked it as included;
    that other ledger then gained updates the first never saw (its model trained
    a part the first does not hold), and a model built on both counted only the
    first (6 of 8). make_private steps traced before a model sharing their
    weights was built were not traced again (that model's ledger: 2 of 5).
    Rows beyond the table merged a fixed-size row into a Poisson row, repricing
    it at the Poisson rate (eps 7.39 -> 1.01)."""
    from keras_dp_lm.training.ledger_rows import MAX_ROWS
    from keras_dp_lm.training.ledger_rows import fit_table

    x, y = _data(8)
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="base")
    head_a, head_b = keras.layers.Dense(3), keras.layers.Dense(3)
    a = keras.Model(base.inputs, head_a(base.outputs[0]))
    dp = dict(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=SCCE)
    a.compile(**dp)
    a.fit(x, y, batch_size=4, epochs=2, verbose=0)
    b = keras.Model(base.inputs, head_b(base.outputs[0]))  # takes over a's 4
    b.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=SCCE)
    b.fit(x, y, batch_size=4, verbose=0)
    base.trainable = False
    a.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=SCCE)
    a.fit(x, y, batch_size=4, verbose=0)  # head_a only: b never sees these
    c = keras.Model(base.inputs, head_a(base.outputs[0]))  # holds a's weights
    assert kdp.ledger_of(c).updates >= kdp.ledger_of(a).updates == 8

    keras.utils.set_random_seed(1)
    model = _dense(noise_multiplier=1.0)
    step = kdp.make_private(model)
    for _ in range(2):
        step((x, y))
    features = keras.Model(model.inputs, model.outputs)  # built between steps
    for _ in range(3):
        step((x, y))
    assert kdp.ledger_of(features).updates == kdp.ledger_of(model).updates == 5

    poisson = [(1.0, 0.1, 8.0, 1)] * 31
    rows = fit_table(poisson + [(1.0, 0.0, 32.0, 10), (1.0, 0.0625, 4.0, 1)])
    assert len(rows) <= MAX_ROWS and sum(r[3] for r in rows) == 42
    assert (1.0, 0.0, 32.0, 10) in [tuple(r) for r in rows]  # never repriced


def test_a_full_ledger_never_reprices_a_fixed_size_update():
    """Before: with the 32 rows full, a fixed-size update recorded (q = 0,
    priced at its batch over the reader's dataset size) merged into the last
    Poisson row took its rate: eps 7.38 -> 1.01 at N = 64. It now merges into
    the last row of its kind, or the last two rows merge to make room."""
    from keras_dp_lm.training.ledger_rows import MAX_ROWS

    ledger = kdp.ledger_of(_dense())
    ok = tf.constant(True)
    for i in range(MAX_ROWS):  # Poisson rows, alternating sigma: no merging
        ledger.record(1.0 + i % 2, 0.0625, 4, ok)
    ledger.record(1.0, 0.0, 32, ok)  # fixed-size, in graph mode too
    tf.function(lambda: ledger.record(1.0, 0.0, 16, ok))()
    rows = ledger.rows()
    assert len(rows) == MAX_ROWS and ledger.updates == MAX_ROWS + 2
    assert rows[-1] == (1.0, 0.0, 32.0, 2)  # its own row, never at q = 0.0625
    assert rows[-2] == (1.0, 0.0625, 4.0, 2)  # the two it displaced, merged
    assert all(q > 0 for _, q, _, _ in rows[:-1])


def test_a_ledger_that_cannot_take_over_its_sources_is_not_kept():
    """Weights trained at two privacy units cannot be counted by one ledger.
    Before: the first ledger_of raised, but left an empty ledger on the model,
    which then saved and trained as if it had no DP updates. The training
    models are gone when the new model is built: the weights' marks held them
    weakly, so their updates were lost (a new model on them started at zero)."""
    import gc

    from keras_dp_lm.training.weight_marks import mark_dp_trained

    user_layer, example_layer = keras.layers.Dense(4), keras.layers.Dense(3)
    for layer, unit in ((user_layer, "user"), (example_layer, "example")):
        trainer = keras.Sequential([keras.Input((4,)), layer])
        trainer.build((None, 4))
        ledger = kdp.ledger_of(trainer)
        ledger.record(1.0, 0.5, 3, tf.constant(True), unit=unit)
        mark_dp_trained(trainer.weights, ledger)  # as a DP step of that unit does
    del trainer, ledger
    gc.collect()
    inputs = keras.Input((4,))
    both = keras.Model(inputs, example_layer(user_layer(inputs)))
    for _ in range(2):  # refused every time, never an empty ledger
        with pytest.raises(ValueError, match="different privacy units"):
            kdp.ledger_of(both)


def test_updates_merged_into_an_earlier_row_are_not_repriced_when_taken_over():
    """A full table merges an update into the last row of its kind, which may
    be an earlier row. Before: a ledger taking over the updates after the
    first N of such a table read them by position, so a Poisson update merged into
    an earlier row was taken as the fixed-size row after it (priced at batch /
    dataset size, not at its q). The updates after N are now priced at each kind's
    most conservative row."""
    from keras_dp_lm.training.ledger_rows import MAX_ROWS
    from keras_dp_lm.training.ledger import PrivacyLedger

    ok = tf.constant(True)
    source = PrivacyLedger()
    for i in range(MAX_ROWS - 1):  # Poisson rows, alternating sigma: no merging
        source.record(1.0 + i % 2, 0.0625, 4, ok)
    source.record(1.0, 0.0, 32, ok)  # a fixed-size row last: the table is full
    first = PrivacyLedger()
    first.inherit([source])  # takes over the first MAX_ROWS updates
    source.record(1.0, 0.0625, 4, ok)  # merged into the last Poisson row, not the last row
    assert source.rows()[-1] == (1.0, 0.0, 32.0, 1)
    later = PrivacyLedger()
    later.inherit([source, first])
    poisson = sum(n for _, q, _, n in later.rows() if q > 0)
    assert poisson >= MAX_ROWS  # all the Poisson updates the weights received
    assert later.updates >= source.updates


def test_a_batch_beyond_the_accountant_is_refused_in_words_with_its_numbers():
    """The step's run-time refusal reaches the user as a PrivacyRefusalError that
    names the broken limit with both numbers and the fix (not TensorFlow's
    assertion vectors), and no update is applied."""
    x = np.random.default_rng(0).normal(size=(400, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPAdam(1e-2, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [np.array(v) for v in model.trainable_variables]
    accountant = kdp.PrivacyAccountant(dataset_size=400, batch_size=50, delta=1e-5,
                                       target_epsilon=50)
    with pytest.raises(kdp.PrivacyRefusalError) as refused:
        model.fit(x, y, batch_size=80, callbacks=[accountant], verbose=0)
    message = str(refused.value)
    assert "this batch has 80 real examples" in message, message
    assert "fixed-size batches of at most 50" in message, message
    assert "PrivacyAccountant(batch_size=80" in message, message
    assert kdp.ledger_of(model).updates == 0
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(np.array(v), b)
    # the same refusal from a custom loop's step
    accountant = kdp.PrivacyAccountant(dataset_size=400, batch_size=80, delta=1e-5)
    accountant.set_model(model)
    accountant.on_train_begin()
    step = kdp.make_private(model)
    with pytest.raises(kdp.PrivacyRefusalError, match="this batch has 100 real examples"):
        step((x[:100], y[:100]))
    assert kdp.ledger_of(model).updates == 0
