"""One DP histogram release as data: its parameters and its ``DpEvent``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import dp_accounting

from keras_dp_lm.accounting import EpsilonDeltaDpEvent
from keras_dp_lm.accounting import compose_epsilon
from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers._arguments import _check_open_unit
from keras_dp_lm.tokenizers._arguments import _check_positive
from keras_dp_lm.tokenizers.epsilon import epsilon_for
from keras_dp_lm.tokenizers.epsilon import gaussian_epsilon
from keras_dp_lm.tokenizers.epsilon import noise_stddev_for
from keras_dp_lm.tokenizers.epsilon import threshold_for


class VocabularyDpEvent(dp_accounting.ComposedDpEvent):
    """The ``DpEvent`` of one or more DP vocabulary releases.

    A ``dp_accounting.ComposedDpEvent`` whose events are, per release,
    ``GaussianDpEvent(noise_multiplier)`` and
    ``keras_dp_lm.accounting.EpsilonDeltaDpEvent(0, threshold_delta)`` (see
    :mod:`keras_dp_lm.tokenizers` for why). Pass it like any ``DpEvent`` to
    ``keras_dp_lm.PrivacyAccountant(extra_events=[...])`` or
    :func:`keras_dp_lm.accounting.compose_epsilon` (PLD accountant).

    Example:
        >>> one = VocabularyDpEvent.of_release(noise_multiplier=2.0, threshold_delta=5e-7)
        >>> both = VocabularyDpEvent.compose([one, one])
        >>> both.num_releases, both.threshold_delta
        (2, 1e-06)
        >>> round(both.composed_epsilon(1e-5), 2)
        2.96
    """

    @classmethod
    def of_release(cls, noise_multiplier: float, threshold_delta: float) -> VocabularyDpEvent:
        """The event of one histogram release: Gaussian noise of std
        ``noise_multiplier`` times the L2 sensitivity, and a threshold that
        spends ``threshold_delta`` (``threshold_delta_fraction * delta``)."""
        return cls([dp_accounting.GaussianDpEvent(float(noise_multiplier)),
                    EpsilonDeltaDpEvent(0.0, float(threshold_delta))])

    @classmethod
    def compose(cls, events: Iterable[VocabularyDpEvent]) -> VocabularyDpEvent:
        """One event for several releases (their events, in order)."""
        children = []
        for event in events:
            if not isinstance(event, VocabularyDpEvent):
                raise ValueError(f"Expected VocabularyDpEvent objects, got {event!r}.")
            children.extend(event.events)
        return cls(children)

    @property
    def gaussian_events(self) -> list[dp_accounting.GaussianDpEvent]:
        return [e for e in self.events if isinstance(e, dp_accounting.GaussianDpEvent)]

    @property
    def num_releases(self) -> int:
        return len(self.gaussian_events)

    @property
    def threshold_delta(self) -> float:
        """Total threshold delta of the releases (inside the PLD as mass at infinity)."""
        return math.fsum(float(e.delta) for e in self.events
                         if isinstance(e, EpsilonDeltaDpEvent))

    @property
    def event(self) -> dp_accounting.DpEvent:
        """The Gaussian part alone (one ``GaussianDpEvent``, or their composition)."""
        gaussians = self.gaussian_events
        return gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)

    def composed_epsilon(self, delta: float,
                         *other_events: dp_accounting.DpEvent | tuple[float, float]) -> float:
        """Epsilon at total ``delta`` of these releases composed with ``other_events``.

        One call of :func:`keras_dp_lm.accounting.compose_epsilon` (PLD) on
        ``[self, *other_events]``.
        """
        delta = _check_open_unit("delta", delta)
        if delta <= self.threshold_delta:
            raise ValueError(f"`delta`={delta} must exceed the vocabulary's threshold_delta="
                             f"{self.threshold_delta}.")
        return compose_epsilon([self, *other_events], delta, "pld")


@dataclasses.dataclass(frozen=True)
class HistogramMechanism:
    """The data-independent parameters of one DP histogram release.

    Attributes:
        noise_multiplier: sigma; each count gets Gaussian noise of std
            ``sigma * max_count * sqrt(max_words_per_example)``.
        delta: total delta of the release (Gaussian and threshold parts).
        max_words_per_example: k, distinct words one example may contribute.
        max_count: per-word cap on one example's contribution (1 by default).
        threshold_delta_fraction: share of ``delta`` spent on the threshold (0.5).

    Example:
        >>> mechanism = HistogramMechanism.create(delta=1e-6, max_words_per_example=8,
        ...                                       target_epsilon=4.0)
        >>> round(mechanism.noise_multiplier, 4), round(mechanism.threshold, 2)
        (1.2257, 19.33)
        >>> mechanism.epsilon <= 4.0, mechanism.dp_event().num_releases
        (True, 1)
    """

    noise_multiplier: float
    delta: float
    max_words_per_example: int
    max_count: int = 1
    threshold_delta_fraction: float = 0.5

    def __post_init__(self):
        _check_positive("noise_multiplier", self.noise_multiplier)
        _check_open_unit("delta", self.delta)
        _check_int("max_words_per_example", self.max_words_per_example)
        _check_int("max_count", self.max_count)
        _check_open_unit("threshold_delta_fraction", self.threshold_delta_fraction)

    @classmethod
    def create(cls, *, delta: float, max_words_per_example: int,
               noise_multiplier: float | None = None, target_epsilon: float | None = None,
               max_count: int = 1, threshold_delta_fraction: float = 0.5) -> HistogramMechanism:
        """Build from either ``noise_multiplier`` or ``target_epsilon`` (calibrated
        with :func:`noise_stddev_for`); ``delta``, ``max_words_per_example``,
        ``max_count`` and ``threshold_delta_fraction`` are the attributes above."""
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                "Pass exactly one of `noise_multiplier` and `target_epsilon`. Received: "
                f"noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}")
        k = _check_int("max_words_per_example", max_words_per_example)
        max_count = _check_int("max_count", max_count)
        if target_epsilon is not None:
            stddev = noise_stddev_for(target_epsilon, delta, k, max_count,
                                      threshold_delta_fraction)
            noise_multiplier = stddev / (max_count * math.sqrt(k))
        return cls(float(_check_positive("noise_multiplier", noise_multiplier)), float(delta),
                   k, max_count, float(threshold_delta_fraction))

    @property
    def l2_sensitivity(self) -> float:
        return self.max_count * math.sqrt(self.max_words_per_example)

    @property
    def linf_sensitivity(self) -> float:
        return float(self.max_count)

    @property
    def noise_stddev(self) -> float:
        return self.noise_multiplier * self.l2_sensitivity

    @property
    def threshold_delta(self) -> float:
        return self.threshold_delta_fraction * self.delta

    @property
    def gaussian_delta(self) -> float:
        return self.delta - self.threshold_delta

    @property
    def threshold(self) -> float:
        return threshold_for(self.noise_stddev, self.delta, self.max_words_per_example,
                             self.max_count, self.threshold_delta_fraction)

    @property
    def gaussian_epsilon(self) -> float:
        return gaussian_epsilon(self.noise_multiplier, self.gaussian_delta)

    @property
    def epsilon(self) -> float:
        return epsilon_for(self.noise_stddev, self.delta, self.max_words_per_example,
                           self.max_count, self.threshold_delta_fraction)

    def dp_event(self) -> VocabularyDpEvent:
        return VocabularyDpEvent.of_release(self.noise_multiplier, self.threshold_delta)

    def report(self) -> dict[str, Any]:
        """A JSON-able dict of the guarantee and its parts."""
        classical = math.sqrt(2.0 * math.log(1.25 / self.gaussian_delta)) / self.noise_multiplier
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "gaussian_epsilon": self.gaussian_epsilon,
            "gaussian_delta": self.gaussian_delta,
            "threshold_delta": self.threshold_delta,
            "noise_multiplier": self.noise_multiplier,
            "noise_stddev": self.noise_stddev,
            "l2_sensitivity": self.l2_sensitivity,
            "linf_sensitivity": self.linf_sensitivity,
            "threshold": self.threshold,
            "max_words_per_example": self.max_words_per_example,
            "max_count": self.max_count,
            # Dwork-Roth: eps = sqrt(2 ln(1.25/delta)) / sigma, valid only when < 1.
            "classical_gaussian_epsilon": classical,
            "classical_bound_valid": classical < 1.0,
        }
