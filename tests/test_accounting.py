"""Privacy accounting: functions against dp_accounting, and the PrivacyAccountant callback."""

import csv
import math
import os
import subprocess
import sys
import textwrap

import dp_accounting
import keras
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
import numpy as np
import tensorflow as tf
import pytest

import keras_dp_lm as kdp
from keras_dp_lm import accounting
from keras_dp_lm.accounting.epsilon import EXACT_CURVE_BELOW_DELTA
from keras_dp_lm.callbacks import PrivacyAccountant
from keras_dp_lm.accounting import PrivacyBudgetExhaustedError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def direct_epsilon(sigma, q, steps, delta, name):
    """dp_accounting called directly, as its README does."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    acc = (dp_accounting.rdp.RdpAccountant() if name == "rdp"
           else dp_accounting.pld.PLDAccountant())
    return acc.compose(event).get_epsilon(delta)


def direct_pld_epsilons(sigma, q, steps, delta):
    """``[direct_epsilon(sigma, q, n, delta, "pld") for n in steps]`` computed as
    PLDAccountant computes each (its default discretization, the one-update PLD
    self-composed n times, composed into the identity), with the one-update PLD
    built once instead of once per n: the same values to the last bit."""
    one = pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=1e-4, sampling_prob=q,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    identity = pld_lib.identity(value_discretization_interval=1e-4)
    return [identity.compose(one.self_compose(n)).get_epsilon_for_delta(delta) for n in steps]


def test_direct_pld_epsilons_are_pld_accountants():
    assert direct_pld_epsilons(1.0, 0.125, [1, 5], 1e-3) == [
        direct_epsilon(1.0, 0.125, n, 1e-3, "pld") for n in (1, 5)]


SETTINGS = [  # sigma, q, steps, delta
    (1.1, 256 / 60000, 1000, 1e-5),
    (0.8, 0.01, 500, 1e-6),
    (2.0, 0.1, 50, 1e-5),
    (4.0, 1.0, 3, 1e-3),               # full batch
]


# --------------------------------------------------------------------------
# functions
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_compute_epsilon_equals_dp_accounting(name):
    for sigma, q, steps, delta in SETTINGS if name == "rdp" else SETTINGS[::2] + SETTINGS[3:]:
        ours = accounting.compute_epsilon(sigma, q, steps, delta, accountant=name)
        assert ours == direct_epsilon(sigma, q, steps, delta, name)
        # The cached curve used by max_steps and the callback: same numbers.
        curve = accounting.epsilon.EpsilonCurve(sigma, q, delta, name)
        assert curve(steps) == ours
        assert 0 < ours < math.inf


def test_known_values_and_pld_tighter():
    # MNIST setting of Abadi et al. 2016 (q=256/60000, sigma=1.1, 60 epochs).
    rdp = accounting.compute_epsilon(1.1, 256 / 60000, 14100, 1e-5, "rdp")
    pld = accounting.compute_epsilon(1.1, 256 / 60000, 14100, 1e-5, "pld")
    assert rdp == pytest.approx(2.6, abs=0.05)
    assert pld == pytest.approx(2.39, abs=0.05)
    assert pld < rdp
    assert accounting.compute_epsilon(1.0, 0.5, 0, 1e-5) == 0.0
    assert accounting.compute_epsilon(0.0, 0.5, 1, 1e-5) == math.inf


BAD_CALLS = [
    (lambda: accounting.compute_epsilon(-1, 0.1, 10, 1e-5), "noise_multiplier"),
    (lambda: accounting.compute_epsilon(1, 0, 10, 1e-5), "sampling_rate"),
    (lambda: accounting.compute_epsilon(1, 1.5, 10, 1e-5), "sampling_rate"),
    (lambda: accounting.compute_epsilon(1, 0.1, -1, 1e-5), "steps"),
    (lambda: accounting.compute_epsilon(1, 0.1, 2.5, 1e-5), "steps"),
    (lambda: accounting.compute_epsilon(1, 0.1, 10, 0), "delta"),
    (lambda: accounting.compute_epsilon(1, 0.1, 10, 1.0), "delta"),
    (lambda: accounting.compute_epsilon(1, 0.1, 10, 1e-5, accountant="gdp"), "accountant"),
    (lambda: accounting.calibrate_noise_multiplier(0, 1e-5, 0.1, 10), "target_epsilon"),
    (lambda: accounting.calibrate_noise_multiplier(1, 1e-5, 0.1, 0), "steps"),
    (lambda: accounting.max_steps(-1, 1e-5, 1.0, 0.1), "target_epsilon"),
    (lambda: accounting.max_steps(1, 1e-5, "a", 0.1), "noise_multiplier"),
    (lambda: accounting.compose_epsilon([(1.0, 0.0)], 1e-5, accountant="rdp"), "PLD"),
    (lambda: accounting.compose_epsilon(["x"], 1e-5), "DpEvent"),
    (lambda: accounting.compose_epsilon([(-1.0, 0.0)], 1e-5), "epsilon"),
    (lambda: accounting.user_level_epsilon(1, 0.1, 10, 1e-5, 0), "examples_per_user"),
    (lambda: accounting.user_level_epsilon(1, 0.1, 10, 1e-5, 2, method="x"), "method"),
]


def test_bad_arguments():
    # one test (not parametrized): each test case pays a Keras session teardown
    for call, message in BAD_CALLS:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("name, target, q, steps", [
    ("rdp", 2.0, 0.01, 1000),
    ("rdp", 8.0, 0.004, 5000),
    ("pld", 1.0, 0.1, 50),
])
def test_calibrate_noise_multiplier(name, target, q, steps):
    sigma = accounting.calibrate_noise_multiplier(target, 1e-5, q, steps, accountant=name)
    assert accounting.compute_epsilon(sigma, q, steps, 1e-5, name) <= target
    assert accounting.compute_epsilon(0.99 * sigma, q, steps, 1e-5, name) > target
    # default rtol=1e-3: within 0.1% of the smallest noise that meets the target
    assert accounting.compute_epsilon(sigma / 1.001, q, steps, 1e-5, name) > target


def test_calibrate_with_extra_events_against_dp_accounting():
    # The demo's case: a DP vocabulary (1.0, 5e-7) and training share a total
    # budget (8.0, 1e-6) in one PLD accountant.
    q, steps, vocab = 1024 / 69801, 200, (1.0, 5e-7)
    sigma = accounting.calibrate_noise_multiplier(8.0, 1e-6, q, steps, extra_events=[vocab])

    def direct(s):
        acc = dp_accounting.pld.PLDAccountant()
        acc.compose(accounting.dp_sgd_event(s, q, steps))
        acc._pld = acc._pld.compose(pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(*vocab)))
        return acc.get_epsilon(1e-6)

    assert direct(sigma) <= 8.0 < direct(sigma / 1.001)
    assert direct(sigma) == accounting.compose_epsilon(
        [accounting.dp_sgd_event(sigma, q, steps), vocab], 1e-6)
    # The vocabulary's share is not free: more noise than for training alone.
    assert sigma > accounting.calibrate_noise_multiplier(8.0, 1e-6, q, steps)
    with pytest.raises(ValueError, match="extra events alone"):
        accounting.calibrate_noise_multiplier(1.0, 1e-6, q, steps, extra_events=[(1.5, 0.0)])
    with pytest.raises(ValueError, match="PLD"):
        accounting.calibrate_noise_multiplier(8.0, 1e-6, q, steps, accountant="rdp",
                                              extra_events=[vocab])


def test_one_step_pld_is_dp_accountings():
    # The vectorized construction builds the very PLD dp_accounting builds.
    for sigma, q in [(1.0, 0.125), (0.7, 0.01), (4.0, 1.0), (20.0, 0.01)]:
        ours = accounting._pld.gaussian_pld(sigma, q)
        theirs = pld_lib.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q)
        assert ours._symmetric == theirs._symmetric
        for a, b in [(ours._pmf_remove, theirs._pmf_remove), (ours._pmf_add, theirs._pmf_add)]:
            assert type(a) is type(b) and a._infinity_mass == b._infinity_mass
            if hasattr(a, "_probs"):
                assert a._lower_loss == b._lower_loss and np.array_equal(a._probs, b._probs)
            else:
                assert a._loss_probs == b._loss_probs


@pytest.mark.parametrize("extra", [None, "gaussian", "pair"])
def test_epsilon_curve_equals_dp_accounting(extra):
    sigma, q, delta = 0.9, 0.02, 1e-6
    steps = [0, 1, 37, 200, 500]
    extras = {None: [], "gaussian": [dp_accounting.GaussianDpEvent(5.0)],
              "pair": [(1.0, 5e-7)]}[extra]
    curve = accounting.epsilon_curve(sigma, q, steps, delta, extra_events=extras)
    base = pld_lib.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q)
    for k, value in zip(steps, curve):
        acc = dp_accounting.pld.PLDAccountant()
        if k in (37, 500):  # the accountant itself
            acc.compose(accounting.dp_sgd_event(sigma, q, k))
        elif k:  # its arithmetic, one-step PLD built once
            acc._pld = acc._pld.compose(base.self_compose(k))
        if extra == "gaussian":
            acc.compose(extras[0])
        elif extra == "pair":
            acc._pld = acc._pld.compose(pld_lib.from_privacy_parameters(
                pld_common.DifferentialPrivacyParameters(*extras[0])))
        # An upper bound on the accountant's value, read at a delta 1e-11 lower.
        reference = acc.get_epsilon(delta)
        assert reference <= value <= reference * (1 + 3e-6) + 1e-12, k
    assert curve == sorted(curve) and curve[-1] > curve[0]
    if extra is None:
        assert curve[0] == 0.0
    # RDP: the accountant's own sums, exactly.
    if extra != "pair":
        rdp = accounting.epsilon_curve(sigma, q, steps, delta, extra_events=extras,
                                       accountant="rdp")
        assert rdp == [accounting.compose_epsilon(
            [accounting.dp_sgd_event(sigma, q, k)] + extras, delta, "rdp") for k in steps]


@pytest.mark.parametrize("sigma, q, steps, delta", [
    (0.8, 0.02, 3000, 1e-10),   # the fast curve at delta itself is 8.9e-5 relative low
    (0.55, 0.012, 1000, 1e-10),  # ... 2.7e-5 low
    (0.5, 0.005, 1000, 1e-10),  # ... 2.2e-5 low
    (2.0, 0.1, 300, 1e-12),     # below 1e-10: the accountant's own value
])
def test_epsilon_curve_bounds_dp_accounting_at_small_delta(sigma, q, steps, delta):
    # FFT round-off (ours and dp_accounting's) is ~1e-12 in delta: a curve read
    # at delta itself can fall below what the accountant reports.
    [value] = accounting.epsilon_curve(sigma, q, [steps], delta)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(accounting.dp_sgd_event(sigma, q, steps))
    reference = acc.get_epsilon(delta)
    assert reference <= value <= reference * 1.005
    if delta < EXACT_CURVE_BELOW_DELTA:
        assert value == pytest.approx(reference, rel=1e-12)


def test_epsilon_curve_arguments():
    with pytest.raises(ValueError, match="list of step counts"):
        accounting.epsilon_curve(1.0, 0.01, 100, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        accounting.epsilon_curve(1.0, 0.01, [10, -1], 1e-5)
    with pytest.raises(ValueError, match="PLD"):
        accounting.epsilon_curve(1.0, 0.01, [10], 1e-5, extra_events=[(1.0, 0.0)],
                                 accountant="rdp")
    assert accounting.epsilon_curve(0.0, 0.01, [0, 3], 1e-5) == [0.0, math.inf]
    assert accounting.epsilon_curve(1.0, 0.01, [], 1e-5) == []


@pytest.mark.parametrize("name, target, sigma, q, delta", [
    ("rdp", 2.0, 1.0, 0.01, 1e-5),
    ("rdp", 0.5, 5.0, 0.2, 1e-5),
    ("pld", 3.0, 1.0, 0.125, 1e-3),  # the callback tests' setting (cached)
])
def test_max_steps_is_exact(name, target, sigma, q, delta):
    n = accounting.max_steps(target, delta, sigma, q, accountant=name)
    assert n > 0
    assert accounting.compute_epsilon(sigma, q, n, delta, name) <= target
    assert accounting.compute_epsilon(sigma, q, n + 1, delta, name) > target


def test_max_steps_edge_cases():
    assert accounting.max_steps(1.0, 1e-5, 0.0, 0.1, "rdp") == 0   # no noise
    assert accounting.max_steps(0.01, 1e-5, 0.5, 1.0, "rdp") == 0  # one step too many
    # 1000 steps of sigma=1, q=0.01 -> eps(rdp) = 2.10137
    assert accounting.max_steps(2.1013, 1e-5, 1.0, 0.01, "rdp") == 999
    assert accounting.max_steps(2.1014, 1e-5, 1.0, 0.01, "rdp") == 1000


def test_composition_of_extras():
    train = accounting.dp_sgd_event(2.0, 0.1, 50)
    alone = accounting.compose_epsilon([train], 1e-5)
    assert alone == accounting.compute_epsilon(2.0, 0.1, 50, 1e-5, "pld")
    vocab = dp_accounting.GaussianDpEvent(10.0)  # e.g. a DP vocabulary's histogram
    both = accounting.compose_epsilon([train, vocab], 1e-5)
    assert alone < both < alone + accounting.compose_epsilon([vocab], 1e-5)
    # A pure (1, 0) release composes to at most 1 and two of them to at most 2.
    assert 0.9 < accounting.compose_epsilon([(1.0, 0.0)], 1e-5) <= 1.0 + 1e-4
    assert accounting.compose_epsilon([(1.0, 0.0), (1.0, 0.0)], 1e-5) <= 2.0 + 1e-4
    # RDP composes DpEvents too.
    rdp_both = accounting.compose_epsilon([train, vocab], 1e-5, accountant="rdp")
    direct = dp_accounting.rdp.RdpAccountant().compose(train).compose(vocab).get_epsilon(1e-5)
    assert rdp_both == direct


def test_report_total_and_sum():
    vocab = dp_accounting.GaussianDpEvent(10.0)
    report = accounting.privacy_report(2.0, 0.1, 50, 1e-5,
                                       extra_events=[vocab, (0.5, 1e-6)],
                                       dataset_size=1000, batch_size=100)
    train_eps = accounting.compute_epsilon(2.0, 0.1, 50, 1e-5, "pld")
    vocab_eps = accounting.compose_epsilon([vocab], 1e-5)
    assert report["epsilon"] == report["epsilon_pld"] == train_eps
    assert report["epsilon_rdp"] == accounting.compute_epsilon(2.0, 0.1, 50, 1e-5, "rdp")
    assert report["sum_epsilon"] == pytest.approx(train_eps + vocab_eps + 0.5)
    assert report["sum_delta"] == pytest.approx(1e-5 + 1e-5 + 1e-6)
    # the total: at the delta asked for, plus the pair's own (before, the
    # composed DpEvent added a delta of its own, so the total was printed at 2x)
    assert report["total_delta"] == pytest.approx(1e-5 + 1e-6)
    assert report["total_accountant"] == "pld"
    assert report["total_epsilon"] == accounting.compose_epsilon(
        [accounting.dp_sgd_event(2.0, 0.1, 50), vocab, (0.5, 1e-6)], report["total_delta"])
    assert report["total_epsilon"] < report["sum_epsilon"]
    assert report["epochs"] == pytest.approx(5.0)
    assert [row["epsilon"] for row in report["extras"]] == [vocab_eps, 0.5]
    text = accounting.privacy_statement(report)
    assert "noise multiplier 2" in text and "50 noised updates" in text
    assert f"epsilon = {accounting.report.format_epsilon(train_eps)}" in text
    assert f"epsilon = {accounting.report.format_epsilon(report['total_epsilon'])}" in text
    # rounded up, never down
    assert accounting.report.format_epsilon(2.3824) == "2.39" and accounting.report.format_epsilon(2.38) == "2.38"
    assert accounting.report.format_epsilon(0.012341) == "0.0124" and accounting.report.format_epsilon(math.inf) == "inf"
    assert "simple sum of epsilons" in text


def test_user_level_epsilon():
    example = accounting.compute_epsilon(1.0, 0.01, 1000, 1e-5, "rdp")
    assert accounting.user_level_epsilon(1.0, 0.01, 1000, 1e-5, 1, "group", "rdp") == example
    # user sampling: sensitivity k*C, i.e. noise multiplier sigma / k
    assert accounting.user_level_epsilon(1.0, 0.01, 1000, 1e-5, 3, "user_sampling", "rdp") == \
        accounting.compute_epsilon(1.0 / 3, 0.01, 1000, 1e-5, "rdp")
    # group privacy: k * eps(delta') with delta' * sum_{i<k} e^{i eps} <= delta
    group2 = accounting.user_level_epsilon(1.0, 0.01, 1000, 1e-5, 2, "group", "rdp")
    assert group2 == pytest.approx(4.945, abs=1e-3)
    eps_prime = group2 / 2
    rdp = dp_accounting.rdp.RdpAccountant().compose(accounting.dp_sgd_event(1.0, 0.01, 1000))
    # the delta' it used: the one whose epsilon is eps_prime; group delta <= 1e-5
    delta_prime = rdp.get_delta(eps_prime)
    assert delta_prime * (1 + math.exp(eps_prime)) <= 1e-5 * (1 + 1e-6)
    assert 2 * example < group2
    group4 = accounting.user_level_epsilon(1.0, 0.01, 1000, 1e-5, 4, "group", "rdp")
    assert group4 > 2 * group2


# --------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------
N, B = 64, 8
X = np.random.RandomState(0).randn(N, 4).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def make_model(noise=1.0, spe=1, accumulation=1, optimizer=None, **kwargs):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    if optimizer is None:
        optimizer = kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=noise,
                              gradient_accumulation_steps=accumulation, seed=0, **kwargs)
    model.compile(optimizer=optimizer, steps_per_execution=spe,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_callback_arguments():
    with pytest.raises(ValueError, match="delta"):
        PrivacyAccountant(dataset_size=N)
    with pytest.raises(ValueError, match="dataset_size"):
        PrivacyAccountant(delta=1e-5)
    with pytest.raises(ValueError, match="sampling"):
        PrivacyAccountant(delta=1e-5, dataset_size=N, sampling="random")
    with pytest.raises(ValueError, match="extra event"):
        PrivacyAccountant(delta=1e-5, dataset_size=N, extra_events=[(1.0, 2.0)])
    with pytest.warns(UserWarning, match="delta=0.05 >= 1/dataset_size"):
        PrivacyAccountant(delta=0.05, dataset_size=N)


def test_refuses_non_dp_optimizer():
    model = make_model(optimizer=keras.optimizers.SGD(0.1))
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, batch_size=B)
    with pytest.raises(ValueError, match="needs a model compiled with a DP optimizer"):
        model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)


@pytest.mark.parametrize("name, spe, accumulation", [
    ("rdp", 1, 1), ("rdp", 4, 1), ("rdp", 1, 2), ("pld", 3, 2),
])
def test_stops_before_target(name, spe, accumulation):
    model = make_model(spe=spe, accumulation=accumulation)
    target = 3.0
    accountant = PrivacyAccountant(target_epsilon=target, delta=1e-3, dataset_size=N,
                                   batch_size=B, sampling="shuffle", accountant=name,
                                   verbose=0)
    with pytest.warns(UserWarning, match="shuffled fixed-size batches"):
        history = model.fit(X, Y, batch_size=B, epochs=20, callbacks=[accountant], verbose=0)
    q = B / N
    limit = accountant.max_steps  # exact: eps(limit) <= target < eps(limit + 1)
    assert limit == {"rdp": 15, "pld": 25}[name]
    count = int(model.optimizer.dp_updates.numpy())
    assert accountant.dp_updates == count == accountant.stopped_at
    # Stopped before the next execution (spe updates) could exceed the target...
    assert count <= limit < count + spe
    if spe == 1:
        assert count == limit
    assert accounting.compute_epsilon(1.0, q, limit, 1e-3, name) <= target
    assert accounting.compute_epsilon(1.0, q, limit + 1, 1e-3, name) > target
    # ...and the logs show the chosen accountant's epsilon at the epoch end.
    assert history.history["epsilon"][-1] == accounting.compute_epsilon(1.0, q, count, 1e-3, name)
    assert history.history["epsilon"][-1] <= target
    assert len(history.history["epsilon"]) == math.ceil(count / (N // B))
    # A further fit is refused before any update.
    with pytest.raises(PrivacyBudgetExhaustedError, match=f"allows {limit}"):
        model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    assert int(model.optimizer.dp_updates.numpy()) == count


def test_epsilon_in_logs_csv_and_progress_bar(tmp_path, capsys):
    model = make_model()
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, batch_size=B,
                                   sampling="poisson", accountant="pld")
    batch_eps = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_eps.append(logs["epsilon"]))
    csv_path = tmp_path / "log.csv"
    history = model.fit(X, Y, batch_size=B, epochs=2, verbose=1,
                        callbacks=[accountant, record, keras.callbacks.CSVLogger(str(csv_path))])
    q = B / N
    expected = [accounting.compute_epsilon(1.0, q, n, 1e-3, "pld") for n in (8, 16)]
    assert history.history["epsilon"] == expected
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["epsilon"]) for r in rows] == pytest.approx(expected, rel=1e-12)
    # Per batch: the same (PLD) accountant, an upper bound on the epsilon of the
    # updates applied so far, never decreasing, exact at the last batch; never RDP.
    exact = direct_pld_epsilons(1.0, q, range(1, 17), 1e-3)
    rdp = [accounting.compute_epsilon(1.0, q, n, 1e-3, "rdp") for n in range(1, 17)]
    assert all(e <= b < r for e, b, r in zip(exact, batch_eps, rdp))
    assert batch_eps == sorted(batch_eps)
    assert batch_eps[-1] == expected[-1]
    assert "epsilon: " in capsys.readouterr().out
    report = accountant.report()
    assert report["dp_updates"] == report["steps"] == 16
    assert report["sampling"] == "poisson" and report["sampling_source"] == "argument"
    assert report["epsilon"] == expected[-1]
    assert report["l2_norm_clip"] == 1.0


def test_batch_size_inference_and_check():
    model = make_model()
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, accountant="rdp")
    with pytest.warns(UserWarning, match="inferred the logical batch size 8"):
        model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    assert accountant.sampling_rate == B / N
    # A real batch larger than assumed would under-report epsilon: refused.
    model = make_model()
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, batch_size=4,
                                   accountant="rdp", sampling="poisson")
    before = [w.numpy() for w in model.trainable_variables]
    with pytest.raises(kdp.PrivacyRefusalError, match="refused a batch"):
        model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    # refused before the update: nothing applied, nothing counted
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.trainable_variables))
    assert kdp.ledger_of(model).updates == 0
    # expected_batch_size on the optimizer is used and means Poisson sampling.
    model = make_model(expected_batch_size=8)
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, accountant="rdp")
    model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    report = accountant.report()
    assert report["batch_size"] == 8 and report["batch_size_source"] == "optimizer.expected_batch_size"
    assert report["sampling"] == "poisson"


def test_ledger_across_fits_and_reloaded_model(tmp_path):
    model = make_model()
    kwargs = dict(target_epsilon=4.0, delta=1e-3, dataset_size=N, batch_size=B,
                  accountant="rdp", sampling="poisson", verbose=0)
    accountant = PrivacyAccountant(**kwargs)
    model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    assert accountant.dp_updates == 16
    assert accountant.epsilon == accounting.compute_epsilon(1.0, B / N, 16, 1e-3, "rdp")
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    assert int(reloaded.optimizer.dp_updates.numpy()) == 16
    fresh = PrivacyAccountant(**kwargs)  # a new process would have a new callback
    history = reloaded.fit(X, Y, batch_size=B, epochs=10, callbacks=[fresh], verbose=0)
    limit = accounting.max_steps(4.0, 1e-3, 1.0, B / N, "rdp")
    assert fresh.dp_updates == limit  # counted from 16, not from 0
    assert history.history["epsilon"][0] == accounting.compute_epsilon(1.0, B / N, 24, 1e-3, "rdp")


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, keras, keras_dp_lm as kdp
    from keras_dp_lm.callbacks import PrivacyAccountant
    keras.utils.set_random_seed(0)
    X = np.random.RandomState(0).randn(64, 4).astype("float32")
    Y = (X[:, 0] > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.dp_updates.numpy() == 13:   # epoch 2, batch 5
                os._exit(17)

    model.fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(sys.argv[1]),
        PrivacyAccountant(delta=1e-3, dataset_size=64, batch_size=8, accountant="rdp",
                          sampling="poisson"),
        Crash()])
""")


def test_crash_and_resume_counts_like_uninterrupted_run(tmp_path):
    backup = str(tmp_path / "backup")
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    result = subprocess.run([sys.executable, str(script), backup], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 17, result.stderr[-2000:]
    assert os.path.isdir(backup)

    def run(callbacks):
        keras.utils.set_random_seed(0)
        model = make_model()
        accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, batch_size=B,
                                       accountant="rdp", sampling="poisson")
        history = model.fit(X, Y, batch_size=B, epochs=3, verbose=0,
                            callbacks=callbacks + [accountant])
        return model, accountant, history

    # Resume: the backup holds the end of epoch 1 (8 updates); 5 updates of the
    # crashed epoch were lost with the process and are not in the saved ledger.
    resumed, resumed_acc, resumed_history = run([keras.callbacks.BackupAndRestore(backup)])
    plain, plain_acc, plain_history = run([])
    assert int(resumed.optimizer.dp_updates.numpy()) == 24
    assert resumed_acc.dp_updates == plain_acc.dp_updates == 24
    assert resumed_acc.epsilon == plain_acc.epsilon == \
        accounting.compute_epsilon(1.0, B / N, 24, 1e-3, "rdp")
    assert len(resumed_history.history["epsilon"]) == 2  # epochs 2 and 3 only
    assert resumed_history.history["epsilon"] == plain_history.history["epsilon"][1:]


def test_resume_near_the_budget_is_refused_after_restore(tmp_path):
    # BackupAndRestore restores dp_updates during on_train_begin, possibly after
    # the accountant's own on_train_begin: the check before the first batch
    # must still see the restored ledger.
    backup = str(tmp_path / "backup")
    limit = accounting.max_steps(3.0, 1e-3, 1.0, B / N, "rdp")  # 15
    model = make_model()
    model.fit(X, Y, batch_size=B, epochs=2, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    assert int(model.optimizer.dp_updates.numpy()) == 16 > limit
    fresh = make_model()
    accountant = PrivacyAccountant(target_epsilon=3.0, delta=1e-3, dataset_size=N,
                                   batch_size=B, accountant="rdp", sampling="poisson")
    with pytest.raises(PrivacyBudgetExhaustedError, match="applied 16 noised updates"):
        fresh.fit(X, Y, batch_size=B, epochs=4, verbose=0,
                  callbacks=[accountant, keras.callbacks.BackupAndRestore(backup)])
    assert int(fresh.optimizer.dp_updates.numpy()) == 16


def test_statement_and_extras_on_callback():
    model = make_model()
    vocab = dp_accounting.GaussianDpEvent(20.0)
    accountant = PrivacyAccountant(delta=1e-3, dataset_size=N, batch_size=B,
                                   accountant="rdp", sampling="poisson",
                                   extra_events=[vocab, (0.2, 0.0)], examples_per_user=2)
    model.fit(X, Y, batch_size=B, epochs=1, callbacks=[accountant], verbose=0)
    report = accountant.report()
    assert report["total_epsilon"] == accounting.compose_epsilon(
        [accounting.dp_sgd_event(1.0, B / N, 8), vocab, (0.2, 0.0)], report["total_delta"])
    assert report["total_delta"] == pytest.approx(1e-3)  # the delta asked for
    assert report["sum_epsilon"] == pytest.approx(
        report["epsilon"] + accounting.compose_epsilon([vocab], 1e-3, "rdp") + 0.2)
    assert report["user_level_epsilon"] == accounting.user_level_epsilon(
        1.0, B / N, 8, 1e-3, 2, "group", "rdp")
    text = accountant.statement()  # same report (cached per ledger count)
    assert text == accounting.privacy_statement(report)
    assert "8 noised updates" in text and "logical batch 8 of 64 examples" in text
    assert "Poisson sampling" in text and "at most 2 examples" in text


def test_calibration_with_a_strong_extra_release_falls_back_instead_of_crashing():
    """Review finding: with a GaussianDpEvent(3.0) release at q=1e-3 the fast-curve
    search probed tiny noise and crashed (math domain / overflow / 79 GiB)."""
    import dp_accounting

    from keras_dp_lm import accounting

    extra = dp_accounting.GaussianDpEvent(3.0)
    sigma = accounting.calibrate_noise_multiplier(3.0, 1e-6, 0.001, 10, extra_events=[extra])
    assert accounting.compose_epsilon(
        [accounting.dp_sgd_event(sigma, 0.001, 10), extra], 1e-6) <= 3.0


@pytest.mark.parametrize("n,q,steps", [(1000, 0.02, 10**6), (20, 0.9, 100), (60000, 256 / 60000, 2000),
                                       (10**7, 1e-4, 10**6)])
def test_the_closed_form_poisson_cap_bounds_the_exact_tail(n, q, steps):
    """The accountant's Poisson cap (Bernstein, O(1); the exact search took 69 s at
    N = 1e6) is never below the exact one at the same probability."""
    from keras_dp_lm.accounting.overflow import overflow_probability
    from keras_dp_lm.accounting.overflow import poisson_count_cap
    from keras_dp_lm.accounting.overflow import suggest_max_batch_size

    cap = poisson_count_cap(n, q, steps, 1e-9)
    assert cap == n + 1 or overflow_probability(n + 1, q, cap, steps) <= 1e-9
    if n <= 10**5:  # the exact search is slow beyond
        assert cap >= suggest_max_batch_size(n, q, steps, 1e-9)
