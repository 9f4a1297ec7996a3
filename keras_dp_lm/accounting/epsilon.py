"""Epsilon of DP-SGD runs and of compositions, computed by ``dp_accounting``.

PLD (tight, default) or RDP (looser, cheap); epsilon-vs-steps curves are built
once per configuration and cached, and :func:`max_steps` searches them.
"""

import functools
import math

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as _pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from keras_dp_lm.accounting._arguments import COARSE_PLD_DISCRETIZATION
from keras_dp_lm.accounting._arguments import PLD_DISCRETIZATION
from keras_dp_lm.accounting._arguments import ADD_REMOVE
from keras_dp_lm.accounting._arguments import MAX_STEPS_CAP
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting.events import EpsilonDeltaDpEvent
from keras_dp_lm.accounting.events import as_event
from keras_dp_lm.accounting.events import describe_event
from keras_dp_lm.accounting.events import epsilon_of
from keras_dp_lm.accounting.events import row_sampling_rate
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import ledger_events
from keras_dp_lm.accounting.events import make_accountant


def compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant="pld"):
    """Epsilon of ``steps`` DP-SGD updates (Poisson rate ``q``, noise ``sigma``).

    Args:
        noise_multiplier: sigma (noise std / clipping norm). 0 gives ``inf``.
        sampling_rate: q = logical batch size / dataset size.
        steps: number of noised updates.
        delta: target delta.
        accountant: ``"pld"`` (tight, default) or ``"rdp"``.

    Example:
        >>> round(compute_epsilon(1.1, 0.01, 1000, 1e-5, accountant="rdp"), 3)
        1.712
    """
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return _cached_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant)


@functools.lru_cache(maxsize=512)
def _cached_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant):
    """A fresh dp_accounting accountant's answer (cached: it is deterministic)."""
    return epsilon_of(dp_sgd_event(noise_multiplier, sampling_rate, steps), delta, accountant)


class EpsilonCurve:
    """epsilon(n) for n self-composed DP-SGD steps, built once, cached per n.

    RDP: the one-step RDP vector from ``RdpAccountant`` times n, converted by
    ``dp_accounting``'s ``compute_epsilon`` -- exactly what ``RdpAccountant``
    does for ``SelfComposedDpEvent``. ~1 ms per new n.
    PLD: the one-step PLD built as ``PLDAccountant`` builds it, self-composed
    n times and composed onto the identity PLD: the accountant's own
    arithmetic, so the values are identical. ~0.1-0.4 s per new n.
    A coarser ``discretization`` (:data:`COARSE_PLD_DISCRETIZATION`, ~10x
    faster, a pessimistic estimate a fraction of a percent above) only guides
    searches; every answer is checked at the accountant's own discretization.
    """

    def __init__(self, noise_multiplier, sampling_rate, delta, accountant,
                 discretization=PLD_DISCRETIZATION):
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self._cache = {0: 0.0}
        one_step = dp_event.PoissonSampledDpEvent(
            sampling_rate, dp_event.GaussianDpEvent(noise_multiplier))
        if noise_multiplier == 0:
            self._base = None
        elif accountant == "rdp":
            acc = make_accountant("rdp")
            acc.compose(one_step)
            self._orders, self._rdp = acc.orders, acc.rdp
        else:
            self._base = _pld_lib.from_gaussian_mechanism(
                standard_deviation=noise_multiplier,
                value_discretization_interval=discretization,
                sampling_prob=sampling_rate,
                neighboring_relation=ADD_REMOVE)
            self._identity = _pld_lib.identity(
                value_discretization_interval=discretization)

    def __call__(self, n):
        n = int(n)
        if n not in self._cache:
            if self.noise_multiplier == 0:
                value = math.inf
            elif self.accountant == "rdp":
                value = _rdp_lib.compute_epsilon(
                    self._orders, self._rdp * n, self.delta)[0]
            else:
                # identity.compose(...) exactly as PLDAccountant composes it.
                value = self._identity.compose(
                    self._base.self_compose(n)).get_epsilon_for_delta(self.delta)
            self._cache[n] = float(value)
        return self._cache[n]


def largest_n_within(eps, target, guess=1, cap=MAX_STEPS_CAP, growth=2.0):
    """Largest integer n >= 0 with eps(n) <= target, for nondecreasing eps.

    Keeps a bracket ``eps(lo) <= target < eps(hi)`` of probed points (so the
    answer is exact: eps(lo) <= target < eps(lo + 1)); new points come from a
    secant step in log-log space through the two latest points (epsilon grows
    roughly like a power of n), clamped inside the bracket, and bisection
    after three steps that did not halve the bracket. Typically 4-6 probes.
    """
    lo, hi = 0, None
    points = []

    def probe(n):
        nonlocal lo, hi
        value = eps(n)
        points.append((n, value))
        if value <= target:
            lo = max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        return value

    n = int(min(max(guess, 1), cap))
    probe(n)
    while hi is None:  # grow until the target is exceeded
        if lo >= cap:
            return cap
        probe(min(_secant(points, target, factor=growth), cap))
    stalled = 0
    while hi - lo > 1:
        width = hi - lo
        estimate = _secant(points, target)
        if estimate is None or stalled >= 3:
            mid = lo + width // 2
        else:
            mid = min(max(int(math.floor(estimate)), lo + 1), hi - 1)
        probe(mid)
        stalled = 0 if hi - lo <= width // 2 else stalled + 1
    return lo


def _secant(points, target, factor=None):
    """Next integer guess from the two latest (n, eps) points, in log-log space.

    ``factor``: while growing, the guess is ``factor`` x the largest n seen
    without a usable point, and overshoots the estimate by up to 7% (less when
    ``factor`` is small: the caller's guess was already close).
    """
    usable = [(n, e) for n, e in points[-2:] if n > 0 and 0 < e < math.inf]
    guess = None
    if len(usable) == 2 and usable[0][0] != usable[1][0] and usable[0][1] != usable[1][1]:
        (n1, e1), (n2, e2) = usable
        slope = (math.log(e2) - math.log(e1)) / (math.log(n2) - math.log(n1))
        if slope > 0:
            exponent = math.log(n2) + (math.log(target) - math.log(e2)) / slope
            guess = math.exp(min(exponent, math.log(MAX_STEPS_CAP)))
    if factor is not None:
        largest, value = max(points)
        over = min(1.05, factor)
        if guess is None and 0 < value < math.inf:
            # One point: assume epsilon grows like sqrt(n), overshoot a little.
            guess = over * largest * (target / value) ** 2
        guess = largest * factor if guess is None else max(
            guess * min(1.02, factor), largest + 1)
        return int(min(max(math.ceil(guess), largest + 1), 4 * largest))
    return guess


def max_steps(target_epsilon, delta, noise_multiplier, sampling_rate, accountant="pld",
              near=None):
    """Largest number of DP-SGD updates whose epsilon stays <= ``target_epsilon``.

    The result ``n`` satisfies ``compute_epsilon(..., n, ...) <= target_epsilon``
    and ``compute_epsilon(..., n + 1, ...) > target_epsilon`` (same accountant).
    ``near``: an optional step count believed close to the answer (e.g. the
    steps a noise multiplier was calibrated for); it only speeds the search.
    Returns 0 if even one update exceeds it (or ``noise_multiplier == 0``).

    Example:
        >>> max_steps(2.0, 1e-5, noise_multiplier=1.0, sampling_rate=0.01, accountant="rdp")
        881
    """
    target_epsilon = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    accountant = check_accountant(accountant)
    if noise_multiplier == 0:
        return 0
    return _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon,
                             accountant, near)


@functools.lru_cache(maxsize=64)
def cached_epsilon_curve(noise_multiplier, sampling_rate, delta, accountant,
                         discretization=PLD_DISCRETIZATION):
    return EpsilonCurve(noise_multiplier, sampling_rate, delta, accountant, discretization)


@functools.lru_cache(maxsize=256)
def _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon, accountant,
                      near=None):
    return _max_steps_with(
        cached_epsilon_curve(noise_multiplier, sampling_rate, delta, accountant),
        target_epsilon, near)


def _max_steps_with(curve, target_epsilon, near=None):
    guess, growth = (near, 1.01) if near else (1, 2.0)
    if curve.accountant == "pld" and not near:
        rdp_curve = cached_epsilon_curve(curve.noise_multiplier, curve.sampling_rate,
                                         curve.delta, "rdp")
        coarse = cached_epsilon_curve(curve.noise_multiplier, curve.sampling_rate,
                                      curve.delta, "pld", COARSE_PLD_DISCRETIZATION)
        guess = max(1, largest_n_within(coarse, target_epsilon, max(
            1, largest_n_within(rdp_curve, target_epsilon))))
        growth = 1.01  # the coarse answer is within a fraction of a percent
    n = largest_n_within(curve, target_epsilon, guess, growth=growth)
    if curve.accountant == "rdp":
        # Final word to a fresh dp_accounting accountant (cheap for RDP; the PLD
        # curve performs PLDAccountant's exact computation, a test checks it).
        while n > 0 and compute_epsilon(curve.noise_multiplier, curve.sampling_rate,
                                        n, curve.delta, "rdp") > target_epsilon:
            n -= 1
    return n


def compose_epsilon(events, delta, accountant="pld"):
    """Epsilon at ``delta`` of several mechanisms composed in ONE accountant.

    ``events`` are ``dp_accounting.DpEvent`` objects or ``(epsilon, delta)``
    pairs (the latter need the PLD accountant).

    Example:
        >>> import dp_accounting
        >>> train = dp_sgd_event(1.0, 0.01, 1000)
        >>> vocab = dp_accounting.GaussianDpEvent(10.0)
        >>> round(compose_epsilon([train, vocab, (0.1, 0.0)], delta=1e-5), 2)
        1.91
    """
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    events = [as_event(e) for e in events]
    acc = make_accountant(accountant)
    for event in events:
        if not acc.supports(event):
            hint = (" (epsilon, delta) pairs compose only in the PLD accountant."
                    if isinstance(event, EpsilonDeltaDpEvent) else "")
            raise ValueError(
                f"The {accountant.upper()} accountant cannot compose "
                f"{describe_event(event)}.{hint}")
        acc.compose(event)
    return float(acc.get_epsilon(delta))


def ledger_epsilon(rows, dataset_size, delta, accountant="pld"):
    """Epsilon at ``delta`` of everything a privacy ledger records.

    Example:
        >>> rows = [(1.1, 0.01, 10.0, 1000)]
        >>> ledger_epsilon(rows, 1000, 1e-5) == compute_epsilon(1.1, 0.01, 1000, 1e-5)
        True
    """
    rows = [row for row in rows if row[3]]
    if not rows:
        return 0.0
    if any(row[0] == 0 for row in rows):
        return math.inf
    if len(rows) == 1:
        sigma, _, _, count = rows[0]
        return cached_epsilon_curve(sigma, row_sampling_rate(rows[0], dataset_size), delta,
                             accountant)(count)
    return compose_epsilon(ledger_events(rows, dataset_size), delta, accountant)


