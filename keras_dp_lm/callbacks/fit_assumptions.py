"""What a :class:`~keras_dp_lm.callbacks.PrivacyAccountant` assumes for one ``fit``.

Resolved once, when the fit begins, from the DP optimizer's frozen privacy parameters
(``optimizer.privacy_parameters``, the object the DP step reads) and the accountant's
arguments, into one frozen :class:`FitAssumptions`. The accountant registers it on the
ledger as the limits the step enforces; the budget stop, the per-batch epsilon and the
report all read this one object.
"""

import dataclasses
import math
import warnings

from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting.overflow import poisson_count_cap

# The real-example cap of a Poisson batch: the largest count a draw at the assumed
# rate reaches with probability at most _CAP_PROBABILITY over _CAP_STEPS steps.
_CAP_STEPS = 10**6
_CAP_PROBABILITY = 1e-12


@dataclasses.dataclass(frozen=True)
class FitAssumptions:
    """One fit's accounted configuration (what the DP step is held to).

    Attributes:
        noise_multiplier: sigma of the DP optimizer (noise std / ``l2_norm_clip``).
        l2_norm_clip: C, the per-example (or per-user) clipping norm.
        gradient_accumulation_steps: micro-batches per noised update.
        batch_size: the logical batch size the sampling rate is made from.
        batch_size_source: where ``batch_size`` came from (for the report).
        sampling_rate: q, the probability that one privacy unit is in a batch.
        sampling: ``"poisson"`` or ``"shuffle"``.
        sampling_source: why that sampling mode (for the report).
        steps_per_execution: the model's ``steps_per_execution``.
        poisson_batch_cap: most real examples a Poisson batch at ``sampling_rate``
            may hold (0 for shuffled batches, which are capped at ``batch_size``).
        poisson_mean: the expected running total's rate, ``(N + 1) q`` (0 if shuffled).
    """

    noise_multiplier: float
    l2_norm_clip: float
    gradient_accumulation_steps: int
    batch_size: float
    batch_size_source: str
    sampling_rate: float
    sampling: str
    sampling_source: str
    steps_per_execution: int
    poisson_batch_cap: float
    poisson_mean: float

    def dominates(self, rows, dataset_size):
        """Whether every ledger row with updates costs at most these assumptions
        (a noise multiplier at least this one's, a rate at most this one's)."""
        return all(row.noise_multiplier >= self.noise_multiplier
                   and row.rate(dataset_size) <= self.sampling_rate * (1 + 1e-9)
                   for row in rows if row.updates)

    def ledger_limits(self):
        """The keyword arguments of :meth:`PrivacyLedger.set_limits`."""
        return dict(noise_multiplier=self.noise_multiplier, sampling_rate=self.sampling_rate,
                    batch_size=self.batch_size, poisson_batch_cap=self.poisson_batch_cap,
                    poisson_mean=self.poisson_mean)


def dp_optimizer_of(model):
    """The model's DP optimizer (unwrapping a ``LossScaleOptimizer``), or ValueError."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    if not getattr(optimizer, "is_dp_optimizer", False) and getattr(
            inner, "is_dp_optimizer", False):
        optimizer = inner
    if not getattr(optimizer, "is_dp_optimizer", False):
        raise ValueError(
            "PrivacyAccountant needs a model compiled with a DP optimizer "
            "(e.g. `model.compile(optimizer=keras_dp_lm.DPAdam(learning_rate=..., "
            "l2_norm_clip=1.0, noise_multiplier=1.1), ...)`); got "
            f"{type(optimizer).__name__}. Without one, training is not "
            "differentially private and there is nothing to account.")
    return optimizer


def _batch_size(dataset_size, batch_size, batches_rate, expected, steps):
    """(logical batch size, its source), in the accountant's order of precedence."""
    if batches_rate is not None:
        return batches_rate * dataset_size, "batches (poisson_batches)"
    if batch_size is not None:
        return batch_size, "argument"
    if expected is not None:
        return float(expected), "optimizer.expected_batch_size"
    if not steps:
        raise ValueError(
            "PrivacyAccountant cannot tell the logical batch size: pass "
            "`batch_size=` (or set `expected_batch_size=` on the DP "
            "optimizer); the number of steps per epoch is unknown.")
    batch = float(math.ceil(dataset_size / steps))
    warnings.warn(
        f"PrivacyAccountant inferred the logical batch size {batch:g} as "
        f"ceil(dataset_size / steps per epoch) = ceil({dataset_size} / "
        f"{steps}). Pass `batch_size=` to state it; a batch with more real "
        "examples is refused before its update.", stacklevel=5)
    return batch, "inferred"


def resolve_fit_assumptions(model, *, dataset_size, batch_size, sampling, batches_rate,
                            steps):
    """The :class:`FitAssumptions` of a fit of ``model``.

    Args:
        model: the model being fit, compiled with a DP optimizer.
        dataset_size: N, the number of privacy units.
        batch_size: the accountant's ``batch_size`` argument (or None).
        sampling: the accountant's ``sampling`` argument (``"auto"``, ``"poisson"``
            or ``"shuffle"``).
        batches_rate: the sampling rate the ``batches`` argument carried (or None).
        steps: Keras's steps per epoch for this fit (or None).
    """
    optimizer = dp_optimizer_of(model)
    params = optimizer.privacy_parameters   # the step freezes this same object
    expected = params.expected_batch_size
    batch, batch_source = _batch_size(dataset_size, batch_size, batches_rate, expected, steps)
    rate = batches_rate if batches_rate is not None else batch / dataset_size
    if rate > 1:
        raise ValueError(f"Logical batch size {batch:g} exceeds dataset_size {dataset_size}.")
    if sampling == "poisson":
        mode, mode_source = "poisson", "batches" if batches_rate is not None else "argument"
    elif sampling == "shuffle":
        mode, mode_source = "shuffle", "argument"
    elif expected is not None:
        mode, mode_source = "poisson", "optimizer.expected_batch_size is set"
    else:
        mode, mode_source = "shuffle", "default"
    poisson = mode == "poisson"
    # A Poisson batch with more real examples than a draw at this rate reaches
    # once in 1e12 over a million steps was not drawn at it (e.g. Poisson
    # batches regrouped with unbatch().batch()): refused.
    cap = (float(poisson_count_cap(dataset_size, rate, _CAP_STEPS, _CAP_PROBABILITY))
           if poisson else 0.0)
    return FitAssumptions(
        noise_multiplier=check_noise(params.noise_multiplier),
        l2_norm_clip=params.l2_norm_clip,
        gradient_accumulation_steps=params.accumulation_steps,
        batch_size=batch, batch_size_source=batch_source,
        sampling_rate=rate, sampling=mode, sampling_source=mode_source,
        steps_per_execution=int(getattr(model, "steps_per_execution", 1) or 1),
        poisson_batch_cap=cap,
        poisson_mean=(dataset_size + 1) * rate if poisson else 0.0)
