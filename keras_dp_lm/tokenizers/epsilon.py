"""The DP histogram's calculators: threshold, epsilon and noise calibration.

See :mod:`keras_dp_lm.tokenizers` for the mechanism and the proof of its guarantee.
"""

from __future__ import annotations

import math

import dp_accounting
from scipy import stats

from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers._arguments import _check_open_unit
from keras_dp_lm.tokenizers._arguments import _check_positive


def _split_delta(delta, threshold_delta_fraction):
    delta = _check_open_unit("delta", delta)
    fraction = _check_open_unit("threshold_delta_fraction", threshold_delta_fraction)
    threshold_delta = fraction * delta
    return delta - threshold_delta, threshold_delta


def _check_release(name, value, delta, max_words_per_example, max_count,
                   threshold_delta_fraction):
    """Checks (in this order) the arguments the calculators share.

    Returns ``(value, k, max_count, gaussian_delta, threshold_delta)``.
    """
    value = _check_positive(name, value)
    k = _check_int("max_words_per_example", max_words_per_example)
    max_count = _check_int("max_count", max_count)
    return (value, k, max_count) + _split_delta(delta, threshold_delta_fraction)


def threshold_for(noise_stddev: float, delta: float, max_words_per_example: int, max_count: int = 1,
                  threshold_delta_fraction: float = 0.5) -> float:
    """Count threshold ``T`` so one example's unique words survive w.p. ``<= delta_threshold``.

    ``T = max_count + noise_stddev * scipy.stats.norm.isf(delta_threshold / k)``
    with ``delta_threshold = threshold_delta_fraction * delta`` and
    ``k = max_words_per_example``: a word whose whole count ``<= max_count``
    comes from one example passes ``count + N(0, noise_stddev^2) >= T`` with
    probability ``<= delta_threshold / k``, and the ``<= k`` words of that example
    together with probability ``<= delta_threshold``.

    Args:
        noise_stddev: standard deviation ``s`` of the Gaussian noise on each count.
        delta: total delta of the vocabulary mechanism (Gaussian + threshold parts).
        max_words_per_example: ``k``, distinct words one example may contribute.
        max_count: per-word cap on one example's contribution.
        threshold_delta_fraction: share of ``delta`` spent on thresholding.

    Example:
        >>> round(threshold_for(noise_stddev=10.0, delta=1e-6, max_words_per_example=8), 2)
        53.86
    """
    noise_stddev, k, max_count, _, threshold_delta = _check_release(
        "noise_stddev", noise_stddev, delta, max_words_per_example, max_count,
        threshold_delta_fraction)
    return float(max_count + noise_stddev * stats.norm.isf(threshold_delta / k))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of one Gaussian mechanism (sensitivity 1, std
    ``noise_multiplier``).

    Uses ``dp_accounting.get_epsilon_gaussian`` (the analytic Gaussian mechanism
    of Balle & Wang 2018), which is exact for any epsilon; it matches
    ``dp_accounting.pld.PLDAccountant`` on ``GaussianDpEvent(noise_multiplier)``.
    A relative safety margin of 1e-9 covers the root finder's tolerance.

    Example:
        >>> round(gaussian_epsilon(noise_multiplier=1.0, delta=1e-5), 3)
        4.377
    """
    noise_multiplier = _check_positive("noise_multiplier", noise_multiplier)
    delta = _check_open_unit("delta", delta)
    eps = float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta))
    return eps * (1 + 1e-9) + 1e-12


def classical_noise_multiplier(epsilon: float, delta: float) -> float:
    """``sqrt(2 ln(1.25/delta)) / epsilon``: Dwork-Roth sufficient noise (valid for eps < 1).

    Example:
        >>> round(classical_noise_multiplier(epsilon=0.5, delta=1e-5), 3)
        9.69
    """
    epsilon = _check_positive("epsilon", epsilon)
    delta = _check_open_unit("delta", delta)
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _threshold_epsilon_term(threshold_delta):
    return -math.log1p(-threshold_delta)


def epsilon_for(noise_stddev: float, delta: float, max_words_per_example: int, max_count: int = 1,
                threshold_delta_fraction: float = 0.5) -> float:
    """Epsilon of the DP histogram release (see :mod:`keras_dp_lm.tokenizers` for the proof).

    ``epsilon = eps_gaussian(noise_multiplier, delta_gaussian) + log(1/(1 - delta_threshold))``
    with ``noise_multiplier = noise_stddev / (max_count * sqrt(max_words_per_example))``,
    ``delta_threshold = threshold_delta_fraction * delta`` and
    ``delta_gaussian = delta - delta_threshold``.

    Example:
        >>> epsilon = epsilon_for(10.0, 1e-6, max_words_per_example=8)
        >>> round(epsilon, 3), epsilon < epsilon_for(5.0, 1e-6, 8)  # less noise, more epsilon
        (1.254, True)
    """
    noise_stddev, k, max_count, gaussian_delta, threshold_delta = _check_release(
        "noise_stddev", noise_stddev, delta, max_words_per_example, max_count,
        threshold_delta_fraction)
    noise_multiplier = noise_stddev / (max_count * math.sqrt(k))
    return (gaussian_epsilon(noise_multiplier, gaussian_delta)
            + _threshold_epsilon_term(threshold_delta))


def noise_stddev_for(target_epsilon: float, delta: float, max_words_per_example: int,
                     max_count: int = 1, threshold_delta_fraction: float = 0.5) -> float:
    """Smallest noise std whose :func:`epsilon_for` is ``<= target_epsilon`` (calibration).

    ``delta``, ``max_words_per_example`` (k), ``max_count`` and
    ``threshold_delta_fraction`` are as in :func:`threshold_for`; the std is
    ``noise_multiplier * max_count * sqrt(k)``.

    Example:
        >>> stddev = noise_stddev_for(target_epsilon=4.0, delta=1e-6, max_words_per_example=8)
        >>> round(stddev, 3), epsilon_for(stddev, 1e-6, 8) <= 4.0
        (3.467, True)
    """
    target_epsilon, k, max_count, gaussian_delta, threshold_delta = _check_release(
        "target_epsilon", target_epsilon, delta, max_words_per_example, max_count,
        threshold_delta_fraction)
    eps_g = target_epsilon - _threshold_epsilon_term(threshold_delta)
    if eps_g <= 0:
        raise ValueError(f"`target_epsilon`={target_epsilon} is too small for delta={delta}.")
    sensitivity = max_count * math.sqrt(k)
    noise_multiplier = float(dp_accounting.get_sigma_gaussian(eps_g, gaussian_delta))
    # Never return a noise level whose reported epsilon exceeds the target.
    while epsilon_for(noise_multiplier * sensitivity, delta, k, max_count,
                      threshold_delta_fraction) > target_epsilon:
        noise_multiplier *= 1 + 1e-9
    return noise_multiplier * sensitivity
