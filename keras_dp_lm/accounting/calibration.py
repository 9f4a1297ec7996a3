"""The smallest noise multiplier that meets a target epsilon."""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting

from keras_dp_lm.accounting._arguments import COARSE_PLD_DISCRETIZATION
from keras_dp_lm.accounting._arguments import MAX_NOISE
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_number
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting.epsilon import _check_supported
from keras_dp_lm.accounting.epsilon import compose_epsilon
from keras_dp_lm.accounting.epsilon import composed_curve
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.events import as_event
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import make_accountant

class _UnreachableTarget(ValueError):
    """No noise multiplier up to ``MAX_NOISE`` meets the target epsilon."""


# The fast PLD curve agrees with the accountant to ~1e-8 relative; the search
# aims this much below the target so that the final check passes at once.
_SEARCH_MARGIN = 1e-6


def calibrate_noise_multiplier(
        target_epsilon: float, delta: float, sampling_rate: float, steps: int,
        accountant: str = "pld", rtol: float = 1e-3,
        extra_events: Sequence[dp_accounting.DpEvent | tuple[float, float]] = (),
        total_delta: float | None = None) -> float:
    """Smallest noise multiplier (within ``rtol``) with epsilon <= ``target_epsilon``.

    Epsilon is that of ``steps`` DP-SGD updates composed, in one accountant,
    with ``extra_events`` (other releases about the same data:
    ``dp_accounting.DpEvent`` objects or ``(epsilon, delta)`` pairs, the latter
    PLD only). The returned ``sigma`` satisfies
    ``compose_epsilon([dp_sgd_event(sigma, q, steps), *extra_events], delta)
    <= target_epsilon``, checked by a fresh accountant, and the same with
    ``sigma / (1 + rtol)`` exceeds the target: the noise never gives more than
    the target and is at most ``rtol`` larger than needed.

    The search runs on cheap estimates (for PLD the coarse, then the fine
    curves of :func:`epsilon_curve`); only the answer is computed by the
    accountant itself. Typically 0.1-1 s.

    Args:
        target_epsilon: the budget of the whole composition.
        delta: its delta.
        sampling_rate: q.
        steps: number of updates (>= 1).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        rtol: relative tolerance on sigma, in (0, 0.1).
        extra_events: other releases composed with training.
        total_delta: optional delta of the composition; when given it is used
            instead of ``delta`` (for callers that pass the training share of
            delta as ``delta``).

    Example:
        >>> sigma = calibrate_noise_multiplier(2.0, 1e-5, sampling_rate=0.01,
        ...                                    steps=1000, accountant="rdp")
        >>> round(sigma, 3), compute_epsilon(sigma, 0.01, 1000, 1e-5, "rdp") <= 2.0
        (1.022, True)
        >>> sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, extra_events=[(1.0, 0.0)])
        >>> compose_epsilon([dp_sgd_event(sigma, 0.01, 1000), (1.0, 0.0)], 1e-5) <= 3.0
        True
    """
    target_epsilon = check_epsilon(target_epsilon)
    delta = check_delta(delta if total_delta is None else total_delta,
                        "delta" if total_delta is None else "total_delta")
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    accountant = check_accountant(accountant)
    rtol = check_number("rtol", rtol)
    if not 0 < rtol < 0.1:
        raise ValueError(f"`rtol` must be in (0, 0.1), got {rtol!r}.")
    if steps == 0:
        raise ValueError("`steps` must be >= 1: zero updates need no noise.")
    extras = tuple(as_event(e) for e in extra_events)
    if extras:
        for event in extras:
            _check_supported(make_accountant(accountant), event, accountant)
        floor = compose_epsilon(extras, delta, accountant)
        if floor >= target_epsilon:
            raise ValueError(
                f"target_epsilon={target_epsilon} is not reachable: the extra events "
                f"alone have epsilon {floor:.6g} at delta={delta:g}.")

    cache = {}

    def eps(sigma):  # the accountant's answer
        if sigma not in cache:
            cache[sigma] = (compose_epsilon([dp_sgd_event(sigma, sampling_rate, steps),
                                             *extras], delta, accountant)
                            if extras else
                            compute_epsilon(sigma, sampling_rate, steps, delta, accountant))
        return cache[sigma]

    def curve_eps(discretization=None, name=accountant):
        def value(sigma):
            kwargs = {} if discretization is None else {"discretization": discretization}
            return composed_curve(sigma, sampling_rate, delta, name, extras, **kwargs)(steps)
        return value

    start, slope = 1.0, None
    if accountant == "pld":
        # The coarse PLD curve (~10x cheaper, a pessimistic estimate a
        # fraction of a percent above) brackets the answer and gives the local
        # slope; the fine curve (within ~1e-8 of the accountant) closes in.
        points = []
        try:
            start = _smallest_noise_within(curve_eps(COARSE_PLD_DISCRETIZATION),
                                           target_epsilon, start, rtol, points=points) or start
            slope = _log_slope(points)
            sigma = _smallest_noise_within(curve_eps(), target_epsilon * (1 - _SEARCH_MARGIN),
                                           start, rtol / 2, slope=slope)
        except _UnreachableTarget:
            raise
        except (ArithmeticError, MemoryError, ValueError):
            # The fast curves failed at an extreme probe (e.g. a tiny sigma whose
            # PLD does not fit in memory): dp_accounting's own solver below.
            start, sigma = 1.0, None
    else:
        sigma = _smallest_noise_within(eps, target_epsilon, start, rtol)
    if sigma is None:  # secant search did not converge: dp_accounting's solver
        hi = start
        while eps(hi) > target_epsilon:
            hi *= 2.0
            if hi > MAX_NOISE:
                raise _UnreachableTarget(
                    f"target_epsilon={target_epsilon} is not reachable with a "
                    f"noise multiplier below {MAX_NOISE:g}.")
        lo = hi * 0.5
        while eps(lo) <= target_epsilon:
            hi, lo = lo, lo * 0.5
            if lo < 1e-6:
                return hi
        sigma = float(dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(accountant),
            lambda s: dp_accounting.ComposedDpEvent(
                [dp_sgd_event(s, sampling_rate, steps), *extras]),
            target_epsilon, delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
            tol=rtol * lo / 2))
    # Final word to a fresh dp_accounting accountant.
    for _ in range(100):
        if eps(sigma) <= target_epsilon:
            return sigma
        sigma *= 1 + rtol / 8
    raise RuntimeError("Noise calibration failed to meet the target epsilon.")


def _log_slope(points):
    """d log(eps) / d log(sigma) from the two probes closest to the answer."""
    usable = sorted((p for p in points if 0 < p[1] < math.inf), key=lambda p: p[0])
    best = None
    for (x1, e1), (x2, e2) in zip(usable, usable[1:]):
        if x1 != x2 and e1 != e2:
            slope = (math.log(e2) - math.log(e1)) / (math.log(x2) - math.log(x1))
            width = math.log(x2 / x1)
            if slope < 0 and (best is None or width < best[0]):
                best = (width, slope)
    return None if best is None else best[1]


def _smallest_noise_within(eps, target, start, rtol, max_evals=40, slope=None, points=None):
    """sigma with eps(sigma) <= target and eps(sigma / (1 + rtol)) > target.

    eps is decreasing in sigma. Secant steps in log-log space (from one point,
    with ``slope`` = d log eps / d log sigma, default -2); once the estimate is
    within rtol of a probed point, a probe just across the target closes the
    bracket; geometric bisection when the secant stalls. Returns None without
    convergence. ``points``: an optional list that receives the probes.
    """
    lo = hi = None  # lo: eps > target, hi: eps <= target
    points = [] if points is None else points

    def probe(x):
        nonlocal lo, hi
        if x > MAX_NOISE:
            raise _UnreachableTarget(f"target_epsilon={target} is not reachable with a "
                             f"noise multiplier below {MAX_NOISE:g}.")
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
            secant = (math.log(e2) - math.log(e1)) / (math.log(x2) - math.log(x1))
            if secant < 0:
                estimate = math.exp(math.log(x2) + (math.log(target) - math.log(e2)) / secant)
        elif len(points) == 1 and 0 < points[0][1] < math.inf:
            # One point: eps ~ sigma^slope (typically about -2 for DP-SGD).
            power = slope if slope is not None and slope < 0 else -2.0
            estimate = start * (target / points[0][1]) ** (1 / power)
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


