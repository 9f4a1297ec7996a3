"""The per-batch epsilon that :class:`~keras_dp_lm.callbacks.PrivacyAccountant` logs.

Within a fit the accountant logs, after each batch, an upper bound on the PLD
epsilon read from a grid of update counts computed once per fit (exact
epsilons at the fit's first and last batches and with RDP). The bound never
decreases and never exceeds the final, exact value.
"""

import bisect
import math

from keras_dp_lm.accounting.epsilon import composed_curve
from keras_dp_lm.accounting.events import ledger_events

# Per-batch upper bounds: grid points per fit (on a PLD curve that bounds the
# accountant's epsilon from above, `composed_curve(..., upper_bound=True)`).
_GRID_POINTS = 16


class BatchEpsilon:
    """The per-batch epsilon of one fit: exact when asked, else a monotone bound.

    Args:
        exact_epsilon: ``rows -> epsilon``, the accountant's exact (cached) epsilon
            of ledger rows at its current delta (the recorded search's release
            composed in).
    """

    def __init__(self, exact_epsilon):
        self._exact_epsilon = exact_epsilon
        self.reset()

    def reset(self):
        """Forget the fit's grid and last value (a new fit, or a restored ledger)."""
        self._grid = None  # (counts, values, non-dominated rows, delta and N) of the fit
        self._logged = None  # the last value (never decreases)

    def value(self, rows, assumptions, *, delta, dataset_size, exact, planned_end):
        """Epsilon to log after a batch.

        Args:
            rows: the ledger's accounted rows with updates.
            assumptions: the fit's :class:`~keras_dp_lm.callbacks.fit_assumptions.
                FitAssumptions`.
            delta, dataset_size: the accountant's, read at each batch (a grid made
                for other values is made again).
            exact: compute the exact value (the last batch, RDP, a recorded search).
            planned_end: ``(dominated updates so far, other updates) -> the run's
                smallest possible final count of dominated updates, or None``.
        """
        self._delta, self._dataset_size = delta, dataset_size
        if exact or not rows:
            value = self._exact_epsilon(rows)
        else:
            value = self._bound(rows, assumptions, planned_end)
        if self._logged is not None:
            value = max(value, self._logged)
        self._logged = value
        return value

    def _bound(self, rows, assumptions, planned_end):
        """Upper bound on the PLD epsilon of ``rows``: the rows the assumptions
        dominate counted at the assumed (sigma, q), the others composed exactly,
        looked up on a grid of counts computed once per fit (monotone in the count)."""
        others = tuple(row for row in rows
                       if not assumptions.dominates([row], self._dataset_size))
        n = sum(row.updates for row in rows) - sum(row.updates for row in others)
        if self._grid is None or self._grid[2:] != (others, self._delta, self._dataset_size):
            self._grid = ([], [], others, self._delta, self._dataset_size)
            end = planned_end(n, sum(row.updates for row in others))
            if end is not None and not assumptions.dominates(rows[-1:], self._dataset_size):
                end = None
            self._extend_grid(rows, n, assumptions, end if end is not None and end > n
                              else None)
        elif n > self._grid[0][-1]:
            self._extend_grid(rows, n, assumptions, None)
        counts, values = self._grid[:2]
        return values[bisect.bisect_left(counts, n)]

    def _extend_grid(self, rows, n, assumptions, end):
        counts, values, others = self._grid[:3]
        sigma, rate = assumptions.noise_multiplier, assumptions.sampling_rate
        cap = None
        if end is not None:
            # The run's final count is >= `end`: counts up to end - 1 use grid
            # values capped by the exact epsilon at `end` (what the last batch
            # and on_epoch_end will compute; cached), so the logged values
            # never exceed the final one.
            last = end - 1
            # The remaining updates at the most the step lets through (the
            # assumed sigma, rate and batch), not at the last row's values: a
            # later batch may have more real examples than the ones so far.
            assumed = (sigma, rate, float(assumptions.batch_size), end - n)
            cap = self._exact_epsilon(list(rows) + [assumed])
        else:
            last = max(2 * n, n + 16)
        span = last - n  # evenly spaced counts, and doublings before the first one
        points = sorted({n + math.ceil(span * i / _GRID_POINTS) for i in range(_GRID_POINTS + 1)}
                        | {n + 2 ** j for j in range(64) if 2 ** j < span / _GRID_POINTS})
        curve = composed_curve(sigma, rate, self._delta, "pld",
                               ledger_events(list(others), self._dataset_size),
                               upper_bound=True)
        new = curve.values(points)
        floor = values[-1] if values else 0.0
        for count, value in zip(points, new):
            floor = max(floor, value)
            counts.append(count)
            values.append(floor if cap is None else min(floor, cap))
