"""The Poisson draws behind :func:`~keras_dp_lm.data.poisson_batches`.

Per step: the ``Binomial(N, q)`` count, the uniform subset of that size and
the padded size (a bucket, :func:`padding_buckets`, or the cap), and what an
overflow of the cap does. The only randomness of the samplers.
"""

from __future__ import annotations

import bisect
import math
import warnings

import numpy as np

from keras_dp_lm.accounting._arguments import check_integer
from keras_dp_lm.accounting._arguments import check_sampling_rate
from keras_dp_lm.accounting.overflow import overflow_probability
from keras_dp_lm.accounting.overflow import suggest_max_batch_size

OVERFLOW_MODES = ("raise", "truncate")


class PoissonOverflowError(RuntimeError):
    """A Poisson draw had more examples than ``max_batch_size``."""


PADDING_MODES = ("bucket", "max")


def padding_buckets(dataset_size: int, sampling_rate: float, max_batch_size: int,
                    ratio: float = 1.15) -> list[int]:
    """Batch sizes a Poisson batch is padded up to: ratio-spaced up to the cap.

    For ``dataset_size`` (N) units drawn at Poisson rate ``sampling_rate`` (q),
    expected batch ``N * q``, padded to at most ``max_batch_size`` (the cap,
    always the largest bucket); ``ratio`` (> 1) spaces the buckets.

    A batch of ``c`` real examples is padded to the smallest bucket ``>= c``, so
    the padded compute is at most ``ratio`` times the real one for every batch
    of at least the smallest bucket; buckets start about 6 standard deviations
    below the expected size (smaller draws are rare and padded to it), which
    keeps the number of distinct shapes (XLA compilations) to a handful.

    Example:
        >>> padding_buckets(69801, 64 / 69801, 125)
        [16, 17, 19, 21, 24, 27, 30, 34, 38, 43, 49, 56, 64, 73, 83, 95, 109, 125]
    """
    max_batch_size = check_integer("max_batch_size", max_batch_size)
    if not ratio > 1:
        raise ValueError(f"`ratio` must be > 1, got {ratio!r}.")
    expected = dataset_size * sampling_rate
    floor = max(1, int(expected - 6 * math.sqrt(expected * (1 - sampling_rate))))
    sizes, size = [max_batch_size], max_batch_size
    while size > floor:
        size = max(floor, math.ceil(size / ratio) if math.ceil(size / ratio) < size
                   else size - 1)
        sizes.append(size)
    return sorted(set(sizes))


def _check_sampling(sampling_rate, max_batch_size, overflow, num_steps):
    """Checked ``(sampling_rate, max_batch_size, num_steps)``; one epoch by default."""
    sampling_rate = check_sampling_rate(sampling_rate)
    max_batch_size = check_integer("max_batch_size", max_batch_size)
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"`overflow` must be one of {OVERFLOW_MODES}, got {overflow!r}.")
    if num_steps is None:
        num_steps = math.ceil(1 / sampling_rate)
    return sampling_rate, max_batch_size, check_integer("num_steps", num_steps)


def _warn_overflow(n, q, cap, num_steps, overflow, unit=("examples", "max_batch_size")):
    """Warn when ``cap`` is exceeded with probability > 1e-6 over the run."""
    units, cap_name = unit
    risk = overflow_probability(n, q, cap, num_steps)
    if risk > 1e-6:
        warnings.warn(
            f"{cap_name}={cap} is exceeded with probability {risk:.2g} in {num_steps} "
            f"Poisson draws of {n} {units} (overflow={overflow!r}); "
            f"suggest_max_batch_size(...) gives "
            f"{suggest_max_batch_size(n, q, num_steps)} for 1e-9.", stacklevel=3)


def _buckets(padding, n, q, cap, ratio):
    if padding not in PADDING_MODES:
        raise ValueError(f"`padding` must be one of {PADDING_MODES}, got {padding!r}.")
    return [cap] if padding == "max" else padding_buckets(n, q, cap, ratio)


def _draws(n, q, cap, num_steps, overflow, rng, buckets, unit=("examples", "max_batch_size")):
    """Per step: ``(index, size)``, the sorted drawn example (or user) indices and
    the padded size; ``unit`` names them and the cap in the overflow error.

    The only randomness of the sampler; the NumPy generator and the
    ``tf.data`` pipeline both consume it, so a seed gives the same draws.
    """
    units, cap_name = unit
    for _ in range(num_steps):
        count = int(rng.binomial(n, q))
        if count > cap:
            if overflow == "raise":
                raise PoissonOverflowError(
                    f"Poisson sampling drew {count} {units}, more than "
                    f"{cap_name}={cap}; truncating would break the privacy "
                    f"analysis. Use a larger {cap_name} "
                    "(keras_dp_lm.data.suggest_max_batch_size) or "
                    "overflow='truncate' (see the module docstring).")
            count = cap
        # Poisson sampling == a Binomial(n, q) size and a uniform subset of it.
        # (With truncation: a uniform subset of `cap` of the drawn examples.)
        index = np.sort(rng.choice(n, size=count, replace=False))
        yield index, buckets[bisect.bisect_left(buckets, count)]


def _index_batches(n, q, cap, num_steps, overflow, rng, buckets):
    """``(slot index [size] int64, count)`` per step: padding slots point at example 0."""
    for index, size in _draws(n, q, cap, num_steps, overflow, rng, buckets):
        slots = np.zeros((size,), np.int64)
        slots[:len(index)] = index
        yield slots, np.int32(len(index))
