"""Private selection: run a DP trial a random number of times, release the best.

A hyperparameter search on private data is a mechanism too. Running ``k``
trials and keeping the best costs, by plain composition, ``k`` times a trial.
Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Renyi differential
privacy") show that when the number of trials ``K`` is itself random, drawn
independently of the data from a truncated negative binomial (geometric,
logarithmic) or Poisson distribution, and only the best trial's output is
released, the whole search costs a small constant times one trial: Theorem 2
(truncated negative binomial, shape ``eta`` and mean ``mu``) bounds its
Renyi DP at order ``lambda`` by

    eps(lambda) + (1 + eta) (1 - 1/l) eps(l) + (1 + eta) log(1/gamma) / l
                + log(mu) / (lambda - 1)

for every other order ``l``. ``dp_accounting`` implements the bound
(``RepeatAndSelectDpEvent``, RDP accountant only); this module builds the
events, draws ``K``, and calibrates a trial's noise so that the whole search
meets a target epsilon.

What the bound covers, and what it does not:

* Only the **best** trial is released: its output (model, hyperparameters,
  noisy score). The number of trials run and the other trials' scores are
  not covered and must stay hidden (conditioned on ``K``, best-of-``K`` is
  only as private as ``K`` trials composed).
* Every trial is the same randomized mechanism: the candidate is drawn at
  random (data-independently) inside the trial, and every candidate uses the
  same noise, sampling rate and number of steps, so each trial has the event
  given here.
* ``K`` is drawn from OS entropy unless a seed is given.

Example:
    >>> from keras_dp_lm.accounting import dp_sgd_event, selection
    >>> from dp_accounting import ComposedDpEvent, GaussianDpEvent
    >>> trial = ComposedDpEvent([dp_sgd_event(1.2, 0.05, 100), GaussianDpEvent(10.0)])
    >>> one = selection.selection_epsilon(trial, 1e-6, mean_trials=1, shape=1)
    >>> five = selection.selection_epsilon(trial, 1e-6, mean_trials=5, shape=1)
    >>> one < five < 5 * one
    True
"""

from __future__ import annotations

import math
import random

import dp_accounting
from dp_accounting import dp_event

from keras_dp_lm.accounting._arguments import MAX_NOISE
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting._arguments import check_number
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import make_accountant

__all__ = ["TrialCount", "selection_event", "selection_epsilon", "trial_event",
           "calibrate_search_noise", "calibrate_score_noise"]

POISSON = math.inf
# Bisection tolerance on gamma (relative), as dp_accounting's.
_GAMMA_TOLERANCE = 1e-12


def _check_shape(shape):
    shape = check_number("shape", shape)
    if not shape >= 0:
        raise ValueError(
            "`shape` must be >= 0 (0 logarithmic, 1 geometric, (0, inf) truncated "
            f"negative binomial, math.inf Poisson), got {shape!r}.")
    return shape


def _check_mean(mean_trials):
    mean_trials = check_number("mean_trials", mean_trials)
    if not 1 <= mean_trials < math.inf:
        raise ValueError(f"`mean_trials` must be finite and >= 1, got {mean_trials!r}.")
    return mean_trials


class TrialCount:
    """The distribution of the number of trials ``K`` (Papernot & Steinke).

    ``shape`` 0 is the logarithmic distribution, 1 the geometric, any other
    positive value the truncated negative binomial (all on ``K >= 1``), and
    ``math.inf`` the Poisson (which can draw ``K = 0``: then nothing is
    released). For a finite shape the success probability ``gamma`` is chosen
    so that the mean is at most ``mean_trials`` (within 1e-12), with
    ``gamma`` no smaller than the one ``dp_accounting`` prices the bound at,
    so the accounted bound covers the draws.

    Example:
        >>> count = TrialCount(mean_trials=4, shape=1)
        >>> count.gamma, round(count.mean(), 6)
        (0.25, 4.0)
        >>> count.sample(seed=0) >= 1
        True
    """

    def __init__(self, mean_trials: float, shape: float = 1.0) -> None:
        self.mean_trials = _check_mean(mean_trials)
        self.shape = _check_shape(shape)
        self.gamma = None if self.shape == POISSON else self._solve_gamma()

    # -- the truncated negative binomial ------------------------------------
    def _tnb_mean(self, gamma):
        if gamma >= 1:
            return 1.0
        eta = self.shape
        log_gamma = math.log(gamma)
        if eta == 0:  # logarithmic: (1 - gamma) / (gamma log(1 / gamma))
            return (1 - gamma) / (gamma * -log_gamma)
        # eta (1 - gamma) / (gamma (1 - gamma^eta))
        return eta * (1 - gamma) / (gamma * -math.expm1(eta * log_gamma))

    def _solve_gamma(self):
        if self.shape == 1:
            return 1.0 / self.mean_trials
        low, high = 0.0, 1.0  # mean(low) = inf >= target >= 1 = mean(high)
        while high - low > _GAMMA_TOLERANCE * high:
            mid = (low + high) / 2
            if self._tnb_mean(mid) > self.mean_trials:
                low = mid
            else:
                high = mid
        return high  # mean(high) <= mean_trials

    def mean(self) -> float:
        """E[K] of the distribution drawn from."""
        return self.mean_trials if self.shape == POISSON else self._tnb_mean(self.gamma)

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if k < 0 or int(k) != k:
            return 0.0
        k = int(k)
        if self.shape == POISSON:
            mu = self.mean_trials
            return math.exp(k * math.log(mu) - mu - math.lgamma(k + 1))
        if k == 0:
            return 0.0
        gamma, eta = self.gamma, self.shape
        if gamma >= 1:
            return 1.0 if k == 1 else 0.0
        log_gamma = math.log(gamma)
        # (1 - gamma)^k / (gamma^-eta - 1) * prod_{l < k} (l + eta) / (l + 1)
        if eta == 0:
            log_norm = math.log(-log_gamma)  # the limit of (gamma^-eta - 1) / eta
            log_prod = -math.log(k)
        else:
            log_norm = math.log(math.expm1(-eta * log_gamma) / eta)
            # prod_{l<k} (l + eta) / (l + 1) = Gamma(k + eta) / (Gamma(eta) k!); the
            # eta taken out of the normaliser turns Gamma(eta) into Gamma(eta + 1).
            log_prod = math.lgamma(k + eta) - math.lgamma(eta + 1) - math.lgamma(k + 1)
        return math.exp(k * math.log1p(-gamma) + log_prod - log_norm)

    def sample(self, seed: int | None = None) -> int:
        """One draw of ``K`` (inverse CDF), from OS entropy unless ``seed`` is given."""
        rng = random.SystemRandom() if seed is None else random.Random(seed)
        u = rng.random()
        k, total = (0, 0.0) if self.shape == POISSON else (1, 0.0)
        while True:
            total += self.pmf(k)
            if u < total or k > 10**7:
                return k
            k += 1


def trial_event(noise_multiplier: float, sampling_rate: float, steps: int,
                score_noise_multiplier: float | None = None) -> dp_accounting.DpEvent:
    """The ``DpEvent`` of one trial: ``steps`` DP-SGD updates and, when
    ``score_noise_multiplier`` is given, one Gaussian release of its validation
    score (sensitivity 1: a sum of per-example scores in [0, 1]).

    Example:
        >>> trial_event(1.0, 0.01, 100, score_noise_multiplier=5.0).events[1]
        GaussianDpEvent(noise_multiplier=5.0)
    """
    training = dp_sgd_event(noise_multiplier, sampling_rate, steps)
    if score_noise_multiplier is None:
        return training
    score = check_noise(score_noise_multiplier, "score_noise_multiplier")
    if score == 0:
        raise ValueError("`score_noise_multiplier` must be > 0: an exact validation score "
                         "is not differentially private.")
    return dp_event.ComposedDpEvent([training, dp_event.GaussianDpEvent(score)])


def selection_event(trial: dp_accounting.DpEvent, mean_trials: float,
                    shape: float = 1.0) -> dp_accounting.dp_event.RepeatAndSelectDpEvent:
    """``RepeatAndSelectDpEvent``: ``K`` runs of ``trial`` (``E[K] = mean_trials``,
    distribution ``shape``), only the best released."""
    if not isinstance(trial, dp_event.DpEvent):
        raise ValueError(f"`trial` must be a dp_accounting.DpEvent, got {trial!r}.")
    return dp_event.RepeatAndSelectDpEvent(trial, _check_mean(mean_trials),
                                           _check_shape(shape))


def selection_epsilon(trial: dp_accounting.DpEvent, delta: float, mean_trials: float,
                      shape: float = 1.0) -> float:
    """Epsilon of the whole search (``dp_accounting``'s RDP accountant, the only one
    that composes private selection), at ``delta``, add/remove-one adjacency."""
    delta = check_delta(delta)
    acc = make_accountant("rdp")
    event = selection_event(trial, mean_trials, shape)
    if not acc.supports(event):
        raise ValueError(f"The RDP accountant cannot compose {event!r}.")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _smallest_noise(make_event, target_epsilon, delta, guess, rtol):
    """The smallest noise multiplier (within ``rtol``) whose event spends at most
    ``target_epsilon``: dp_accounting's own solver on a fresh RDP accountant,
    with the answer checked once more by another fresh accountant."""
    sigma = float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant("rdp"), make_event, target_epsilon, delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, guess),
        tol=rtol * guess / 4))
    for _ in range(100):  # the solver's tolerance is in sigma: step to the safe side
        acc = make_accountant("rdp")
        if acc.compose(make_event(sigma)).get_epsilon(delta) <= target_epsilon:
            return sigma
        sigma *= 1 + rtol / 8
    raise RuntimeError("Noise calibration failed to meet the target epsilon.")


def calibrate_search_noise(target_epsilon: float, delta: float, sampling_rate: float, steps: int,
                           mean_trials: float, shape: float = 1.0,
                           score_noise_multiplier: float | None = None,
                           rtol: float = 1e-3) -> float:
    """The smallest training noise multiplier (within ``rtol``) for which a search
    of ``mean_trials`` trials (each ``steps`` updates at ``sampling_rate``, plus
    a score released with ``score_noise_multiplier``) spends at most
    ``target_epsilon`` at ``delta``.

    Raises ``ValueError`` when no noise meets the target (the score's release or
    the selection's fixed cost alone exceeds it): lower ``mean_trials``, raise
    ``score_noise_multiplier`` or the target.

    Example:
        >>> sigma = calibrate_search_noise(3.0, 1e-6, 0.05, 100, mean_trials=3,
        ...                                score_noise_multiplier=20.0)
        >>> trial = trial_event(sigma, 0.05, 100, 20.0)
        >>> selection_epsilon(trial, 1e-6, 3) <= 3.0
        True
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)

    def make_event(sigma):
        return selection_event(trial_event(sigma, sampling_rate, steps,
                                           score_noise_multiplier), mean_trials, shape)

    floor = selection_epsilon(make_event(MAX_NOISE).event, delta, mean_trials, shape)
    if floor > target_epsilon:
        raise ValueError(
            f"No training noise meets epsilon {target_epsilon:g} for a search of "
            f"{mean_trials:g} trials on average: the selection's fixed cost and the score's "
            f"release alone spend {floor:.3g}. Lower `mean_trials`, raise the "
            "score's noise or the target epsilon.")
    return _smallest_noise(make_event, target_epsilon, delta, 1.0, rtol)


def calibrate_score_noise(target_epsilon: float, delta: float, mean_trials: float,
                          shape: float = 1.0, at_least: float = 0.0, rtol: float = 1e-3) -> float:
    """The smallest noise multiplier, at least ``at_least``, of a trial's score
    (a Gaussian release of sensitivity 1) whose selection alone spends at most
    ``target_epsilon``: the score's share of a search's budget.

    Example:
        >>> sigma = calibrate_score_noise(0.75, 1e-6, mean_trials=3)
        >>> import dp_accounting
        >>> selection_epsilon(dp_accounting.GaussianDpEvent(sigma), 1e-6, 3) <= 0.75
        True
        >>> calibrate_score_noise(0.75, 1e-6, 3, at_least=50.0)
        50.0
    """
    def make_event(sigma):
        return selection_event(dp_event.GaussianDpEvent(sigma), mean_trials, shape)

    at_least = check_noise(at_least, "at_least")
    if at_least > 0 and selection_epsilon(make_event(at_least).event, delta, mean_trials,
                                          shape) <= target_epsilon:
        return float(at_least)
    if selection_epsilon(make_event(MAX_NOISE).event, delta, mean_trials,
                         shape) > target_epsilon:
        return MAX_NOISE  # the search's calibration then says the budget is out of reach
    return max(at_least, _smallest_noise(make_event, target_epsilon, delta,
                                         max(at_least, 1.0), rtol))


def rdp_orders():
    """The Renyi orders the accountant evaluates (``dp_accounting``'s defaults)."""
    return tuple(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
