"""The real-slot mask of a padded batch, carried in its ``sample_weight``.

:func:`attach_real_slots` marks which slots of a padded batch are real
examples (and the Poisson rate the batch was drawn at); the DP step takes the
marks out with :func:`split_real_slots` and owns them: padding slots get a
loss of exactly zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

REAL_SLOTS_KEY = "keras_dp_lm_real_slots"
SAMPLING_RATE_KEY = "keras_dp_lm_sampling_rate"
SAMPLE_WEIGHT_KEY = "sample_weight"


def attach_real_slots(sample_weight: Any, real_slots: ArrayLike | tf.Tensor,
                      sampling_rate: float | ArrayLike | tf.Tensor | None = None) -> dict[str, Any]:
    """Mark which slots of a padded batch are real examples.

    ``real_slots``: ``[B]`` mask, 1 for a real example and 0 for a padding slot.
    Returns the structure to pass as a batch's ``sample_weight``: the DP step
    (and, for KerasHub tasks, their preprocessing) recognises it, takes the
    mask of real slots out, gives padding slots a loss of exactly zero, and
    hands the rest of ``sample_weight`` (possibly ``None``) to the loss.
    ``sampling_rate`` is the Poisson rate q the batch was drawn with; the
    step records it in the model's privacy ledger and refuses batches drawn
    at a higher rate than the accountant assumes. It is attached once per
    row of the mask (float64), so that ``tf.distribute`` can split the batch
    across replicas; the step takes the largest.

    Example:
        >>> import numpy as np
        >>> sw = attach_real_slots(None, np.array([1.0, 1.0, 0.0]), 0.01)
        >>> mask, rate, rest = split_real_slots(sw)
        >>> mask.tolist(), rate.tolist(), rest
        ([1.0, 1.0, 0.0], [0.01, 0.01, 0.01], None)
    """
    marked = {REAL_SLOTS_KEY: real_slots}
    if sampling_rate is not None:
        marked[SAMPLING_RATE_KEY] = _rate_per_row(sampling_rate, real_slots)
    if sample_weight is not None:
        marked[SAMPLE_WEIGHT_KEY] = sample_weight
    return marked


def _rate_per_row(rate, real_slots):
    """``rate`` repeated once per row of ``real_slots`` (left as is if it
    already has one entry per row)."""
    if isinstance(rate, (tf.Tensor, tf.Variable)) or isinstance(real_slots, tf.Tensor):
        rate = tf.cast(rate, tf.float64)
        if rate.shape.rank == 1:
            return rate
        return tf.fill(tf.shape(real_slots)[:1], tf.reshape(rate, []))
    rate = np.asarray(rate, np.float64)
    if rate.ndim == 1:
        return rate
    return np.full(np.shape(real_slots)[:1], float(rate), np.float64)


def split_real_slots(sample_weight: Any) -> tuple[Any, Any, Any]:
    """``(real_slots, sampling_rate, sample_weight)`` of a marked ``sample_weight``.

    An unmarked ``sample_weight`` gives ``(None, None, sample_weight)``.
    """
    if isinstance(sample_weight, dict) and REAL_SLOTS_KEY in sample_weight:
        return (sample_weight[REAL_SLOTS_KEY], sample_weight.get(SAMPLING_RATE_KEY),
                sample_weight.get(SAMPLE_WEIGHT_KEY))
    return None, None, sample_weight
