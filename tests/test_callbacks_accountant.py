"""PrivacyAccountant's per-batch epsilon, checked against dp_accounting itself.

Per batch the callback logs a PLD upper bound (the same accountant as the
epoch-end value, never the looser RDP one): at least the PLD epsilon of the
updates applied so far, never decreasing, and equal to the epoch-end value at
the last batch of the run.
"""

import os

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

import keras_dp_lm as kdp
from keras_dp_lm import accounting
from keras_dp_lm.callbacks import PrivacyAccountant

N, B, DELTA = 64, 8, 1e-3
X = np.random.RandomState(0).randn(N, 4).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
_BASES, _PREFIXES = {}, {}


def dp_accounting_epsilon(rows, delta=DELTA):
    """What dp_accounting's PLDAccountant computes for ``rows`` = [(sigma, q, updates)]
    composed in order (its arithmetic; one-step PLDs and prefixes computed once)."""
    pld = pld_lib.identity()
    for i, (sigma, q, updates) in enumerate(rows):
        key = tuple(rows[:i + 1])
        if key not in _PREFIXES:
            if (sigma, q) not in _BASES:
                _BASES[sigma, q] = pld_lib.from_gaussian_mechanism(
                    standard_deviation=sigma, sampling_prob=q, value_discretization_interval=1e-4)
            _PREFIXES[key] = pld.compose(_BASES[sigma, q].self_compose(updates))
        pld = _PREFIXES[key]
    return pld.get_epsilon_for_delta(delta)


def test_helper_is_pld_accountant():
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(accounting.dp_sgd_event(0.8, B / N, 3)).compose(accounting.dp_sgd_event(1.0, B / N, 5))
    assert dp_accounting_epsilon([(0.8, B / N, 3), (1.0, B / N, 5)]) == acc.get_epsilon(DELTA)


def make_model(noise=1.0, spe=1, accumulation=1, expected_batch_size=None):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=noise,
                                      gradient_accumulation_steps=accumulation, seed=0,
                                      expected_batch_size=expected_batch_size),
                  steps_per_execution=spe,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit_recording(model, accountant, epochs):
    """fit; returns the history and (ledger rows, logged epsilon) after every batch."""
    seen = []

    def record(batch, logs):
        rows = [(r[0], r[1] or r[2] / N, r[3]) for r in kdp.ledger_of(model).rows() if r[3]]
        seen.append((rows, logs["epsilon"]))

    history = model.fit(X, Y, batch_size=B, epochs=epochs, verbose=0, callbacks=[
        accountant, keras.callbacks.LambdaCallback(on_train_batch_end=record)])
    return history, seen


def check_batch_epsilons(history, seen):
    logged = [eps for _, eps in seen]
    exact = [dp_accounting_epsilon(rows) for rows, _ in seen]
    assert all(value >= bound for value, bound in zip(logged, exact)), list(zip(logged, exact))
    assert logged == sorted(logged)  # never decreases
    assert logged[-1] == history.history["epsilon"][-1] == exact[-1]
    return logged, exact


@pytest.mark.parametrize("spe, accumulation", [(1, 1), (3, 2)])
def test_batch_epsilon_is_pld_bound_up_to_the_budget_stop(spe, accumulation):
    model = make_model(spe=spe, accumulation=accumulation)
    accountant = PrivacyAccountant(target_epsilon=3.0, delta=DELTA, dataset_size=N,
                                   batch_size=B, sampling="poisson", verbose=0)
    history, seen = fit_recording(model, accountant, epochs=20)
    limit = accountant.max_steps
    count = accountant.dp_updates
    assert count <= limit < count + spe
    logged, exact = check_batch_epsilons(history, seen)
    assert logged[-1] <= 3.0
    # The same (PLD) accountant throughout: never the RDP value, which is looser.
    counts = [sum(r[2] for r in rows) for rows, _ in seen]
    rdp = accounting.epsilon_curve(1.0, B / N, counts, DELTA, accountant="rdp")
    assert all(value < r for value, r in zip(logged, rdp) if value > 0)


def test_last_batch_is_exact_when_steps_per_execution_does_not_divide_the_epoch():
    # 8 steps per epoch in executions of 3: Keras reports the last one as batch 8.
    model = make_model(spe=3)
    accountant = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B,
                                   sampling="poisson", verbose=0)
    history, seen = fit_recording(model, accountant, epochs=2)
    assert accountant.dp_updates == 16
    check_batch_epsilons(history, seen)  # the last logged value is the exact one


def test_batch_epsilon_composes_a_non_dominated_earlier_fit():
    # A first fit with less noise than the accountant of the second one
    # assumes: its ledger row is composed exactly (not dominated).
    model = make_model(noise=0.8)
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0)
    model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B,
                                   sampling="poisson")
    history, seen = fit_recording(model, accountant, epochs=2)
    assert [row[:2] for row in seen[-1][0]] == [(0.8, B / N), (1.0, B / N)]
    logged, exact = check_batch_epsilons(history, seen)
    assert history.history["epsilon"] == [exact[7], exact[15]]
    # dp_events(): the ledger as DpEvents, which dp_accounting composes to the same.
    events = accountant.dp_events()
    assert [(e.event.event.noise_multiplier, e.event.sampling_probability, e.count)
            for e in events] == [(0.8, B / N, N // B), (1.0, B / N, 2 * N // B)]
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for event in events:
        direct.compose(event)
    assert direct.get_epsilon(DELTA) == pytest.approx(
        dp_accounting_epsilon([(0.8, B / N, N // B), (1.0, B / N, 2 * N // B)]), rel=1e-9)


def test_rdp_accountant_logs_exact_rdp_per_batch():
    model = make_model()
    accountant = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B,
                                   sampling="poisson", accountant="rdp")
    history, seen = fit_recording(model, accountant, epochs=1)
    assert [eps for _, eps in seen] == accounting.epsilon_curve(
        1.0, B / N, list(range(1, 9)), DELTA, accountant="rdp")
    assert history.history["epsilon"] == [seen[-1][1]]


def test_batch_epsilon_bounds_a_run_whose_first_batch_is_small():
    """Review finding: the grid was capped by a prediction made from the first batch's
    real size (2), so later batches of 8 logged ~20x too little."""
    import tensorflow as tf

    sizes = [2] + [B] * 7
    starts = np.cumsum([0] + sizes[:-1])
    ds = tf.data.Dataset.from_generator(
        lambda: ((X[s:s + k], Y[s:s + k]) for s, k in zip(starts, sizes)),
        output_signature=(tf.TensorSpec((None, 4), tf.float32),
                          tf.TensorSpec((None,), tf.int32)))
    ds = ds.apply(tf.data.experimental.assert_cardinality(len(sizes)))
    model = make_model()
    accountant = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B,
                                   sampling="shuffle", verbose=0)
    seen = []

    def record(batch, logs):
        rows = [(r[0], r[1] or r[2] / N, r[3]) for r in kdp.ledger_of(model).rows() if r[3]]
        seen.append((rows, logs["epsilon"]))

    with pytest.warns(UserWarning):  # fixed-size batches accounted as if Poisson
        history = model.fit(ds, epochs=2, verbose=0, callbacks=[
            accountant, keras.callbacks.LambdaCallback(on_train_batch_end=record)])
    check_batch_epsilons(history, seen)


def test_fixed_size_updates_keep_the_rate_they_were_accounted_at():
    """Review finding: fixed-size updates were recorded with q = 0 and priced at
    batch / dataset_size of whichever accountant read the ledger, so continuing
    on a larger dataset repriced the first run's 100 updates (12.53 reported as
    0.26). They now keep the rate of the accountant that checked them."""
    model = make_model(noise=0.8)
    model.fit(X, Y, batch_size=B, epochs=2, verbose=0,
              callbacks=[PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B, verbose=0)])
    assert kdp.ledger_of(model).rows() == [(0.8, B / N, float(B), 16)]
    bigger = 100 * N
    later = PrivacyAccountant(delta=DELTA, dataset_size=bigger, batch_size=B, verbose=0)
    model.fit(X[:2 * B], Y[:2 * B], batch_size=B, epochs=1, verbose=0, callbacks=[later])
    spent = dp_accounting_epsilon([(0.8, B / N, 16), (0.8, B / bigger, 2)])
    assert later.epsilon == pytest.approx(spent, rel=1e-9)
    assert later.epsilon >= dp_accounting_epsilon([(0.8, B / N, 16)])
    # the report's headline covers the whole ledger (review: it read the last row only)
    assert later.report()["epsilon"] == pytest.approx(later.epsilon, rel=1e-9)
    assert later.report()["total_epsilon"] == pytest.approx(later.epsilon, rel=1e-9)
    assert later.report()["steps"] == 18
    # group privacy over both rows: bounded by the costlier configuration for all 18
    grouped = PrivacyAccountant(delta=DELTA, dataset_size=bigger, batch_size=B,
                                examples_per_user=2, verbose=0)
    grouped.set_model(model)
    assert grouped.report()["user_level_epsilon"] == pytest.approx(
        kdp.accounting.user_level_epsilon(0.8, B / N, 18, DELTA, 2), rel=1e-9)


def test_poisson_batches_regrouped_after_sampling_are_refused():
    """Review finding: for Poisson batches the step checked only the rate they
    carry, so unbatch().filter(real).batch(200) trained 10x the expected number
    of real examples per update at the recorded q. A batch beyond what a draw
    at that rate reaches (once in 1e12 over a million steps) is now refused
    before its update."""
    q = 0.05  # cap 38 real examples; 40 draws hold ~128
    batches = kdp.data.poisson_batches((X, Y), q, N, seed=0, num_steps=40)
    regrouped = batches.unbatch().filter(
        lambda x, y, sw: sw[kdp.data.poisson.REAL_SLOTS_KEY] > 0).batch(N)
    model = make_model(expected_batch_size=q * N)
    before = model.trainable_variables[0].numpy().copy()
    accountant = PrivacyAccountant(delta=DELTA, batches=batches, verbose=0)
    with pytest.raises(Exception, match="exceeded|refused"):
        model.fit(regrouped, verbose=0, callbacks=[accountant])
    assert np.array_equal(model.trainable_variables[0].numpy(), before)  # no update
    # a batch labelled Poisson under an accountant of fixed-size batches: bounded by
    # its batch size (review: 500 real rows passed an accountant of batches of 100)
    shuffled = make_model(expected_batch_size=q * N)
    with pytest.raises(Exception, match="refused"):
        shuffled.fit(regrouped, verbose=0, callbacks=[PrivacyAccountant(
            delta=DELTA, dataset_size=N, batch_size=B, sampling="shuffle", verbose=0)])
    assert kdp.ledger_of(shuffled).updates <= 1  # the refused batch, recorded
    fresh = make_model(expected_batch_size=q * N)
    fresh.fit(batches, verbose=0, callbacks=[PrivacyAccountant(delta=DELTA, batches=batches,
                                                               verbose=0)])
    assert kdp.ledger_of(fresh).updates == 40


def test_poisson_batches_regrouped_below_the_cap_are_refused_within_a_few_updates(tmp_path):
    """Before: Poisson draws regrouped into batches of a few
    times the expected count, still below the one-batch cap, trained 289
    updates of 69 real rows reported at 2.16 for ~8.06 spent. The running total
    of real examples is now checked too: refused after a few updates; honest
    draws over a long fit are not."""
    q = 0.05  # expected 3.25 real examples per draw, one-batch cap 38
    batches = kdp.data.poisson_batches((X, Y), q, N, seed=0, num_steps=200)
    regrouped = batches.unbatch().filter(
        lambda x, y, sw: sw[kdp.data.poisson.REAL_SLOTS_KEY] > 0).batch(12)
    model = make_model(expected_batch_size=q * N)
    with pytest.raises(Exception, match="exceeded|refused"):
        model.fit(regrouped, verbose=0, callbacks=[
            PrivacyAccountant(delta=DELTA, batches=batches, verbose=0)])
    refused_at = kdp.ledger_of(model).updates   # updates applied before the refusal
    assert 2 <= refused_at <= 10, refused_at
    # ...also fed as many short fits (before, the total restarted at every
    # fit, and 100 fits of 3 updates trained 300): it counts over the model's
    # life, and is saved with it
    short = make_model(expected_batch_size=q * N)
    with pytest.raises(Exception, match="exceeded|refused"):
        for _ in range(10):
            short.fit(regrouped.take(2), verbose=0, callbacks=[
                PrivacyAccountant(delta=DELTA, batches=batches, verbose=0)])
            reloaded = make_model(expected_batch_size=q * N)
            reloaded.set_weights(short.get_weights())
            path = os.path.join(str(tmp_path), "short.weights.h5")
            short.save_weights(path)
            reloaded.load_weights(path)
            short = reloaded
    assert kdp.ledger_of(short).updates <= 10
    honest = make_model(expected_batch_size=q * N)
    honest.fit(batches, epochs=3, verbose=0, callbacks=[
        PrivacyAccountant(delta=DELTA, batches=batches, verbose=0)])
    assert kdp.ledger_of(honest).updates == 600


def test_two_accountants_in_one_fit_are_refused():
    """Review finding: two accountants shared the ledger's limits and the last
    registered one won: the one with target epsilon 2 let training reach 3.59."""
    model = make_model()
    first = PrivacyAccountant(target_epsilon=2.0, delta=DELTA, dataset_size=N, batch_size=B,
                              verbose=0)
    second = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=2 * B, verbose=0)
    with pytest.raises(ValueError, match="Two PrivacyAccountant"):
        model.fit(X, Y, batch_size=B, epochs=1, verbose=0, callbacks=[first, second])
    assert kdp.ledger_of(model).updates == 0
    kdp.ledger_of(model).clear_limits()
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0, callbacks=[second])
    assert kdp.ledger_of(model).updates == N // B


def test_a_poisson_batch_labelled_with_a_smaller_rate_is_recorded_at_the_accountants():
    """Review finding: the ledger recorded the rate a batch carries, which is
    the user's word: batches drawn at 0.25 and labelled 0.01 were accounted at
    0.01. With an accountant attached, an update is recorded at the larger of
    the two rates."""
    q = 0.25
    batches = kdp.data.poisson_batches((X, Y), q, N, seed=0, num_steps=4)
    key = kdp.data.poisson.SAMPLING_RATE_KEY
    relabelled = batches.map(lambda x, y, sw: (x, y, {**sw, key: 0.04 * sw[key]}))
    model = make_model(expected_batch_size=q * N)
    accountant = PrivacyAccountant(delta=DELTA, batches=batches, verbose=0)
    model.fit(relabelled, verbose=0, callbacks=[accountant])
    assert kdp.ledger_of(model).rows()[0][1] == pytest.approx(q)
    assert accountant.epsilon == pytest.approx(dp_accounting_epsilon([(1.0, q, 4)]), rel=1e-9)


def test_a_fit_that_raised_leaves_no_limits_behind():
    """Review finding: Keras skips on_train_end when fit raises, so the
    accountant's limits stayed registered: a later fit without an accountant was
    checked and recorded at the crashed accountant's rate (5.54 reported for
    24.8 spent), and a new accountant was refused."""
    model = make_model()

    def crash(batch, logs):
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(X, Y, batch_size=B, verbose=0, callbacks=[
            PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B, verbose=0),
            keras.callbacks.LambdaCallback(on_train_batch_end=crash)])
    assert not np.any(kdp.ledger_of(model).limits.numpy())
    model.fit(X[:16], Y[:16], batch_size=16, verbose=0)   # no accountant: any batch
    assert kdp.ledger_of(model).rows()[-1] == (1.0, 0.0, 16.0, 1)
    model.fit(X, Y, batch_size=B, verbose=0, callbacks=[
        PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B, verbose=0)])


def test_only_keras_hub_tasks_keep_their_ledger_with_a_backbone():
    """Review finding: any model with a ``backbone`` attribute handed its ledger
    to it, so a new head on a shared public encoder started with another
    head's updates (and a target epsilon refused it)."""
    encoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    class Classifier(keras.Model):
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone
            self.head = keras.layers.Dense(2)

        def call(self, x):
            return self.head(self.backbone(x))

    first, second = Classifier(encoder), Classifier(encoder)
    assert kdp.ledger_of(first) is not kdp.ledger_of(second)
    assert kdp.ledger_of(first) is not kdp.ledger_of(encoder)


@pytest.mark.filterwarnings("ignore:max_batch_size")
def test_the_statement_counts_the_chance_of_a_batch_above_its_cap():
    """Before: truncated draws above the padded cap differ from Poisson
    sampling; the guarantee is (eps, delta + (1 + e^eps) p), p the chance of
    an overflow over the run (keras_dp_lm.data.poisson). With a cap that
    overflows almost surely the statement said (1.58, 0.001) without a word."""
    import math

    from keras_dp_lm.data import overflow_probability

    n, q, steps = 200, 0.1, 10
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 4)).astype("float32"), np.zeros((n, 1), "float32")
    for cap, vacuous in ((12, True), (kdp.suggest_max_batch_size(n, q, steps), False)):
        batches = kdp.poisson_batches((x, y), q, max_batch_size=cap, overflow="truncate",
                                      num_steps=steps, seed=1)
        p = overflow_probability(n, q, cap, steps)
        assert batches.overflow_probability == p
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                          expected_batch_size=q * n), loss="mse")
        accountant = PrivacyAccountant(delta=1e-3, batches=batches, verbose=0)
        model.fit(batches, callbacks=[accountant], verbose=0)
        report = accountant.report()
        assert report["overflow_probability"] == p
        if not vacuous:  # a second pass draws again: p over the 2 x 10 updates applied
            model.fit(batches, callbacks=[accountant], verbose=0)
            report = accountant.report()
            p = overflow_probability(n, q, cap, 2 * steps)
            assert report["overflow_probability"] == p > batches.overflow_probability
        assert report["delta_with_overflow"] == pytest.approx(
            min(1.0, 1e-3 + (1 + math.exp(report["epsilon"])) * p))
        assert ("no guarantee" in accountant.statement()) is vacuous
        assert report["delta_with_overflow"] > (0.5 if vacuous else 1e-3)


def _check_at(seen, delta):
    logged = [eps for _, eps in seen]
    exact = [dp_accounting_epsilon(rows, delta) for rows, _ in seen]
    assert all(value >= bound for value, bound in zip(logged, exact)), list(zip(logged, exact))


def test_delta_and_events_set_after_construction_are_the_ones_counted():
    """``delta`` and ``extra_events`` are public attributes: set after the accountant
    is made (before a fit, or between two reports), they are what the per-batch
    epsilon and the report count, never the values they replaced."""
    model = make_model()
    accountant = PrivacyAccountant(delta=DELTA, dataset_size=N, batch_size=B,
                                   sampling="poisson", verbose=0)
    accountant.delta = 1e-9            # smaller: every epsilon is larger
    history, seen = fit_recording(model, accountant, epochs=2)
    _check_at(seen, 1e-9)
    assert history.history["epsilon"][-1] == pytest.approx(
        dp_accounting_epsilon(seen[-1][0], 1e-9), rel=1e-6)
    before = accountant.report()
    extra = dp_accounting.GaussianDpEvent(0.5)
    accountant.extra_events.append(extra)
    after = accountant.report()
    direct = dp_accounting.pld.PLDAccountant()
    for sigma, q, updates in seen[-1][0]:
        direct.compose(accounting.dp_sgd_event(sigma, q, updates))
    direct.compose(extra)
    assert after["total_epsilon"] > before["total_epsilon"]
    assert after["total_epsilon"] >= direct.get_epsilon(1e-9) * (1 - 1e-3)
    accountant.delta = 1e-5            # larger: the report follows it
    assert accountant.report()["delta"] == 1e-5
    assert accountant.report()["epsilon"] == pytest.approx(accountant.epsilon)
