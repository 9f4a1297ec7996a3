"""The private search: what it accounts is what its trials applied, it refuses before
training, and it releases the best trial."""

import math

import dp_accounting
import keras
import numpy as np
import pytest

import keras_dp_lm as kdp
from keras_dp_lm import tuning
from keras_dp_lm.accounting import dp_sgd_event
from keras_dp_lm.training.model_ledgers import ledger_of


def toy(n=500, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype("int32")


def make_builder(built):
    def build(candidate):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        built.append((candidate, model))
        return model
    return build


def test_search_epsilon_is_dp_accounting_on_what_every_trial_applied():
    x, y = toy()
    built = []
    result = tuning.private_search(
        make_builder(built), x, y, target_epsilon=4.0, delta=1e-5, epochs=6.0,
        min_steps=15, candidates=[tuning.Candidate(1e-5), tuning.Candidate(0.1)],
        mean_trials=2.5, seed=3)
    assert built, "no trial ran"
    score_sigma = result.score_noise_multiplier
    # the score divides by the public expected validation size (fraction * N),
    # never by the split's real size, a count of private coins (audit, issue 49)
    assert result.validation_size == pytest.approx(0.1 * len(y))
    assert score_sigma == tuning.search.default_score_noise(4.0, 1e-5, 2.5, 1.0,
                                                            result.validation_size)
    for _, model in built:  # each trial: the accounted updates, nothing else
        rows = ledger_of(model).rows()
        assert sum(r[3] for r in rows) == result.steps
        assert {(r[0], r[1]) for r in rows} == {(result.noise_multiplier,
                                                 result.sampling_rate)}
    applied_trial = dp_accounting.ComposedDpEvent([
        dp_sgd_event(result.noise_multiplier, result.sampling_rate, result.steps),
        dp_accounting.GaussianDpEvent(score_sigma)])
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(applied_trial, 2.5, 1.0))
    truth = acc.get_epsilon(result.delta * (1 - 1e-3))  # less the overflow reserve
    assert result.epsilon >= truth * (1 - 1e-9)
    assert result.epsilon <= 4.0 and result.delta == 1e-5
    # the released model is the best-scoring trial's, trained at its candidate's rate
    assert any(model is result.model and cand == result.candidate for cand, model in built)
    assert result.candidate.learning_rate == 0.1 or len(built) == 1
    assert "spends epsilon" in result.explain()


def test_search_over_budget_is_refused_before_any_model_is_built():
    x, y = toy(200)
    built = []
    with pytest.raises(ValueError, match="Lower `mean_trials`"):
        tuning.private_search(make_builder(built), x, y, target_epsilon=0.05, delta=1e-5,
                              candidates=[tuning.Candidate(0.1)], mean_trials=20,
                              score_noise_multiplier=0.5, seed=0)
    assert built == []


def test_a_trial_on_weights_already_dp_trained_is_refused_before_training():
    x, y = toy(200)
    shared = keras.layers.Dense(2)
    first = keras.Sequential([keras.Input((4,)), shared])
    first.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    first.fit(x, y, batch_size=50, epochs=1, verbose=0)
    before = [w.numpy().copy() for w in shared.weights]

    def build(candidate):
        return keras.Sequential([keras.Input((4,)), shared])

    with pytest.raises(ValueError, match="already received"):
        tuning.private_search(build, x, y, target_epsilon=4.0, delta=1e-5, epochs=2.0,
                              min_steps=5, candidates=[tuning.Candidate(0.1)], seed=0)
    for w, b in zip(shared.weights, before):
        np.testing.assert_array_equal(w.numpy(), b)


def test_search_arguments_are_checked():
    x, y = toy(100)
    with pytest.raises(ValueError, match="non-empty list of tuning.Candidate"):
        tuning.private_search(lambda c: None, x, y, target_epsilon=3.0, delta=1e-5,
                              candidates=[0.1])
    with pytest.raises(ValueError, match="same rows"):
        tuning.private_search(lambda c: None, x, y[:50], target_epsilon=3.0, delta=1e-5,
                              candidates=[tuning.Candidate(0.1)])


def test_public_search_simulates_the_private_run_and_ranks_every_candidate():
    from keras_dp_lm.recipes import suggest_recipe

    x, y = toy(800)
    recipe = suggest_recipe(2000, 3.0, 1e-6, epochs=5.0, min_steps=20, num_parameters=10)
    built = []
    found = tuning.public_search(make_builder(built), x, y, recipe=recipe, seed=0,
                                 candidates=[tuning.Candidate(1e-5), tuning.Candidate(0.1)])
    assert [c for c, _ in built] == [tuning.Candidate(1e-5), tuning.Candidate(0.1)]
    for _, model in built:  # the private run's noise and steps, at its batch size
        rows = ledger_of(model).rows()
        assert sum(r[3] for r in rows) == recipe.steps
        assert {r[0] for r in rows} == {recipe.noise_multiplier}
        assert rows[0][1] * 640 == pytest.approx(recipe.batch_size)  # q * public N
    assert found.best == tuning.Candidate(0.1)
    assert found.scores[tuning.Candidate(0.1)] > found.scores[tuning.Candidate(1e-5)] + 0.1
    with pytest.raises(ValueError, match="smaller than the private batch"):
        tuning.public_search(make_builder([]), x[:100], y[:100], recipe=recipe,
                             candidates=[tuning.Candidate(0.1)])


def test_the_released_model_carries_no_trace_of_the_other_trials_or_the_noise():
    """Before: the optimizer's noise seed, Keras's auto-names (which numbered
    the trials), the training loss and NaN scores of private_search leaked."""
    x, y = toy(400)
    built = []
    names = {keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]).name}
    result = tuning.private_search(
        make_builder(built), x, y, target_epsilon=4.0, delta=1e-5, epochs=4.0,
        min_steps=10, candidates=[tuning.Candidate(0.1)], mean_trials=4.0, seed=1)
    assert len(built) > 1, "the seed must draw several trials for this test"
    # every trial had the same names; the next model is named as after one trial
    assert len({m.name for _, m in built}) == 1
    assert len({tuple(l.name for l in m.layers) for _, m in built}) == 1
    after = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]).name
    assert after not in names and after != built[0][1].name
    with pytest.raises(kdp.PrivacyRefusalError, match="noise seed was dropped"):
        result.model.optimizer._noise_like([np.zeros(2, "float32")], 0, 1, 0)
    assert result.model.train_function is None  # its graph held the seed as a constant
    assert result.model.history is None
    assert all(float(v) == 0.0 for m in result.model.metrics for v in m.variables)
    # a fit retraces (the traced function is gone) and meets the dropped seed
    with pytest.raises(kdp.PrivacyRefusalError, match="noise seed was dropped"):
        result.model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)

    def nan_scores(model, xv, yv):
        return np.full(len(yv), np.nan)

    scored = tuning.private_search(
        make_builder([]), x, y, target_epsilon=4.0, delta=1e-5, epochs=2.0, min_steps=5,
        candidates=[tuning.Candidate(0.1)], mean_trials=1.0, seed=0, score_fn=nan_scores)
    assert np.isfinite(scored.score)


def test_a_trial_warm_started_from_an_earlier_trial_is_refused():
    x, y = toy(300)
    previous = []

    def warm(candidate):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        if previous:
            model.set_weights(previous[-1].get_weights())
        previous.append(model)
        return model

    with pytest.raises(ValueError, match="earlier trial trained"):
        tuning.private_search(warm, x, y, target_epsilon=4.0, delta=1e-5, epochs=2.0,
                              min_steps=5, candidates=[tuning.Candidate(0.1)],
                              mean_trials=6.0, seed=1)
    assert len(previous) >= 2


def test_the_released_models_ledger_counts_the_whole_search(tmp_path):
    """Issue 38: the released model's ledger and a PrivacyAccountant on it
    include the search, also after saving and loading it and after more DP
    training (its epsilon composed with the new updates, checked against
    dp_accounting's PLD on the same events). The ledger records the search's
    (epsilon, delta), not the number of trials."""
    from keras_dp_lm.accounting.epsilon import compose_epsilon
    from keras_dp_lm.accounting.events import EpsilonDeltaDpEvent

    x, y = toy()
    result = tuning.private_search(
        make_builder([]), x, y, target_epsilon=3.0, delta=1e-5, epochs=4.0,
        min_steps=10, candidates=[tuning.Candidate(0.1)], mean_trials=2.0, seed=5)
    ledger = ledger_of(result.model)
    assert ledger.selection_events() == [(result.epsilon, result.delta)]
    assert ledger.accounted_rows() == []  # the trial's updates: inside the search
    assert ledger.updates == result.steps
    saved = {k: v for k, v in ledger.__dict__.items() if hasattr(v, "numpy")}
    assert set(saved) == {"table", "num_rows", "limits", "poisson_seen", "violations",
                          "unit", "selection", "lineage"}  # no trial count anywhere

    result.model.save(tmp_path / "released.keras")
    model = keras.models.load_model(tmp_path / "released.keras", compile=False)
    assert ledger_of(model).selection_events() == [(result.epsilon, result.delta)]
    model.compile(optimizer=kdp.DPAdam(0.01, l2_norm_clip=1.0, noise_multiplier=1.2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = kdp.PrivacyAccountant(dataset_size=len(x), batch_size=100, delta=1e-4,
                                       sampling="shuffle", verbose=0)
    model.fit(x, y, batch_size=100, epochs=1, callbacks=[accountant], verbose=0)
    new = [r for r in ledger_of(model).accounted_rows()]
    assert sum(r[3] for r in new) == 5
    truth = compose_epsilon(
        [EpsilonDeltaDpEvent(result.epsilon, result.delta),
         dp_sgd_event(1.2, 100 / len(x), 5)], 1e-4, "pld")
    assert accountant.epsilon >= truth * (1 - 1e-9)
    assert accountant.epsilon > result.epsilon
    report = accountant.report()
    assert report["epsilon"] == accountant.epsilon and report["search"]["epsilon"] == result.epsilon


def test_an_inner_model_of_the_released_model_counts_the_search_too():
    """The trial's DP steps also record their updates in the ledger of a model
    inside the released one (saved or reused alone later): that ledger must
    carry the search as well, not the trial's updates alone."""
    x, y = toy()
    bases = []

    def build(candidate):
        base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        bases.append(base)
        return keras.Sequential([base, keras.layers.Dense(2)])

    result = tuning.private_search(
        build, x, y, target_epsilon=3.0, delta=1e-5, epochs=4.0, min_steps=10,
        candidates=[tuning.Candidate(0.1)], mean_trials=2.0, seed=5)
    base = next(b for b in bases if b is result.model.layers[0])
    assert ledger_of(base).updates == result.steps
    assert ledger_of(base).selection_events() == [(result.epsilon, result.delta)]
    assert ledger_of(base).accounted_rows() == []
