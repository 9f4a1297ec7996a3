"""Epsilon when one person contributes several examples (group privacy)."""

from __future__ import annotations

import math

import numpy as np

from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting._arguments import check_positive_int
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import make_accountant


# ---------------------------------------------------------------------------
# user-level accounting
# ---------------------------------------------------------------------------
def user_level_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                       examples_per_user: int, method: str = "group",
                       accountant: str = "pld") -> float:
    """Epsilon for a USER who contributes at most ``examples_per_user`` (k) examples.

    The training is ``steps`` DP-SGD updates with ``noise_multiplier`` (sigma,
    the noise std over the clipping norm C) at Poisson ``sampling_rate``;
    epsilon is at ``delta``, by ``accountant`` ``"pld"`` (the default) or
    ``"rdp"``. 0 for no steps, ``inf`` for ``noise_multiplier == 0``.

    Two values of ``method``, each a theorem applied to ``dp_accounting`` output:

    ``"group"`` (the default; example-level DP-SGD, examples sampled independently):
        group privacy. If the training is (e, d')-DP for one example, it is
        ``(k*e, d' * sum_{i<k} exp(i*e))``-DP for k examples (apply the
        definition k times along add/remove-one neighbours). ``d'`` is chosen by
        bisection so the group delta is <= ``delta``; the smallest ``k*e`` over
        that search is returned. Valid but loose (it grows faster than k).
    ``"user_sampling"`` (the data pipeline samples USERS with probability
        ``sampling_rate`` and feeds all of a sampled user's <= k examples, each
        clipped to C, in the same logical batch): one user changes the summed
        gradient by at most k*C, so each step is a Poisson-sampled Gaussian with
        noise multiplier ``sigma / k``; accounted exactly by ``dp_accounting``.
        ``sampling_rate`` is then the user sampling rate (batch of users /
        number of users).

    Example:
        >>> e1 = compute_epsilon(1.0, 0.01, 1000, 1e-5, "rdp")
        >>> e4 = user_level_epsilon(1.0, 0.01, 1000, 1e-5, 4, "user_sampling", "rdp")
        >>> e1 < e4
        True
    """
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    delta = check_delta(delta)
    k = check_positive_int("examples_per_user", examples_per_user)
    accountant = check_accountant(accountant)
    if method not in ("group", "user_sampling"):
        raise ValueError(
            f"`method` must be 'group' or 'user_sampling', got {method!r}.")
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    if method == "user_sampling":
        return compute_epsilon(noise_multiplier / k, sampling_rate, steps, delta, accountant)
    if k == 1:
        return compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant)
    event = dp_sgd_event(noise_multiplier, sampling_rate, steps)
    acc = make_accountant(accountant)
    acc.compose(event)
    return _group_epsilon(acc.get_epsilon, k, delta)


def _group_delta(eps, delta_prime, k):
    # d' * sum_{i<k} e^{i eps}, computed in logs to avoid overflow.
    if eps == 0:
        return delta_prime * k
    log_sum = np.logaddexp.reduce([i * eps for i in range(k)])
    return float(np.exp(math.log(delta_prime) + log_sum))


def _group_epsilon(get_epsilon, k, delta):
    """k * e(d') for the largest d' with d' * sum_{i<k} e^{i e(d')} <= delta.

    With x = log d' and h(x) = log delta - log sum_{i<k} e^{i e(e^x)}
    (nondecreasing, as e(d') is nonincreasing), d' is feasible iff x <= h(x).
    Iterating x <- h(x) from x = log delta decreases monotonically to the
    largest fixed point, i.e. the largest feasible d'. The returned point is
    checked feasible (nudged down if rounding says otherwise).
    """
    log_delta = math.log(delta)

    def h(x):
        eps = float(get_epsilon(math.exp(x)))
        if not math.isfinite(eps):
            return eps, -math.inf
        return eps, log_delta - np.logaddexp.reduce([i * eps for i in range(k)])

    x = log_delta
    for _ in range(500):
        _, nxt = h(x)
        if not math.isfinite(nxt):
            return math.inf
        if x - nxt < 1e-6:
            x = nxt
            break
        x = nxt
    step = 1e-9
    for _ in range(60):
        eps, _ = h(x)
        if not math.isfinite(eps):
            return math.inf
        if _group_delta(eps, math.exp(x), k) <= delta:
            return k * eps
        x -= step
        step *= 2
    return math.inf


