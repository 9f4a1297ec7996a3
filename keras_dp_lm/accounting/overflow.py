"""The padded cap of a Poisson batch and the probability that a draw exceeds it.

A Poisson batch is padded to a fixed cap so that its shape does not reveal its
size. A draw above the cap cannot be processed as drawn (it is refused or
truncated, :mod:`keras_dp_lm.data`), and the probability of that event over
the run adds to delta. Plain ``scipy`` arithmetic: no TensorFlow, so a recipe
can size its micro-batches before any model exists.

Example:
    >>> from keras_dp_lm.accounting.overflow import suggest_max_batch_size
    >>> suggest_max_batch_size(60000, 256 / 60000, steps=2000)
    378
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from scipy import stats

from keras_dp_lm.accounting._arguments import check_integer
from keras_dp_lm.accounting._arguments import check_sampling_rate

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["bernstein_excess", "overflow_probability", "poisson_count_cap",
           "suggest_max_batch_size"]


def overflow_probability(dataset_size: int, sampling_rate: float, max_batch_size: int,
                         steps: int = 1) -> float:
    """Probability that at least one of ``steps`` Poisson draws exceeds ``max_batch_size``.

    One draw has ``Binomial(dataset_size, sampling_rate)`` examples; its tail
    ``P(X > max_batch_size)`` comes from ``scipy.stats.binom.sf`` and the
    union over independent steps is ``1 - (1 - p)^steps``.

    Example:
        >>> overflow_probability(60000, 256 / 60000, 340, steps=2000) > 1e-4
        True
        >>> overflow_probability(60000, 256 / 60000, 378, steps=2000) < 1e-9
        True
    """
    dataset_size = check_integer("dataset_size", dataset_size)
    sampling_rate = check_sampling_rate(sampling_rate)
    max_batch_size = check_integer("max_batch_size", max_batch_size)
    steps = check_integer("steps", steps, minimum=0)
    per_step = float(stats.binom.sf(max_batch_size, dataset_size, sampling_rate))
    if per_step <= 0 or steps == 0:
        return 0.0
    if per_step >= 1:
        return 1.0
    return float(-math.expm1(steps * math.log1p(-per_step)))


def suggest_max_batch_size(dataset_size: int, sampling_rate: float, steps: int,
                           max_overflow_probability: float = 1e-9) -> int:
    """Smallest ``max_batch_size`` whose overflow probability over ``steps`` draws
    is at most ``max_overflow_probability``.

    Each draw keeps every example with probability ``sampling_rate`` (q, in
    (0, 1]). Computed for ``dataset_size + 1`` examples, so it also holds for
    the add-one neighbouring dataset of the privacy analysis. 1 for no steps.

    Example:
        >>> suggest_max_batch_size(60000, 256 / 60000, steps=2000)
        378
    """
    dataset_size = check_integer("dataset_size", dataset_size)
    sampling_rate = check_sampling_rate(sampling_rate)
    steps = check_integer("steps", steps, minimum=0)
    if not 0 < max_overflow_probability < 1:
        raise ValueError("`max_overflow_probability` must be in (0, 1), got "
                         f"{max_overflow_probability!r}.")
    n = dataset_size + 1
    if steps == 0:
        return 1
    per_step = -math.expm1(math.log1p(-max_overflow_probability) / steps)
    size = int(stats.binom.isf(per_step, n, sampling_rate))
    size = max(size - 2, 1)
    while overflow_probability(n, sampling_rate, size, steps) > max_overflow_probability:
        size += 1
    while size > 1 and overflow_probability(n, sampling_rate, size - 1, steps) <= max_overflow_probability:
        size -= 1
    return min(size, n)


def poisson_count_cap(dataset_size: int, sampling_rate: float, steps: int,
                      probability: float) -> int:
    """A count that ``steps`` Poisson draws exceed with probability at most
    ``probability`` (together), in closed form: Bernstein's tail bound for
    ``Binomial(dataset_size + 1, sampling_rate)``,
    ``P(X >= mu + t) <= exp(-t^2 / (2 (var + t / 3)))``, at ``probability /
    steps`` per draw. Larger than :func:`suggest_max_batch_size` (a bound, not
    the exact tail) and O(1) at any dataset size.

    Example:
        >>> poisson_count_cap(60000, 256 / 60000, steps=2000, probability=1e-9)
        385
    """
    dataset_size = check_integer("dataset_size", dataset_size)
    sampling_rate = check_sampling_rate(sampling_rate)
    steps = check_integer("steps", steps)
    if not 0 < probability < 1:
        raise ValueError(f"`probability` must be in (0, 1), got {probability!r}.")
    n = dataset_size + 1
    mean = n * sampling_rate
    variance = mean * (1.0 - sampling_rate)
    t = bernstein_excess(variance, math.log(steps / probability))
    return min(n, int(math.floor(mean + t)))


def bernstein_excess(
        variance: float | tf.Tensor, log_term: float | tf.Tensor,
        sqrt: Callable[[float | tf.Tensor], float | tf.Tensor] = math.sqrt) -> float | tf.Tensor:
    """The ``t`` at which Bernstein's bound ``exp(-t^2 / (2 (variance + t / 3)))``
    for a sum of independent Bernoulli draws equals ``exp(-log_term)``.

    ``sqrt`` lets the traced DP step evaluate it on tensors (``tf.sqrt``).

    Example:
        >>> round(bernstein_excess(100.0, 20.0), 2)
        70.26
    """
    return log_term / 3.0 + sqrt(log_term ** 2 / 9.0 + 2.0 * log_term * variance)
