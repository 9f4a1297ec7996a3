"""Searches for the largest number of steps whose epsilon stays within a target.

Epsilon is nondecreasing in the number of steps; these searches bracket the
answer exactly (:func:`largest_n_within`) and check it with the exact
accountant when a cheaper curve guided the search (:func:`largest_within`).
"""

import math

from keras_dp_lm.accounting._arguments import MAX_STEPS_CAP

# The fast PLD curve agrees with the accountant to ~1e-8 relative (delta >= 1e-7).
_SEARCH_SLACK = 1e-6


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


def largest_within(search, exact, target, guess=1, growth=2.0):
    """Largest n with ``exact(n) <= target``, searched on the cheaper ``search``.

    ``search`` approximates ``exact`` (both nondecreasing in n). The answer is
    checked with ``exact`` (``exact(n) <= target``), and ``exact(n + 1) >
    target`` too unless ``search(n + 1)`` exceeds the target by far more than
    their difference (then at worst one step is given up, never privacy).
    """
    n = largest_n_within(search, target, guess, growth=growth)
    while n > 0 and exact(n) > target:
        n -= 1
    while (n < MAX_STEPS_CAP and not search(n + 1) > target * (1 + _SEARCH_SLACK)
           and exact(n + 1) <= target):
        n += 1
    return n
