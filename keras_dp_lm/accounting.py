"""Privacy accounting for DP training, all of it computed by ``dp_accounting``.

One DP-SGD update with Poisson sampling rate ``q`` and noise multiplier
``sigma`` is the ``dp_accounting`` event
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; ``n`` updates are that
event self-composed ``n`` times (``SelfComposedDpEvent``). Epsilon comes from
``dp_accounting.pld.PLDAccountant`` (default: tight) or
``dp_accounting.rdp.RdpAccountant`` (looser, cheap). Adjacency is add/remove
one example (``NeighboringRelation.ADD_OR_REMOVE_ONE``) throughout.

Functions:
    :func:`compute_epsilon`, :func:`calibrate_noise_multiplier`,
    :func:`max_steps`, :func:`compose_epsilon`, :func:`user_level_epsilon`,
    :func:`privacy_report` / :func:`privacy_statement`.

Callback:
    :class:`PrivacyAccountant` reads the DP optimizer's saved update counter
    (``optimizer.dp_updates``), writes ``logs["epsilon"]`` and stops training
    before a target epsilon would be exceeded.

Example:
    >>> from keras_dp_lm import accounting
    >>> eps = accounting.compute_epsilon(noise_multiplier=1.1, sampling_rate=256 / 60000,
    ...                                  steps=14070, delta=1e-5)
    >>> round(eps, 2)
    2.38
"""

import copy
import functools
import math
import numbers
import warnings

import attr
import dp_accounting
import keras
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as _pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

__all__ = [
    "ACCOUNTANTS",
    "EpsilonDeltaDpEvent",
    "PrivacyAccountant",
    "PrivacyBudgetExhaustedError",
    "calibrate_noise_multiplier",
    "compose_epsilon",
    "compute_epsilon",
    "dp_sgd_event",
    "make_accountant",
    "max_steps",
    "privacy_report",
    "privacy_statement",
    "report_to_json",
    "user_level_epsilon",
]

ACCOUNTANTS = ("pld", "rdp")
SAMPLING_MODES = ("auto", "poisson", "shuffle")
# PLDAccountant's default discretization; kept explicit so the cached curves
# below compute exactly what the accountant computes.
PLD_DISCRETIZATION = 1e-4
_MAX_STEPS_CAP = 10**15
_MAX_NOISE = 1e6
_ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

SHUFFLE_NOTE = (
    "shuffled fixed-size batches accounted as if Poisson sampled at the same "
    "rate (common practice; the guarantee is proven for Poisson sampling and "
    "shuffling can be less private than the number suggests)")
POISSON_NOTE = ("Poisson sampling (each example included independently with "
                "probability q)")


class PrivacyBudgetExhaustedError(RuntimeError):
    """Training was refused because one more update would exceed the target epsilon."""


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------
def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"`{name}` must not be NaN.")
    return value


def _check_noise(value, name="noise_multiplier"):
    value = _number(name, value)
    if value < 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be finite and >= 0, got {value!r}.")
    return value


def _check_rate(value, name="sampling_rate"):
    value = _number(name, value)
    if not 0 < value <= 1:
        raise ValueError(
            f"`{name}` must be in (0, 1] (logical batch size / dataset size), "
            f"got {value!r}.")
    return value


def _check_steps(value, name="steps"):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif float(value).is_integer():
        value = int(value)
    else:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return value


def _check_delta(value, name="delta"):
    value = _number(name, value)
    if not 0 < value < 1:
        raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
    return value


def _check_epsilon(value, name="target_epsilon"):
    value = _number(name, value)
    if not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    return value


def _check_accountant(value):
    if not isinstance(value, str) or value.lower() not in ACCOUNTANTS:
        raise ValueError(
            f"`accountant` must be one of {ACCOUNTANTS}, got {value!r}.")
    return value.lower()


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if not float(value).is_integer() or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


# ---------------------------------------------------------------------------
# events and accountants
# ---------------------------------------------------------------------------
@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaDpEvent(dp_event.DpEvent):
    """A mechanism known only to be (epsilon, delta)-DP (add/remove adjacency).

    Composed by the PLD accountant of this module through its worst-case
    privacy loss distribution (``dp_accounting.pld`` ``from_privacy_parameters``),
    which dominates every (epsilon, delta)-DP mechanism. The RDP accountant
    cannot compose it.
    """

    epsilon: float
    delta: float


class _PLDAccountant(dp_accounting.pld.PLDAccountant):
    """``PLDAccountant`` that also composes :class:`EpsilonDeltaDpEvent`."""

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, EpsilonDeltaDpEvent):
            if do_compose:
                pair = _pld_lib.from_privacy_parameters(
                    pld_common.DifferentialPrivacyParameters(
                        float(event.epsilon), float(event.delta)),
                    value_discretization_interval=self._value_discretization_interval)
                if count > 1:
                    pair = pair.self_compose(count)
                self._pld = self._pld.compose(pair)
            return None
        return super()._maybe_compose(event, count, do_compose)


def make_accountant(accountant="pld"):
    """A fresh ``dp_accounting`` accountant: ``"pld"`` or ``"rdp"``.

    The PLD one also accepts :class:`EpsilonDeltaDpEvent`.

    Example:
        >>> float(make_accountant("rdp").get_epsilon(1e-5))
        0.0
    """
    accountant = _check_accountant(accountant)
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=_ADD_REMOVE)
    return _PLDAccountant(neighboring_relation=_ADD_REMOVE,
                          value_discretization_interval=PLD_DISCRETIZATION)


def dp_sgd_event(noise_multiplier, sampling_rate, steps):
    """The ``DpEvent`` of ``steps`` Poisson-sampled Gaussian updates (DP-SGD).

    Example:
        >>> dp_sgd_event(1.0, 0.01, 100).count
        100
    """
    noise_multiplier = _check_noise(noise_multiplier)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    if steps == 0:
        return dp_event.NoOpDpEvent()
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(
            sampling_rate, dp_event.GaussianDpEvent(noise_multiplier)),
        steps)


def _epsilon_of(event, delta, accountant):
    acc = make_accountant(accountant)
    if not acc.supports(event):
        raise ValueError(
            f"The {accountant.upper()} accountant cannot compose {event!r}.")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


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
    noise_multiplier = _check_noise(noise_multiplier)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return _epsilon_of(dp_sgd_event(noise_multiplier, sampling_rate, steps),
                       delta, accountant)


class _EpsilonCurve:
    """epsilon(n) for n self-composed DP-SGD steps, built once, cached per n.

    RDP: the one-step RDP vector from ``RdpAccountant`` times n, converted by
    ``dp_accounting``'s ``compute_epsilon`` -- exactly what ``RdpAccountant``
    does for ``SelfComposedDpEvent``. ~1 ms per new n.
    PLD: the one-step PLD built as ``PLDAccountant`` builds it, self-composed
    n times and composed onto the identity PLD: the accountant's own
    arithmetic, so the values are identical. ~0.1-0.4 s per new n.
    """

    def __init__(self, noise_multiplier, sampling_rate, delta, accountant):
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
                value_discretization_interval=PLD_DISCRETIZATION,
                sampling_prob=sampling_rate,
                neighboring_relation=_ADD_REMOVE)
            self._identity = _pld_lib.identity(
                value_discretization_interval=PLD_DISCRETIZATION)

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


def _largest_n_within(eps, target, guess=1, cap=_MAX_STEPS_CAP):
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
        probe(min(_secant(points, target, factor=2.0), cap))
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

    ``factor``: while growing, the guess is at least ``factor`` x the largest n
    seen (or exactly that without two usable points).
    """
    usable = [(n, e) for n, e in points[-2:] if n > 0 and 0 < e < math.inf]
    guess = None
    if len(usable) == 2 and usable[0][0] != usable[1][0] and usable[0][1] != usable[1][1]:
        (n1, e1), (n2, e2) = usable
        slope = (math.log(e2) - math.log(e1)) / (math.log(n2) - math.log(n1))
        if slope > 0:
            guess = math.exp(math.log(n2) + (math.log(target) - math.log(e2)) / slope)
    if factor is not None:
        largest, value = max(points)
        if guess is None and 0 < value < math.inf:
            # One point: assume epsilon grows like sqrt(n), overshoot a little.
            guess = 1.05 * largest * (target / value) ** 2
        guess = largest * factor if guess is None else max(guess * 1.02, largest + 1)
        return int(min(max(math.ceil(guess), largest + 1), 4 * largest))
    return guess


def max_steps(target_epsilon, delta, noise_multiplier, sampling_rate, accountant="pld"):
    """Largest number of DP-SGD updates whose epsilon stays <= ``target_epsilon``.

    The result ``n`` satisfies ``compute_epsilon(..., n, ...) <= target_epsilon``
    and ``compute_epsilon(..., n + 1, ...) > target_epsilon`` (same accountant).
    The search costs a handful of PLD evaluations (seconds), once.
    Returns 0 if even one update exceeds it (or ``noise_multiplier == 0``).

    Example:
        >>> max_steps(2.0, 1e-5, noise_multiplier=1.0, sampling_rate=0.01, accountant="rdp")
        881
    """
    target_epsilon = _check_epsilon(target_epsilon)
    delta = _check_delta(delta)
    noise_multiplier = _check_noise(noise_multiplier)
    sampling_rate = _check_rate(sampling_rate)
    accountant = _check_accountant(accountant)
    if noise_multiplier == 0:
        return 0
    return _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon,
                             accountant)


@functools.lru_cache(maxsize=64)
def _cached_curve(noise_multiplier, sampling_rate, delta, accountant):
    return _EpsilonCurve(noise_multiplier, sampling_rate, delta, accountant)


@functools.lru_cache(maxsize=256)
def _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon, accountant):
    return _max_steps_with(
        _cached_curve(noise_multiplier, sampling_rate, delta, accountant), target_epsilon)


def _max_steps_with(curve, target_epsilon):
    guess = 1
    if curve.accountant == "pld":
        rdp_curve = _cached_curve(curve.noise_multiplier, curve.sampling_rate,
                                  curve.delta, "rdp")
        guess = max(1, _largest_n_within(rdp_curve, target_epsilon))
    n = _largest_n_within(curve, target_epsilon, guess)
    if curve.accountant == "rdp":
        # Final word to a fresh dp_accounting accountant (cheap for RDP; the PLD
        # curve performs PLDAccountant's exact computation, a test checks it).
        while n > 0 and compute_epsilon(curve.noise_multiplier, curve.sampling_rate,
                                        n, curve.delta, "rdp") > target_epsilon:
            n -= 1
    return n


def calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps,
                               accountant="pld", rtol=1e-3):
    """Smallest noise multiplier (within ``rtol``) with epsilon <= ``target_epsilon``.

    Every epsilon is computed by a fresh ``dp_accounting`` accountant. The
    search (secant steps in log-log space, starting for PLD from the cheap RDP
    answer; ``dp_accounting.calibrate_dp_mechanism`` as a fallback) returns
    ``sigma`` with ``epsilon(sigma) <= target_epsilon`` and
    ``epsilon(sigma / (1 + rtol)) > target_epsilon``: the returned noise never
    gives more than the target and is at most ``rtol`` larger than needed.

    Example:
        >>> sigma = calibrate_noise_multiplier(2.0, 1e-5, sampling_rate=0.01,
        ...                                    steps=1000, accountant="rdp")
        >>> round(sigma, 3), compute_epsilon(sigma, 0.01, 1000, 1e-5, "rdp") <= 2.0
        (1.022, True)
    """
    target_epsilon = _check_epsilon(target_epsilon)
    delta = _check_delta(delta)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    accountant = _check_accountant(accountant)
    rtol = _number("rtol", rtol)
    if not 0 < rtol < 0.1:
        raise ValueError(f"`rtol` must be in (0, 0.1), got {rtol!r}.")
    if steps == 0:
        raise ValueError("`steps` must be >= 1: zero updates need no noise.")

    cache = {}

    def eps(sigma):
        if sigma not in cache:
            cache[sigma] = compute_epsilon(sigma, sampling_rate, steps, delta, accountant)
        return cache[sigma]

    start = 1.0
    if accountant == "pld":
        # The RDP answer is a close upper estimate of the PLD one.
        start = calibrate_noise_multiplier(target_epsilon, delta, sampling_rate,
                                           steps, "rdp", rtol=1e-3)
    sigma = _smallest_noise_within(eps, target_epsilon, start, rtol)
    if sigma is None:  # secant search did not converge: dp_accounting's solver
        hi = start
        while eps(hi) > target_epsilon:
            hi *= 2.0
            if hi > _MAX_NOISE:
                raise ValueError(
                    f"target_epsilon={target_epsilon} is not reachable with a "
                    f"noise multiplier below {_MAX_NOISE:g}.")
        lo = hi * 0.5
        while eps(lo) <= target_epsilon:
            hi, lo = lo, lo * 0.5
            if lo < 1e-6:
                return hi
        sigma = float(dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(accountant),
            lambda s: dp_sgd_event(s, sampling_rate, steps),
            target_epsilon, delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
            tol=rtol * lo))
    # Final word to a fresh dp_accounting accountant.
    for _ in range(100):
        if eps(sigma) <= target_epsilon:
            return sigma
        sigma *= 1 + rtol / 4
    raise RuntimeError("Noise calibration failed to meet the target epsilon.")


def _smallest_noise_within(eps, target, start, rtol, max_evals=40):
    """sigma with eps(sigma) <= target and eps(sigma / (1 + rtol)) > target.

    eps is decreasing in sigma. Secant steps in log-log space; once the
    estimate is within rtol of a probed point, a probe just across the target
    closes the bracket; geometric bisection when the secant stalls. Returns
    None without convergence.
    """
    lo = hi = None  # lo: eps > target, hi: eps <= target
    points = []

    def probe(x):
        nonlocal lo, hi
        if x > _MAX_NOISE:
            raise ValueError(f"target_epsilon={target} is not reachable with a "
                             f"noise multiplier below {_MAX_NOISE:g}.")
        value = eps(x)
        points.append((x, value))
        if value <= target:
            hi = x if hi is None else min(hi, x)
        else:
            lo = x if lo is None else max(lo, x)
        return value

    probe(start)
    stalled = 0
    while len(points) < max_evals:
        if lo is not None and hi is not None and hi - lo <= rtol * hi:
            return hi
        if hi is not None and hi < 1e-6:
            return hi
        width = None if lo is None or hi is None else hi / lo
        estimate = None
        usable = [(x, e) for x, e in points[-2:] if 0 < e < math.inf]
        if len(usable) == 2 and usable[0][1] != usable[1][1]:
            (x1, e1), (x2, e2) = usable
            slope = (math.log(e2) - math.log(e1)) / (math.log(x2) - math.log(x1))
            if slope < 0:
                estimate = math.exp(math.log(x2) + (math.log(target) - math.log(e2)) / slope)
        elif len(points) == 1 and 0 < points[0][1] < math.inf:
            # One point: assume eps ~ sigma^-2 (typical of DP-SGD).
            estimate = start * math.sqrt(points[0][1] / target)
        if width is not None and (estimate is None or not lo < estimate < hi
                                  or stalled >= 3):
            estimate = math.sqrt(lo * hi)
        elif estimate is None:
            estimate = hi * 0.5 if lo is None else lo * 2.0
        near = min(points, key=lambda p: abs(math.log(estimate / p[0])))
        if abs(math.log(estimate / near[0])) < rtol / 2:
            # The estimate is (almost) a probed point: close the bracket there.
            estimate = (near[0] * (1 + rtol / 2) if near[1] > target
                        else near[0] / (1 + rtol / 2))
        probe(estimate)
        new_width = None if lo is None or hi is None else hi / lo
        stalled = 0 if (width is None or new_width is None
                        or math.log(new_width) <= 0.5 * math.log(width)) else stalled + 1
    return None


# ---------------------------------------------------------------------------
# composition
# ---------------------------------------------------------------------------
def _as_event(extra):
    """A DpEvent, or an (epsilon, delta) pair as :class:`EpsilonDeltaDpEvent`."""
    if isinstance(extra, dp_event.DpEvent):
        if isinstance(extra, EpsilonDeltaDpEvent):
            _check_pair(extra.epsilon, extra.delta)
        return extra
    if isinstance(extra, (tuple, list)) and len(extra) == 2:
        eps, delta = _check_pair(*extra)
        return EpsilonDeltaDpEvent(eps, delta)
    raise ValueError(
        "Each extra event must be a dp_accounting.DpEvent or an (epsilon, delta) "
        f"pair, got {extra!r}.")


def _check_pair(eps, delta):
    eps = _number("epsilon of an extra event", eps)
    delta = _number("delta of an extra event", delta)
    if not 0 <= eps < math.inf:
        raise ValueError(f"An extra event's epsilon must be finite and >= 0, got {eps!r}.")
    if not 0 <= delta < 1:
        raise ValueError(f"An extra event's delta must be in [0, 1), got {delta!r}.")
    return eps, delta


def _describe(event):
    if isinstance(event, EpsilonDeltaDpEvent):
        return f"(epsilon={event.epsilon:g}, delta={event.delta:g}) release"
    text = repr(event)
    return text if len(text) <= 160 else text[:157] + "..."


def _pick_accountant(events, preferred="pld"):
    """The first accountant (preferred, then the other) that supports every event."""
    for name in (preferred,) + tuple(a for a in ACCOUNTANTS if a != preferred):
        acc = make_accountant(name)
        if all(acc.supports(e) for e in events):
            return name
    return None


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
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    events = [_as_event(e) for e in events]
    acc = make_accountant(accountant)
    for event in events:
        if not acc.supports(event):
            hint = (" (epsilon, delta) pairs compose only in the PLD accountant."
                    if isinstance(event, EpsilonDeltaDpEvent) else "")
            raise ValueError(
                f"The {accountant.upper()} accountant cannot compose "
                f"{_describe(event)}.{hint}")
        acc.compose(event)
    return float(acc.get_epsilon(delta))


# ---------------------------------------------------------------------------
# user-level accounting
# ---------------------------------------------------------------------------
def user_level_epsilon(noise_multiplier, sampling_rate, steps, delta,
                       examples_per_user, method="group", accountant="pld"):
    """Epsilon for a USER who contributes at most ``examples_per_user`` (k) examples.

    Two methods, each a theorem applied to ``dp_accounting`` output:

    ``"group"`` (ordinary example-level DP-SGD, examples sampled independently):
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
    noise_multiplier = _check_noise(noise_multiplier)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    delta = _check_delta(delta)
    k = _check_positive_int("examples_per_user", examples_per_user)
    accountant = _check_accountant(accountant)
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


# ---------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------
def _finite_or_str(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else str(value)
    return value


def privacy_report(noise_multiplier, sampling_rate, steps, delta, *,
                   dataset_size=None, batch_size=None, sampling="poisson",
                   accountant="pld", extra_events=(), target_epsilon=None,
                   examples_per_user=None, l2_norm_clip=None):
    """A dict describing the guarantee of a DP-SGD run (+ other releases).

    Keys: ``noise_multiplier, sampling_rate, steps, epochs, delta,
    epsilon_rdp, epsilon_pld, epsilon, accountant, sampling, sampling_note,
    extras, total_epsilon, total_delta, total_accountant, sum_epsilon,
    sum_delta`` (+ ``dataset_size, batch_size, l2_norm_clip, target_epsilon,
    max_steps, user_level_epsilon, examples_per_user``). ``epochs`` is
    ``steps * sampling_rate`` (expected passes over the data).

    The total composes training and every extra event in one accountant (PLD
    when it supports them all, else RDP) at ``total_delta = sum_delta``:
    ``delta`` for training and for each extra ``DpEvent``, plus each pair's own
    delta. ``sum_epsilon`` is the simple sum of epsilons at those deltas.

    Example:
        >>> r = privacy_report(1.1, 0.01, 1000, 1e-5, extra_events=[(0.5, 1e-6)])
        >>> r["total_epsilon"] < r["sum_epsilon"]
        True
    """
    noise_multiplier = _check_noise(noise_multiplier)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    if sampling not in ("poisson", "shuffle"):
        raise ValueError(f"`sampling` must be 'poisson' or 'shuffle', got {sampling!r}.")
    extras = [_as_event(e) for e in extra_events]

    eps = {name: compute_epsilon(noise_multiplier, sampling_rate, steps, delta, name)
           for name in ACCOUNTANTS}
    report = {
        "noise_multiplier": noise_multiplier,
        "sampling_rate": sampling_rate,
        "steps": steps,
        "epochs": steps * sampling_rate,
        "delta": delta,
        "epsilon_rdp": eps["rdp"],
        "epsilon_pld": eps["pld"],
        "epsilon": eps[accountant],
        "accountant": accountant,
        "sampling": sampling,
        "sampling_note": POISSON_NOTE if sampling == "poisson" else SHUFFLE_NOTE,
        "dataset_size": dataset_size,
        "batch_size": batch_size,
        "l2_norm_clip": l2_norm_clip,
        "target_epsilon": target_epsilon,
        "max_steps": None,
    }
    if target_epsilon is not None:
        report["max_steps"] = max_steps(target_epsilon, delta, noise_multiplier,
                                        sampling_rate, accountant)

    extra_rows = []
    sum_eps, sum_delta = eps[accountant], delta
    for event in extras:
        if isinstance(event, EpsilonDeltaDpEvent):
            row = {"event": _describe(event), "epsilon": float(event.epsilon),
                   "delta": float(event.delta)}
        else:
            name = _pick_accountant([event], accountant)
            if name is None:
                raise ValueError(f"No accountant supports the extra event {event!r}.")
            row = {"event": _describe(event),
                   "epsilon": _epsilon_of(event, delta, name), "delta": delta}
        extra_rows.append(row)
        sum_eps += row["epsilon"]
        sum_delta += row["delta"]
    report["extras"] = extra_rows
    report["sum_epsilon"] = sum_eps
    report["sum_delta"] = sum_delta
    report["total_delta"] = sum_delta
    report["total_accountant"] = accountant
    report["total_epsilon"] = eps[accountant]
    if extras:
        training = dp_sgd_event(noise_multiplier, sampling_rate, steps)
        if noise_multiplier == 0 and steps > 0:
            training = dp_event.NonPrivateDpEvent()
        name = _pick_accountant([training] + extras, "pld")
        report["total_accountant"] = name
        report["total_epsilon"] = (
            None if name is None or sum_delta >= 1
            else compose_epsilon([training] + extras, sum_delta, name))

    report["examples_per_user"] = examples_per_user
    report["user_level_epsilon"] = None
    if examples_per_user is not None:
        report["user_level_epsilon"] = user_level_epsilon(
            noise_multiplier, sampling_rate, steps, delta, examples_per_user,
            "group", accountant)
    return report


def _fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}" if isinstance(value, float) else f"{value:,}"


def _fmt_eps(value):
    """An epsilon rounded UP to 3 significant digits: the text never under-reports."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return "inf"
    if value <= 0:
        return "0"
    unit = 10.0 ** (math.floor(math.log10(value)) - 2)
    return f"{math.ceil(value / unit - 1e-9) * unit:.3g}"


def privacy_statement(report):
    """A readable paragraph for a :func:`privacy_report` dict.

    Epsilons are rounded up to 3 significant digits.

    Example:
        >>> print(privacy_statement(privacy_report(1.1, 0.01, 1000, 1e-5)).split(".")[0])
        DP-SGD with noise multiplier 1
    """
    r = report
    batch = ""
    if r.get("batch_size") and r.get("dataset_size"):
        batch = (f" (logical batch {_fmt(r['batch_size'])} of "
                 f"{_fmt(r['dataset_size'])} examples)")
    clip = (f", clipping norm {_fmt(float(r['l2_norm_clip']))}"
            if r.get("l2_norm_clip") else "")
    other = "rdp" if r["accountant"] == "pld" else "pld"
    lines = [
        f"DP-SGD with noise multiplier {_fmt(r['noise_multiplier'], 6)}{clip}, "
        f"sampling rate {_fmt(r['sampling_rate'], 4)}{batch}, "
        f"{_fmt(r['steps'])} noised updates ({r['epochs']:.2f} epochs)."
    ]
    if r["noise_multiplier"] == 0 and r["steps"] > 0:
        lines.append("This training is NOT differentially private "
                     "(noise multiplier 0): epsilon is infinite.")
    else:
        lines.append(
            f"It satisfies (epsilon = {_fmt_eps(r['epsilon'])}, delta = {r['delta']:.3g})"
            f"-differential privacy for each training example under add/remove-one "
            f"adjacency ({r['accountant'].upper()} accountant; the "
            f"{other.upper()} accountant gives epsilon = {_fmt_eps(r['epsilon_' + other])}).")
    lines.append(f"Sampling: {r['sampling_note']}.")
    if r.get("target_epsilon") is not None:
        lines.append(
            f"Target epsilon {_fmt(float(r['target_epsilon']))}: at most "
            f"{_fmt(r['max_steps'])} updates fit in the budget.")
    if r.get("extras"):
        parts = "; ".join(f"{row['event']}: epsilon = {_fmt_eps(row['epsilon'])}, "
                          f"delta = {row['delta']:.3g}" for row in r["extras"])
        lines.append(f"Other releases composed with training: {parts}.")
        total = ("could not be composed in one accountant"
                 if r["total_epsilon"] is None else
                 f"satisfies (epsilon = {_fmt_eps(r['total_epsilon'])}, delta = "
                 f"{r['total_delta']:.3g})-DP composed in one "
                 f"{r['total_accountant'].upper()} accountant")
        lines.append(
            f"The whole pipeline {total}; the simple sum of epsilons is "
            f"{_fmt_eps(r['sum_epsilon'])} (delta {r['sum_delta']:.3g}).")
    if r.get("examples_per_user") is not None:
        lines.append(
            f"For a user contributing at most {r['examples_per_user']} examples: "
            f"epsilon = {_fmt_eps(r['user_level_epsilon'])} at delta = {r['delta']:.3g} "
            "(group privacy over example-level DP).")
    return " ".join(lines)


def report_to_json(report):
    """``report`` with non-finite floats as strings, ready for ``json.dumps``."""
    out = {}
    for key, value in report.items():
        if isinstance(value, list):
            value = [{k: _finite_or_str(v) for k, v in row.items()}
                     if isinstance(row, dict) else row for row in value]
        out[key] = _finite_or_str(value)
    return out


# ---------------------------------------------------------------------------
# the callback
# ---------------------------------------------------------------------------
def _dp_optimizer_of(model):
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)  # e.g. LossScaleOptimizer
    if not getattr(optimizer, "is_dp_optimizer", False) and getattr(
            inner, "is_dp_optimizer", False):
        optimizer = inner
    if not getattr(optimizer, "is_dp_optimizer", False):
        raise ValueError(
            "PrivacyAccountant needs a model compiled with a DP optimizer "
            "(e.g. `model.compile(optimizer=keras_dp_lm.DPAdam(learning_rate=..., "
            "l2_norm_clip=1.0, noise_multiplier=1.1), ...)`); got "
            f"{type(optimizer).__name__}. Without one, training is not "
            "differentially private and there is nothing to account.")
    if getattr(optimizer, "dp_updates", None) is None:
        raise ValueError(
            f"{type(optimizer).__name__} claims to be a DP optimizer but has no "
            "`dp_updates` variable to count its noised updates.")
    return optimizer


def _read_int(variable):
    return int(np.asarray(keras.ops.convert_to_numpy(variable)).reshape(()))


def _read_float(variable):
    return float(np.asarray(keras.ops.convert_to_numpy(variable)).reshape(()))


class PrivacyAccountant(keras.callbacks.Callback):
    """Keras callback: epsilon in the logs, and a stop before a target epsilon.

    The ledger is the DP optimizer's ``dp_updates`` variable (saved with the
    optimizer state), never a Python counter, so several ``fit`` calls,
    ``keras.callbacks.BackupAndRestore`` resumes and reloaded ``.keras`` models
    are counted from what the model actually received.

    Each ``fit`` batch is one logical batch and one noised update (also with
    ``gradient_accumulation_steps > 1``); ``q = batch_size / dataset_size``.

    Args:
        target_epsilon: optional budget for the training epsilon at ``delta``.
            Training stops BEFORE an update (or a ``steps_per_execution``
            group of updates) that would exceed it; ``fit`` refuses to start
            (:class:`PrivacyBudgetExhaustedError`) if no further group fits.
        delta: target delta; a warning is issued when ``delta >= 1/dataset_size``.
        dataset_size: number of training examples N (required).
        accountant: ``"pld"`` (default, tight) or ``"rdp"``.
        batch_size: logical batch size. Defaults to the optimizer's
            ``expected_batch_size``, else ``ceil(N / steps_per_epoch)`` with a
            warning. After every train batch the divisor the optimizer really
            used (``dp_last_batch_size``) is checked: a larger one raises.
        sampling: ``"poisson"`` (batches from :func:`keras_dp_lm.sampling.poisson_batches`),
            ``"shuffle"`` (fixed-size shuffled batches, accounted as if Poisson,
            with a warning) or ``"auto"``: Poisson when the optimizer has an
            ``expected_batch_size`` (its only use), else shuffle.
        extra_events: other releases about the same data (``dp_accounting.DpEvent``
            or ``(epsilon, delta)`` pairs), composed with training in
            :meth:`report`. ``target_epsilon`` bounds the training alone.
        examples_per_user: optional k; :meth:`report` adds a user-level
            epsilon by group privacy (see :func:`user_level_epsilon`).
        verbose: 1 prints one line when training is stopped for the budget.

    Cost per batch: two variable reads and, for ``logs["epsilon"]``, the RDP
    epsilon at the current count (one-step RDP cached once; ~1 ms per new
    count). With ``accountant="rdp"`` that is the exact value. With ``"pld"``
    the batch value is this RDP bound (valid, a little larger), and at the end
    of each epoch ``logs["epsilon"]`` is the PLD value (~0.2 s, cached per
    count), which is what History / CSVLogger / TensorBoard record. The stop
    uses ``max_steps`` computed once per configuration with the chosen
    accountant.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> from keras_dp_lm.accounting import PrivacyAccountant
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
        ...                                   noise_multiplier=1.0, seed=0),
        ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        >>> accountant = PrivacyAccountant(target_epsilon=2.0, delta=1e-3, dataset_size=64,
        ...                                batch_size=8, accountant="rdp", verbose=0)
        >>> history = model.fit(np.ones((64, 4)), np.zeros((64,)), batch_size=8,
        ...                     epochs=10, callbacks=[accountant], verbose=0)
        >>> accountant.dp_updates <= accountant.max_steps < accountant.dp_updates + 1
        True
        >>> history.history["epsilon"][-1] <= 2.0
        True
    """

    def __init__(self, target_epsilon=None, delta=None, dataset_size=None,
                 accountant="pld", batch_size=None, sampling="auto",
                 extra_events=(), examples_per_user=None, verbose=1):
        super().__init__()
        if delta is None:
            raise ValueError("PrivacyAccountant needs `delta` (e.g. 1/(10 * dataset_size)).")
        if dataset_size is None:
            raise ValueError(
                "PrivacyAccountant needs `dataset_size`: the number of training "
                "examples N (the sampling rate is batch_size / N). Keras cannot "
                "know it for generic datasets.")
        self.target_epsilon = (None if target_epsilon is None
                               else _check_epsilon(target_epsilon))
        self.delta = _check_delta(delta)
        self.dataset_size = _check_positive_int("dataset_size", dataset_size)
        self.accountant = _check_accountant(accountant)
        if batch_size is not None:
            batch_size = _number("batch_size", batch_size)
            if batch_size <= 0:
                raise ValueError(f"`batch_size` must be > 0, got {batch_size!r}.")
        self.batch_size = batch_size
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"`sampling` must be one of {SAMPLING_MODES}, got {sampling!r}.")
        self.sampling = sampling
        self.extra_events = [_as_event(e) for e in extra_events]
        self.examples_per_user = _check_positive_int(
            "examples_per_user", examples_per_user, allow_none=True)
        self.verbose = verbose
        if self.delta >= 1.0 / self.dataset_size:
            warnings.warn(
                f"delta={self.delta:g} >= 1/dataset_size={1.0 / self.dataset_size:g}: "
                "a mechanism that publishes one random example outright satisfies "
                "this delta. Use delta well below 1/N (e.g. 1/(10 N)).", stacklevel=2)
        self._config = None  # dict with the resolved parameters of the last fit
        self._report_cache = (None, None)
        self._last_count = None
        self._shuffle_warned = False
        self._begin_checked = True
        self.stopped_at = None

    # -- resolution of the training parameters -----------------------------
    def _resolve(self):
        optimizer = _dp_optimizer_of(self.model)
        sigma = _check_noise(float(optimizer.noise_multiplier))
        expected = getattr(optimizer, "expected_batch_size", None)
        if self.batch_size is not None:
            batch, batch_source = self.batch_size, "argument"
        elif expected is not None:
            batch, batch_source = float(expected), "optimizer.expected_batch_size"
        else:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    "PrivacyAccountant cannot tell the logical batch size: pass "
                    "`batch_size=` (or set `expected_batch_size=` on the DP "
                    "optimizer); the number of steps per epoch is unknown.")
            batch, batch_source = float(math.ceil(self.dataset_size / steps)), "inferred"
            warnings.warn(
                f"PrivacyAccountant inferred the logical batch size {batch:g} as "
                f"ceil(dataset_size / steps per epoch) = ceil({self.dataset_size} / "
                f"{steps}). Pass `batch_size=` to state it; a larger real batch "
                "stops training with an error.", stacklevel=3)
        rate = batch / self.dataset_size
        if rate > 1:
            raise ValueError(
                f"Logical batch size {batch:g} exceeds dataset_size {self.dataset_size}.")
        if self.sampling == "poisson":
            sampling, sampling_source = "poisson", "argument"
        elif self.sampling == "shuffle":
            sampling, sampling_source = "shuffle", "argument"
        elif expected is not None:
            sampling, sampling_source = "poisson", "optimizer.expected_batch_size is set"
        else:
            sampling, sampling_source = "shuffle", "default"
        if sampling == "shuffle" and not self._shuffle_warned:
            self._shuffle_warned = True
            warnings.warn(
                "PrivacyAccountant: batches are treated as " + SHUFFLE_NOTE + ". For "
                "a guarantee that matches the analysis, feed Poisson batches "
                "(keras_dp_lm.sampling.poisson_batches) and pass sampling='poisson'.",
                stacklevel=3)
        spe = getattr(self.model, "steps_per_execution", 1) or 1
        return {
            "optimizer": optimizer,
            "noise_multiplier": sigma,
            "l2_norm_clip": float(getattr(optimizer, "l2_norm_clip", float("nan"))),
            "gradient_accumulation_steps": getattr(
                optimizer, "dp_accumulation_steps",
                getattr(optimizer, "gradient_accumulation_steps", 1)) or 1,
            "batch_size": batch,
            "batch_size_source": batch_source,
            "sampling_rate": rate,
            "sampling": sampling,
            "sampling_source": sampling_source,
            "steps_per_execution": int(spe),
        }

    def _curve(self, accountant):
        return _cached_curve(self._config["noise_multiplier"],
                             self._config["sampling_rate"], self.delta, accountant)

    @property
    def max_steps(self):
        """Most updates within ``target_epsilon`` (None without a target or before fit)."""
        if self.target_epsilon is None or self._config is None:
            return None
        return max_steps(self.target_epsilon, self.delta, self._config["noise_multiplier"],
                         self._config["sampling_rate"], self.accountant)

    @property
    def sampling_rate(self):
        """q = logical batch size / dataset size (None before fit)."""
        return None if self._config is None else self._config["sampling_rate"]

    @property
    def dp_updates(self):
        """Noised updates the model's optimizer has applied (its saved ledger)."""
        return _read_int(_dp_optimizer_of(self.model).dp_updates)

    @property
    def epsilon(self):
        """Training epsilon at ``delta`` for the current ledger (chosen accountant)."""
        if self._config is None:
            self._config = self._resolve()
        return self._curve(self.accountant)(self.dp_updates)

    def _count(self):
        count = _read_int(self._config["optimizer"].dp_updates)
        if self._last_count is not None and count < self._last_count:
            warnings.warn(
                f"The optimizer's dp_updates went down from {self._last_count} to "
                f"{count}: a backup was restored or the optimizer was replaced. "
                "Epsilon follows the model's saved ledger; updates from a "
                "discarded run are not counted, so never release that run's "
                "weights.", stacklevel=3)
        self._last_count = count
        return count

    def _check_budget(self, count):
        limit = self.max_steps
        spe = self._config["steps_per_execution"]
        if limit is not None and count + spe > limit:
            more = "" if spe == 1 else (
                f" ({limit - count} remain, fewer than steps_per_execution={spe}; "
                "compile with steps_per_execution=1 to use them)")
            raise PrivacyBudgetExhaustedError(
                f"Privacy budget exhausted: the model has applied {count} noised "
                f"updates and target_epsilon={self.target_epsilon:g} (delta="
                f"{self.delta:g}) allows {limit}{more}. Training more would exceed "
                "the target.")

    # -- Keras hooks ---------------------------------------------------------
    def on_train_begin(self, logs=None):
        config = self._resolve()
        if self._config is not None and self._last_count:
            changed = [k for k in ("noise_multiplier", "sampling_rate")
                       if config[k] != self._config[k]]
            if changed:
                raise ValueError(
                    f"The privacy parameters changed between fit calls ({', '.join(changed)}): "
                    "one PrivacyAccountant accounts one configuration. Create a new "
                    "accountant and pass the finished training as "
                    "extra_events=[keras_dp_lm.accounting.dp_sgd_event(sigma, q, steps)].")
        self._config = config
        self.stopped_at = None
        self._check_budget(self._count())
        # Re-checked before the first batch, after every on_train_begin (e.g.
        # BackupAndRestore loading a backup) has run.
        self._begin_checked = False

    def on_train_batch_begin(self, batch, logs=None):
        if not self._begin_checked:
            self._begin_checked = True
            self._check_budget(self._count())

    def on_train_batch_end(self, batch, logs=None):
        count = self._count()
        divisor = _read_float(self._config["optimizer"].dp_last_batch_size)
        assumed = self._config["batch_size"]
        if divisor > assumed * (1 + 1e-6):
            self.model.stop_training = True
            raise ValueError(
                f"The DP optimizer divided its last update by {divisor:g} examples "
                f"but PrivacyAccountant assumed a logical batch of {assumed:g} "
                f"({self._config['batch_size_source']}): epsilon would be "
                f"under-reported. Pass batch_size={divisor:g} to PrivacyAccountant "
                "(with Poisson batches, set expected_batch_size=q*N on the optimizer).")
        if logs is not None:
            logs["epsilon"] = self._batch_epsilon(count)
        limit = self.max_steps
        if limit is not None and count + self._config["steps_per_execution"] > limit:
            if not self.model.stop_training and self.verbose:
                print(f"\nPrivacyAccountant: stopping after {count} noised updates; "
                      f"the next would exceed target_epsilon={self.target_epsilon:g} "
                      f"(at most {limit} updates).")
            self.stopped_at = count
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._config is not None:
            logs["epsilon"] = self._curve(self.accountant)(self._count())

    def _batch_epsilon(self, count):
        return self._curve("rdp")(count)

    # -- reports ---------------------------------------------------------------
    def report(self):
        """:func:`privacy_report` for what the model has received so far, plus
        ``dp_updates, batch_size_source, sampling_source, steps_per_execution,
        gradient_accumulation_steps, stopped_at``."""
        if self.model is None:
            raise ValueError("report() needs the accountant to have been used in fit().")
        if self._config is None:
            self._config = self._resolve()
        count = self.dp_updates
        config = self._config
        key = (count, config["noise_multiplier"], config["sampling_rate"],
               config["sampling"], config["batch_size"])
        if self._report_cache[0] == key:
            return copy.deepcopy(self._report_cache[1])
        report = privacy_report(
            config["noise_multiplier"], config["sampling_rate"], count, self.delta,
            dataset_size=self.dataset_size, batch_size=config["batch_size"],
            sampling=config["sampling"], accountant=self.accountant,
            extra_events=self.extra_events, target_epsilon=None,
            examples_per_user=self.examples_per_user,
            l2_norm_clip=config["l2_norm_clip"])
        report["target_epsilon"] = self.target_epsilon
        report["max_steps"] = self.max_steps
        report.update({
            "dp_updates": count,
            "batch_size_source": config["batch_size_source"],
            "sampling_source": config["sampling_source"],
            "steps_per_execution": config["steps_per_execution"],
            "gradient_accumulation_steps": config["gradient_accumulation_steps"],
            "stopped_at": self.stopped_at,
        })
        self._report_cache = (key, copy.deepcopy(report))
        return report

    def statement(self):
        """A readable paragraph (the same format as ``keras-dp-lm epsilon``)."""
        return privacy_statement(self.report())
