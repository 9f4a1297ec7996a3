"""The smallest noise multiplier that meets a target epsilon."""

import math

import dp_accounting

from keras_dp_lm.accounting._arguments import MAX_NOISE
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting._arguments import check_number
from keras_dp_lm.accounting._arguments import COARSE_PLD_DISCRETIZATION
from keras_dp_lm.accounting.epsilon import cached_epsilon_curve
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import make_accountant


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
    target_epsilon = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    accountant = check_accountant(accountant)
    rtol = check_number("rtol", rtol)
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
        # The RDP answer is a close upper estimate of the PLD one; the coarse
        # PLD answer (10x cheaper per evaluation) is closer still.
        start = calibrate_noise_multiplier(target_epsilon, delta, sampling_rate,
                                           steps, "rdp", rtol=1e-3)
        coarse = {}

        def coarse_eps(sigma):
            if sigma not in coarse:
                coarse[sigma] = cached_epsilon_curve(
                    sigma, sampling_rate, delta, "pld", COARSE_PLD_DISCRETIZATION)(steps)
            return coarse[sigma]

        start = _smallest_noise_within(coarse_eps, target_epsilon, start, rtol) or start
        # From a start within a few rtol the same search closes the bracket
        # in about two fine evaluations.
        sigma = _smallest_noise_within(eps, target_epsilon, start, rtol)
    else:
        sigma = _smallest_noise_within(eps, target_epsilon, start, rtol)
    if sigma is None:  # secant search did not converge: dp_accounting's solver
        hi = start
        while eps(hi) > target_epsilon:
            hi *= 2.0
            if hi > MAX_NOISE:
                raise ValueError(
                    f"target_epsilon={target_epsilon} is not reachable with a "
                    f"noise multiplier below {MAX_NOISE:g}.")
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
        if x > MAX_NOISE:
            raise ValueError(f"target_epsilon={target} is not reachable with a "
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


