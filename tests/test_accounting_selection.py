"""Private selection (Papernot & Steinke 2022): the accounted epsilon against the
paper's formula, the formula against a brute-force Renyi divergence on a toy
mechanism, and the number of trials against its distribution."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import optimize

from keras_dp_lm.accounting import selection

ORDERS = np.array(selection.rdp_orders(), dtype=float)


def reference_gamma(shape, mean):
    """gamma of the truncated negative binomial with the given mean (the paper's
    mean formula, solved by scipy, independently of the package)."""
    if shape == 1:
        return 1 / mean

    def mean_of(gamma):
        if shape == 0:
            return (1 - gamma) / (gamma * math.log(1 / gamma)) - mean
        return shape * (1 - gamma) / (gamma * (1 - gamma ** shape)) - mean

    return optimize.brentq(mean_of, 1e-12, 1 - 1e-12, xtol=1e-15, rtol=1e-14)


def theorem_2(rdp, orders, shape, mean):
    """Papernot & Steinke, Theorem 2, at every order: eps(l) + log(mu) / (l - 1) +
    (1 + eta) min_m [(1 - 1/m) eps(m) + log(1 / gamma) / m], then monotone in l."""
    gamma = reference_gamma(shape, mean)
    constant = (1 + shape) * min((1 - 1 / m) * e + math.log(1 / gamma) / m
                                 for m, e in zip(orders, rdp))
    bound = np.array([e + math.log(mean) / (l - 1) + constant if l > 1 else np.inf
                      for l, e in zip(orders, rdp)])
    return np.array([bound[orders >= l].min() for l in orders])


def renyi(p, q, order):
    p, q = np.asarray(p, float), np.asarray(q, float)
    return math.log(np.sum(p ** order * q ** (1 - order))) / (order - 1)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("mean", [2.0, 10.0])
def test_selection_epsilon_is_theorem_2_of_the_paper(shape, mean):
    sigma, delta = 3.0, 1e-6
    trial = dp_accounting.GaussianDpEvent(sigma)
    rdp = ORDERS / (2 * sigma ** 2)  # the Gaussian mechanism's RDP, in closed form
    expected = dp_accounting.rdp.compute_epsilon(
        ORDERS, theorem_2(rdp, ORDERS, shape, mean), delta)[0]
    got = selection.selection_epsilon(trial, delta, mean, shape)
    assert got == pytest.approx(expected, rel=1e-6)
    one_run = dp_accounting.rdp.compute_epsilon(ORDERS, rdp, delta)[0]
    # one trial (mean 1) is priced at no less than one run; more trials cost more
    assert one_run <= selection.selection_epsilon(trial, delta, 1.0, 1.0) < got


def selection_output(p, count, kmax=4000):
    """Exact distribution of the best of K draws from ``p`` (scores 0..n-1,
    higher is better), K ~ count; index 0 of the result is 'no trial' (K = 0)."""
    cdf = np.cumsum(p)
    pmf = np.array([count.pmf(k) for k in range(kmax)])
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    at_most = np.array([np.sum(pmf * c ** np.arange(kmax)) for c in cdf])
    return np.concatenate([[pmf[0]], np.diff(np.concatenate([[pmf[0]], at_most]))])


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.0, math.inf])
def test_selection_bound_holds_by_brute_force_on_randomized_response(shape):
    # A trial outputs a score in {0, 1, 2}; on neighbouring data the rare best
    # score doubles in probability, so selecting the best amplifies the change.
    p, p_prime = np.array([0.6, 0.3, 0.1]), np.array([0.6, 0.2, 0.2])
    mean = 5.0
    count = selection.TrialCount(mean, shape)
    orders = ORDERS[(ORDERS > 1) & (ORDERS <= 64)]
    base = np.array([max(renyi(p, p_prime, a), renyi(p_prime, p, a)) for a in orders])
    out, out_prime = selection_output(p, count), selection_output(p_prime, count)
    keep = (out > 0) | (out_prime > 0)
    exact = np.array([max(renyi(out[keep], out_prime[keep], a),
                          renyi(out_prime[keep], out[keep], a)) for a in orders])
    assert np.any(exact > base * 1.4)  # selecting is not free: the check has teeth
    if shape == math.inf:
        # Theorem 6 through dp_accounting's implementation, on the exact base curve.
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        bound = rdp_lib._compute_rdp_repeat_and_select(orders, base, mean, shape)
    else:
        bound = theorem_2(base, orders, shape, mean)
    assert np.all(exact <= bound + 1e-12), (exact - bound).max()


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, math.inf])
def test_trial_count_draws_follow_the_accounted_distribution(shape):
    mean = 4.0
    count = selection.TrialCount(mean, shape)
    assert count.mean() <= mean * (1 + 1e-12)
    if shape not in (1.0, math.inf):
        assert count.gamma >= reference_gamma(shape, mean) * (1 - 1e-12)
        # never priced at a larger gamma than dp_accounting's (a smaller log(1/gamma))
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        assert count.gamma >= rdp_lib._gamma_truncated_negative_binomial(shape, mean)
    ks = np.arange(0, 400)
    pmf = np.array([count.pmf(k) for k in ks])
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert np.sum(ks * pmf) == pytest.approx(count.mean(), rel=1e-6)
    draws = np.array([count.sample(seed=i) for i in range(4000)])
    assert (draws.min() >= (0 if shape == math.inf else 1))
    # each k's frequency against its probability (4 standard errors)
    for k in range(0, 6):
        se = math.sqrt(pmf[k] * (1 - pmf[k]) / len(draws))
        assert abs(np.mean(draws == k) - pmf[k]) <= 4 * se + 1e-3, k
    assert isinstance(count.sample(), int)  # from OS entropy


def test_calibrated_search_noise_meets_the_target_and_is_the_smallest():
    target, delta, q, steps = 3.0, 1e-6, 0.05, 100
    sigma = selection.calibrate_search_noise(target, delta, q, steps, mean_trials=3,
                                             shape=1.0, score_noise_multiplier=20.0)

    def spent(s):
        return selection.selection_epsilon(
            selection.trial_event(s, q, steps, 20.0), delta, 3, 1.0)

    assert spent(sigma) <= target < spent(sigma * 0.998)
    # the search needs more noise than one run at the same epsilon (RDP)
    from keras_dp_lm.accounting import calibrate_noise_multiplier

    assert sigma > calibrate_noise_multiplier(target, delta, q, steps, accountant="rdp")


def test_unreachable_search_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="Lower `mean_trials`, raise the score's noise"):
        selection.calibrate_search_noise(0.05, 1e-6, 0.05, 100, mean_trials=20,
                                         score_noise_multiplier=0.5)
    with pytest.raises(ValueError, match="exact validation score"):
        selection.trial_event(1.0, 0.1, 10, score_noise_multiplier=0.0)
    with pytest.raises(ValueError, match="mean_trials"):
        selection.TrialCount(0.5)
