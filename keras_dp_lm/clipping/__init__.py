"""Per-example gradient clipping: one interface, an exact engine and fast per-layer rules.

- :func:`clipped_sum` (the interface the DP step calls) returns a
  :class:`ClippedSum`: ``sum_i min(1, C / ||g_i||) g_i`` with the per-example
  norms and losses, computed by
- the exact engine (:mod:`~keras_dp_lm.clipping.exact`: every example's full
  gradient; the definition, and the fallback for uncovered variables), or
- fast clipping (:mod:`~keras_dp_lm.clipping.fast`: ghost norms and
  book-keeping from per-layer rules in :mod:`~keras_dp_lm.clipping.rules`,
  one file per layer family).

:func:`register_clipping_rule` teaches fast clipping a custom layer;
:func:`coverage_report` says, per variable, which method runs and why.

Example:
    >>> import keras
    >>> from keras_dp_lm import clipping
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
    ...                           keras.layers.Dense(2)])
    >>> sorted(set(clipping.clipping_coverage(model).values()))
    ['ghost', 'instantiate']
"""

from keras_dp_lm.clipping.coverage import clipping_coverage
from keras_dp_lm.clipping.coverage import coverage_report
from keras_dp_lm.clipping.coverage import exact_reason
from keras_dp_lm.clipping.dispatch import clipped_sum
from keras_dp_lm.clipping.exact import exact_clipped_sum
from keras_dp_lm.clipping.exact import per_example_gradients
from keras_dp_lm.clipping.fast import fast_clipped_sum
from keras_dp_lm.clipping.interface import ClippedSum
from keras_dp_lm.clipping.interface import UncoveredLayersError
from keras_dp_lm.clipping.interface import batch_size_of
from keras_dp_lm.clipping.interface import clip_factors
from keras_dp_lm.clipping.interface import onednn_enabled
from keras_dp_lm.clipping.interface import scale_examples
from keras_dp_lm.clipping.interface import sum_user_rows
from keras_dp_lm.clipping.interface import user_slot_mask
from keras_dp_lm.clipping.registry import register_clipping_rule

# The built-in rules register themselves (through the public decorator) on import.
from keras_dp_lm.clipping import rules  # noqa: E402,F401  pylint: disable=unused-import

__all__ = [
    "ClippedSum",
    "UncoveredLayersError",
    "batch_size_of",
    "clip_factors",
    "clipped_sum",
    "clipping_coverage",
    "coverage_report",
    "exact_clipped_sum",
    "exact_reason",
    "fast_clipped_sum",
    "onednn_enabled",
    "per_example_gradients",
    "register_clipping_rule",
    "scale_examples",
    "sum_user_rows",
    "user_slot_mask",
]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
