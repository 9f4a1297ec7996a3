"""``PrivacyParameters``: what one DP update is, as one frozen value.

A DP optimizer holds its privacy parameters in one :class:`PrivacyParameters`.
When the DP step is traced it freezes them (:meth:`DPOptimizer.freeze_privacy_parameters`
returns this object) and reads every value from that one object: the clipping
bound the clipping engine uses, the micro-batch count, the noise the optimizer
draws and the sigma the ledger records. A frozen dataclass cannot change
afterwards, so what the accountant counts and what the step applies are the
same numbers by construction, not by keeping copies equal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

CLIPPING_METHODS = ("auto", "fast", "exact")


def _check_number(name, value, allow_zero=False):
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number, got {value!r}.") from None
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"`{name}` must be finite, got {value!r}.")
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"`{name}` must be {bound}, got {value!r}.")
    return number


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class PrivacyParameters:
    """The privacy parameters of a DP optimizer's updates (immutable, validated).

    Attributes:
        l2_norm_clip: C, the bound on each privacy unit's gradient L2 norm.
        noise_multiplier: sigma; the summed clipped gradient gets Gaussian noise
            of std ``sigma * C`` (:attr:`noise_std`).
        accumulation_steps: micro-batches per logical batch (one update).
        expected_batch_size: the public divisor of Poisson-sampled batches
            (``q * N``), or None to divide by the fixed batch size.
        clipping: ``"auto"``, ``"fast"`` or ``"exact"`` (:mod:`keras_dp_lm.clipping`).

    Example:
        >>> from keras_dp_lm.optimizers import PrivacyParameters
        >>> params = PrivacyParameters(l2_norm_clip=0.5, noise_multiplier=2.0)
        >>> params.noise_std, params.noise_std_per_replica(4)
        (1.0, 0.5)
        >>> params.with_values(noise_multiplier=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: `noise_multiplier` must be >= 0, got -1.0.
    """

    l2_norm_clip: float
    noise_multiplier: float
    accumulation_steps: int = 1
    expected_batch_size: float | None = None
    clipping: str = "auto"

    def __post_init__(self):
        set_ = object.__setattr__   # the frozen dataclass's own normalisation
        set_(self, "l2_norm_clip", _check_number("l2_norm_clip", self.l2_norm_clip))
        set_(self, "noise_multiplier",
             _check_number("noise_multiplier", self.noise_multiplier, allow_zero=True))
        set_(self, "accumulation_steps", _check_positive_int(
            "gradient_accumulation_steps",
            1 if self.accumulation_steps is None else self.accumulation_steps))
        if self.expected_batch_size is not None:
            set_(self, "expected_batch_size",
                 _check_number("expected_batch_size", self.expected_batch_size))
        if self.clipping not in CLIPPING_METHODS:
            raise ValueError(
                f"`clipping` must be one of {CLIPPING_METHODS}, got {self.clipping!r}.")

    @property
    def noise_std(self) -> float:
        """``sigma * C``: the std of the noise on the summed clipped gradient."""
        return self.noise_multiplier * self.l2_norm_clip

    def noise_std_per_replica(self, num_replicas: int) -> float:
        """The std each of ``num_replicas`` replicas draws so that the sum has
        :attr:`noise_std` (independent draws add in variance)."""
        return self.noise_std / math.sqrt(num_replicas)

    def with_values(self, **changes: Any) -> PrivacyParameters:
        """A copy with ``changes`` applied, validated like a new one."""
        return dataclasses.replace(self, **changes)
