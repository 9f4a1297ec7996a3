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


class BatchEpsilonMixin:
    """The per-batch epsilon of :class:`~keras_dp_lm.callbacks.PrivacyAccountant`
    (its ``_rows``, ``_dominated``, ``_exact_epsilon`` and ``_config``)."""

    def _reset_batch_epsilon(self):
        self._grid = None  # (counts, values, non-dominated rows) of the current fit
        self._logged = None  # the last per-batch value (never decreases)
        self._fit_start = None  # ledger count before the fit's first batch
        self._epoch = getattr(self, "_epoch", 0)

    def _last_planned_batch(self, batch):
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        # With steps_per_execution > 1 Keras numbers the last execution of an
        # epoch past its end (8 steps in executions of 3: batch 8), hence >=.
        return bool(steps and epochs and self._epoch == epochs - 1 and batch >= steps - 1)

    def _batch_epsilon(self, count, batch, final=False):
        rows = [row for row in self._rows() if row.updates]
        if (self.accountant == "rdp" or final or not rows or count == self._fit_start
                or self._selection_events()):  # a recorded search: composed exactly
            value = self._exact_epsilon(rows)  # RDP: exact and cheap
        else:
            value = self._bound(rows, batch)
        if self._logged is not None:
            value = max(value, self._logged)
        self._logged = value
        return value

    def _split(self, rows):
        """(updates of the rows the assumed configuration dominates, the other rows)."""
        others = tuple(row for row in rows if not self._dominated([row]))
        return sum(row.updates for row in rows) - sum(row.updates for row in others), others

    def _bound(self, rows, batch):
        """Upper bound on the PLD epsilon of ``rows``: the dominated rows counted
        at the assumed (sigma, q), the others composed exactly, looked up on a
        grid of counts computed once per fit (monotone in the count)."""
        n, others = self._split(rows)
        if self._grid is None or self._grid[2] != others:
            self._grid = ([], [], others)
            self._extend_grid(rows, n, batch, planned=True)
        elif n > self._grid[0][-1]:
            self._extend_grid(rows, n, batch, planned=False)
        counts, values, _ = self._grid
        return values[bisect.bisect_left(counts, n)]

    def _extend_grid(self, rows, n, batch, planned):
        counts, values, others = self._grid
        sigma, rate = self._config["noise_multiplier"], self._config["sampling_rate"]
        cap = None
        end = self._planned_end(rows, n, batch) if planned else None
        if end is not None:
            # The run's final count is >= `end`: counts up to end - 1 use grid
            # values capped by the exact epsilon at `end` (what the last batch
            # and on_epoch_end will compute; cached), so the logged values
            # never exceed the final one.
            last = end - 1
            # The remaining updates at the most the step lets through (the
            # assumed sigma, rate and batch), not at the last row's values: a
            # later batch may have more real examples than the ones so far.
            assumed = (sigma, rate, float(self._config["batch_size"]), end - n)
            cap = self._exact_epsilon(list(rows) + [assumed])
        else:
            last = max(2 * n, n + 16)
        span = last - n  # evenly spaced counts, and doublings before the first one
        points = sorted({n + math.ceil(span * i / _GRID_POINTS) for i in range(_GRID_POINTS + 1)}
                        | {n + 2 ** j for j in range(64) if 2 ** j < span / _GRID_POINTS})
        curve = composed_curve(sigma, rate, self.delta, "pld",
                               ledger_events(list(others), self.dataset_size), upper_bound=True)
        new = curve.values(points)
        floor = values[-1] if values else 0.0
        for count, value in zip(points, new):
            floor = max(floor, value)
            counts.append(count)
            values.append(floor if cap is None else min(floor, cap))

    def _planned_end(self, rows, n, batch):
        """Smallest possible final count (in dominated updates), or None."""
        ends = []
        limit = self.max_steps
        others = sum(row.updates for row in self._grid[2])
        if limit is not None:
            ends.append(limit - others - self._config["steps_per_execution"] + 1)
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        if steps and epochs:
            remaining = (epochs - 1 - self._epoch) * steps + max(0, steps - 1 - batch)
            accumulation = int(self._config["gradient_accumulation_steps"] or 1)
            ends.append(n + remaining // accumulation)
        end = min(ends) if ends else None
        if end is None or end <= n or not self._dominated(rows[-1:]):
            return None
        return end
