"""Hyperparameters for DP fine-tuning: the rules of :mod:`keras_dp_lm.recipes`."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from keras_dp_lm.accounting import calibration
from keras_dp_lm.accounting import epsilon as epsilon_lib
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.overflow import suggest_max_batch_size
from keras_dp_lm.recipes.expectations import data_regime

if TYPE_CHECKING:
    import dp_accounting
    import numpy as np
    import tensorflow as tf
    from numpy.typing import ArrayLike

    from keras_dp_lm.callbacks import PrivacyAccountant
    from keras_dp_lm.optimizers import DPOptimizer

__all__ = ["DPRecipe", "NoiseDominatedWarning", "suggest_recipe"]

# The share of delta reserved for a Poisson draw above the padded cap.
OVERFLOW_SHARE = 1e-3
# A new head's rate times its steps (0.02 at 100 steps): the best DP-Adam rates of a
# linear probe at 100 steps were 0.01-0.03 on the utility suite's tuning tasks.
HEAD_DISPLACEMENT = 2.0
TRAINABLE = ("pretrained", "head")
# Above this noise-to-signal ratio the noise swamps most coordinates' updates.
NOISE_DOMINATED = 10.0


class NoiseDominatedWarning(UserWarning):
    """:func:`suggest_recipe` made a fine-tuning recipe whose DP noise swamps the
    signal of most trainable parameters (``noise_to_signal`` above 10): train fewer
    parameters (``trainable="head"`` on frozen features, or LoRA), use more data or
    a larger batch. Filter it with ``warnings.simplefilter("ignore",
    NoiseDominatedWarning)`` once you have read it."""


@dataclasses.dataclass(frozen=True)
class DPRecipe:
    """A DP fine-tuning configuration and why it was chosen.

    Attributes:
        dataset_size: N, the number of privacy units (examples).
        target_epsilon, delta: the total budget the recipe was made for.
        batch_size: the expected logical batch size ``q * N``.
        sampling_rate: the Poisson rate q.
        steps: noised updates.
        noise_multiplier: sigma, calibrated for the whole budget.
        l2_norm_clip: C.
        learning_rate: for Adam / AdamW: the non-private rate scaled for the
            batch, times ``noise_learning_rate_factor``.
        gradient_accumulation_steps: micro-batches per logical batch,
            ``ceil(max_batch_size() / micro_batch_size)``: the padded batch, so
            no micro-batch is larger than ``micro_batch_size``.
        epsilon: the total epsilon that the recipe spends (PLD, training
            composed with ``extra_events``, at ``delta`` minus the overflow
            reserve), ``<= target_epsilon``.
        training_epsilon: the training alone, at ``training_delta`` (``delta``
            minus the extra events' deltas minus ``OVERFLOW_SHARE * delta``
            reserved for a Poisson draw above :meth:`max_batch_size`).
        overflow_probability: the cap's overflow probability over the run.
        noise_learning_rate_factor: the factor that compensates the DP noise in
            Adam's second moment (1.0 when ``num_parameters`` was not given).
        trainable: the regime the rate was chosen for (``"pretrained"`` or ``"head"``).
        noise_to_signal: ``r = sigma sqrt(d) / (kappa B)`` (None without
            ``num_parameters``).
        extra_events: the other releases composed with training.
        reasons: one line per choice; :meth:`explain` joins them.
    """

    dataset_size: int
    target_epsilon: float
    delta: float
    batch_size: int
    sampling_rate: float
    steps: int
    noise_multiplier: float
    l2_norm_clip: float
    learning_rate: float
    gradient_accumulation_steps: int
    epsilon: float
    training_epsilon: float
    training_delta: float
    extra_events: tuple[dp_accounting.DpEvent | tuple[float, float], ...] = ()
    reasons: tuple[str, ...] = ()
    overflow_probability: float = 0.0
    noise_learning_rate_factor: float = 1.0
    trainable: str = "pretrained"
    noise_to_signal: float | None = None

    @property
    def epochs(self) -> float:
        """Expected passes over the data, ``q * steps``."""
        return self.sampling_rate * self.steps

    def explain(self) -> str:
        """The choices and their reasons, one per line."""
        head = (f"DP recipe for N={self.dataset_size}, epsilon={self.target_epsilon:g}, "
                f"delta={self.delta:g}: batch {self.batch_size} (q={self.sampling_rate:.4g}), "
                f"{self.steps} steps ({self.epochs:.2f} epochs), noise multiplier "
                f"{self.noise_multiplier:.4f}, clip {self.l2_norm_clip:g}, learning rate "
                f"{self.learning_rate:.3g}, accumulation {self.gradient_accumulation_steps}; "
                f"spends epsilon {self.epsilon:.3f}.")
        return "\n".join((head,) + tuple(f"- {r}" for r in self.reasons))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (extra events as strings)."""
        out = dataclasses.asdict(self)
        out["extra_events"] = [str(e) for e in self.extra_events]
        out["reasons"] = list(self.reasons)
        out["epochs"] = self.epochs
        return out

    def optimizer(self, name: str = "adam", seed: int | None = None, **kwargs: Any) -> DPOptimizer:
        """A DP optimizer built from the recipe (``"adam"``, ``"adamw"`` or ``"adambc"``).

        ``name`` picks the class (default ``"adam"``: :class:`~keras_dp_lm.optimizers.DPAdam`);
        ``seed`` is its noise seed (None, the default, draws it from OS entropy;
        a fixed seed is for reproducible tests only). ``kwargs`` go to the optimizer
        (e.g. ``weight_decay`` for AdamW); the privacy parameters come from the
        recipe. ``"adambc"``
        (:class:`~keras_dp_lm.optimizers.DPAdamBC`) takes the DP noise out of
        Adam's second moment, so its default rate is the recipe's without the
        noise factor (``learning_rate / noise_learning_rate_factor``).
        """
        from keras_dp_lm import optimizers

        classes = {"adam": optimizers.DPAdam, "adamw": optimizers.DPAdamW,
                   "adambc": optimizers.DPAdamBC}
        if name not in classes:
            raise ValueError(f"The recipe is made for Adam-type optimizers; `name` must be "
                             f"one of {sorted(classes)}, got {name!r}.")
        rate = self.learning_rate
        if name == "adambc":
            rate = self.learning_rate / self.noise_learning_rate_factor
        return classes[name](
            learning_rate=kwargs.pop("learning_rate", rate),
            l2_norm_clip=self.l2_norm_clip, noise_multiplier=self.noise_multiplier,
            expected_batch_size=self.sampling_rate * self.dataset_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps, seed=seed,
            **kwargs)

    def poisson_batches(self, data: Sequence[Any] | np.ndarray | tf.data.Dataset,
                        seed: int | None = None, **kwargs: Any) -> tf.data.Dataset:
        """:func:`keras_dp_lm.data.poisson_batches` at the recipe's rate and steps,
        padded to at most :meth:`max_batch_size`. ``seed``: None (the default)
        draws from OS entropy; a fixed seed is for tests. ``kwargs`` go to
        ``poisson_batches`` (e.g. ``preprocessor``, ``max_batch_size``)."""
        from keras_dp_lm import data as data_lib

        cap = kwargs.pop("max_batch_size", None) or self.max_batch_size()
        return data_lib.poisson_batches(data, self.sampling_rate, cap, seed=seed,
                                        num_steps=self.steps, **kwargs)

    def poisson_user_batches(self, data: Sequence[Any] | np.ndarray | tf.data.Dataset,
                             user_ids: ArrayLike, examples_per_user: int, seed: int | None = None,
                             **kwargs: Any) -> tf.data.Dataset:
        """:func:`keras_dp_lm.data.poisson_user_batches` at the recipe's rate and
        steps, for a recipe made with ``dataset_size`` = the number of users.
        ``user_ids``: one id per record of ``data``; ``examples_per_user``: k, the
        most records of one user per step; ``seed`` as for :meth:`poisson_batches`;
        ``kwargs`` go to ``poisson_user_batches`` (``max_users`` defaults to
        :meth:`max_batch_size`)."""
        from keras_dp_lm import data as data_lib

        cap = kwargs.pop("max_users", None) or self.max_batch_size()
        dataset = data_lib.poisson_user_batches(
            data, user_ids, self.sampling_rate, cap, examples_per_user, seed=seed,
            num_steps=self.steps, **kwargs)
        if dataset.dataset_size != self.dataset_size:
            raise ValueError(
                f"The recipe was made for {self.dataset_size} privacy units, but the "
                f"records belong to {dataset.dataset_size} users: make the recipe with "
                "dataset_size=<number of users>.")
        return dataset

    def max_batch_size(self) -> int:
        """Padded batch cap: a draw above it over the whole run has probability at
        most ``overflow_probability``, whose delta the recipe reserved."""
        return suggest_max_batch_size(self.dataset_size, self.sampling_rate, self.steps,
                                      max_overflow_probability=self.overflow_probability)

    def accountant(self, batches: tf.data.Dataset | None = None,
                   **kwargs: Any) -> PrivacyAccountant:
        """A :class:`~keras_dp_lm.callbacks.PrivacyAccountant` that stops at the recipe's
        training epsilon and composes the extra events into its report. Pass
        ``extra_events=[]`` when the model's ledger already holds them (earlier
        DP training of the same weights: a DP linear probe of its own head).
        ``batches``: the Poisson dataset the model is fitted on (it carries the
        rate and size); None accounts for the recipe's ``dataset_size``.
        ``kwargs`` go to ``PrivacyAccountant``."""
        from keras_dp_lm.callbacks import PrivacyAccountant

        kwargs.setdefault("target_epsilon", self.training_epsilon * (1 + 1e-9))
        kwargs.setdefault("extra_events", list(self.extra_events))
        if batches is None:
            kwargs.setdefault("dataset_size", self.dataset_size)
        return PrivacyAccountant(delta=self.training_delta, batches=batches, **kwargs)


def _positive(name, value, integer=False):
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValueError(f"`{name}` must be a positive {'integer' if integer else 'number'},"
                         f" got {value!r}.")
    return int(value) if integer else float(value)


def _noise_learning_rate_factor(sigma, batch, num_parameters, alignment, cap, warn=True):
    """``(factor, reason, r)``: ``sqrt(1 + r^2)``, ``r = sigma sqrt(d) / (kappa B)``, capped."""
    if num_parameters is None:
        if not warn:
            return 1.0, "", None
        warnings.warn(
            "suggest_recipe: `num_parameters` not given, so the learning rate is not "
            "corrected for the DP noise in Adam's second moment; with few examples and "
            "many trainable parameters it is then far too small (training stays at the "
            "majority class). Pass the number of trainable parameters.", stacklevel=3)
        return 1.0, "no noise correction: `num_parameters` not given", None
    d = _positive("num_parameters", num_parameters, integer=True)
    alignment = _positive("gradient_alignment", alignment)
    cap = _positive("max_noise_learning_rate_scale", cap)
    ratio = sigma * math.sqrt(d) / (alignment * batch)
    factor = min(cap, math.sqrt(1.0 + ratio * ratio))
    return factor, (f"the noise factor sqrt(1 + r^2), at most {cap:g}: Adam divides by the "
                    f"root of a second moment the DP noise inflates; r = sigma sqrt(d) / "
                    f"(kappa B) = {ratio:.3g} for d = {d} trainable parameters and kappa "
                    f"= {alignment:g})"), ratio


def _extra_delta(events):
    """Sum of the deltas of ``(epsilon, delta)`` pairs (DpEvents have none)."""
    return sum(float(e[1]) for e in events if isinstance(e, (tuple, list)))


def suggest_recipe(dataset_size: int, target_epsilon: float, delta: float | None = None, *,
                   epochs: float = 3.0, min_steps: int = 100, max_batch_size: int = 4096,
                   micro_batch_size: int | None = None, learning_rate: float = 1e-3,
                   reference_batch_size: int = 32, max_learning_rate_scale: float = 8.0,
                   num_parameters: int | None = None, gradient_alignment: float = 0.25,
                   max_noise_learning_rate_scale: float = 16.0, l2_norm_clip: float = 0.1,
                   extra_events: Sequence[dp_accounting.DpEvent | tuple[float, float]] = (),
                   batch_size: int | None = None, steps: int | None = None,
                   trainable: str = "pretrained", head_displacement: float = HEAD_DISPLACEMENT,
                   num_classes: int | None = None) -> DPRecipe:
    """Propose DP fine-tuning hyperparameters by the rules of :mod:`keras_dp_lm.recipes`.

    Args:
        dataset_size: N, the number of privacy units.
        target_epsilon: total epsilon (training plus ``extra_events``).
        delta: total delta; default ``min(1e-6, 10 ** floor(log10(1 / (10 N))))``:
            well below ``1 / N`` (Ponomareva et al. 2023), 1e-6 up to N = 100,000.
        epochs: compute budget, in expected passes over the data.
        min_steps: the fewest updates to make (fewer when the budget cannot pay
            for batches of at least 16).
        max_batch_size: the largest logical batch worth using.
        micro_batch_size: what fits in memory per forward/backward pass; sets
            ``gradient_accumulation_steps``. ``None``: no accumulation.
        learning_rate: the Adam learning rate you would use NON-privately at
            ``reference_batch_size`` (it is scaled for the DP batch and noise).
        reference_batch_size: the batch size that rate was chosen for (32).
        max_learning_rate_scale: cap on the square-root batch scaling of the
            rate, ``sqrt(batch / reference_batch_size)`` (8 by default; the
            scale is never below 1).
        num_parameters: the number of trainable parameters (e.g.
            ``sum(math.prod(v.shape) for v in model.trainable_variables)``):
            sets the noise factor of the learning rate. ``None`` leaves the rate
            uncorrected for the noise, with a warning: with few examples and
            many parameters it is then far too small.
        gradient_alignment: kappa, the assumed norm of the averaged clipped
            gradient in units of C (1 if every example's gradient pointed the
            same way; 0.25 by default).
        max_noise_learning_rate_scale: cap on the noise factor.
        l2_norm_clip: C (0.1, Li et al.).
        extra_events: other releases about the same data (``DpEvent`` or
            ``(epsilon, delta)`` pairs), composed with training.
        batch_size, steps: fix either or both instead of deriving them from
            ``epochs``; the other choices (noise, clip, learning rate) still follow
            the rules.
        trainable: ``"pretrained"`` (fine-tuning pretrained weights: the rate is
            ``learning_rate`` scaled for batch and noise) or ``"head"`` (a new
            output layer on frozen features: the rate is ``head_displacement /
            steps``, ``learning_rate`` unused).
        head_displacement: how far, per coordinate, a head's rate lets it
            travel over the run (the rate times the steps).
        num_classes: the number of labels of a classification head. With
            ``trainable="head"`` it lets :meth:`DPRecipe.explain` say what to
            expect: with fewer than ``SMALL_DATA_UNITS_PER_CLASS`` (400) privacy
            units per class, the measured gap to a non-private head at epsilon
            3 was often 3-9 points. It changes no hyperparameter.

    Returns:
        A :class:`DPRecipe`.
    """
    n = _positive("dataset_size", dataset_size, integer=True)
    target_epsilon = _positive("target_epsilon", target_epsilon)
    epochs = _positive("epochs", epochs)
    min_steps = _positive("min_steps", min_steps, integer=True)
    max_batch_size = _positive("max_batch_size", max_batch_size, integer=True)
    learning_rate = _positive("learning_rate", learning_rate)
    reference_batch_size = _positive("reference_batch_size", reference_batch_size,
                                     integer=True)
    l2_norm_clip = _positive("l2_norm_clip", l2_norm_clip)
    if trainable not in TRAINABLE:
        raise ValueError(f"`trainable` must be one of {TRAINABLE}, got {trainable!r}.")
    head_displacement = _positive("head_displacement", head_displacement)
    if num_classes is not None:
        num_classes = _positive("num_classes", num_classes, integer=True)
        if num_classes < 2:
            raise ValueError(f"`num_classes` must be at least 2, got {num_classes}.")
    if delta is None:
        delta = min(1e-6, 10.0 ** math.floor(math.log10(1.0 / (10 * n))))
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1), got {delta!r}.")
    extra_events = tuple(extra_events)
    # Poisson batches are padded to a cap; a draw above it (probability p over
    # the run) adds (1 + e^eps) p to delta (keras_dp_lm.data): reserve a
    # thousandth of delta for it and size the cap accordingly.
    overflow_delta = OVERFLOW_SHARE * delta
    composed_delta = delta - overflow_delta
    training_delta = composed_delta - _extra_delta(extra_events)
    if not training_delta > 0:
        raise ValueError("The extra events' deltas use up all of `delta`.")

    reasons = []
    examples = epochs * n
    given = [name for name, value in (("batch_size", batch_size), ("steps", steps))
             if value is not None]
    if batch_size is not None:
        batch = min(_positive("batch_size", batch_size, integer=True), n)
    else:
        batch = min(max_batch_size, n, max(16, int(examples // min_steps)))
        if steps is not None:
            batch = min(n, max(1, int(round(examples / _positive("steps", steps, True)))))
    steps = (max(1, int(round(examples / batch))) if steps is None
             else _positive("steps", steps, integer=True))
    if given:
        reasons.append(f"batch {batch} and {steps} updates ({', '.join(given)} given; "
                       f"{batch * steps / n:.2f} epochs)")
    elif batch == max_batch_size and examples / batch > min_steps:
        reasons.append(f"batch {batch}: the largest allowed (max_batch_size); the budget of "
                       f"{epochs:g} epochs pays for {steps} updates of it")
    else:
        reasons.append(f"batch {batch} and {steps} updates: the budget of {epochs:g} epochs "
                       f"({examples:.0f} example gradients) spent on at least {min_steps} "
                       "updates with the largest batch (Li et al. 2022: large batches; more "
                       "updates of smaller batches add noise faster than signal)")
    q = batch / n

    def total_epsilon(sigma):
        return epsilon_lib.compose_epsilon([dp_sgd_event(sigma, q, steps)]
                                           + list(extra_events), composed_delta)

    if extra_events:
        # The training share of the budget: training alone at training_delta,
        # checked composed with the extra events below.
        sigma = calibration.calibrate_noise_multiplier(
            target_epsilon, training_delta, q, steps, extra_events=extra_events,
            total_delta=composed_delta)
    else:
        sigma = calibration.calibrate_noise_multiplier(target_epsilon, composed_delta, q,
                                                       steps)
    spent = total_epsilon(sigma) if extra_events else epsilon_lib.compute_epsilon(
        sigma, q, steps, composed_delta)
    if spent > target_epsilon:  # never hand out a recipe over budget
        raise RuntimeError(f"calibration gave epsilon {spent} > {target_epsilon}")
    training_eps = epsilon_lib.compute_epsilon(sigma, q, steps, training_delta)
    reasons.append(f"noise multiplier {sigma:.4f}: the smallest within epsilon "
                   f"{target_epsilon:g} at delta {composed_delta:.4g} (dp_accounting PLD"
                   + (", composed with the other releases" if extra_events else "")
                   + f"; the other {overflow_delta:.2g} of delta covers a Poisson draw "
                   "above the padded batch cap)")
    reasons.append(f"clip {l2_norm_clip:g}: small, so every example is clipped (Li et al. "
                   "2022); with Adam it sets the noise-to-signal ratio, not the step size")
    scale = min(max_learning_rate_scale, math.sqrt(batch / reference_batch_size))
    scale = max(scale, 1.0)
    noise_factor, noise_reason, ratio = _noise_learning_rate_factor(
        sigma, batch, num_parameters, gradient_alignment, max_noise_learning_rate_scale,
        warn=trainable == "pretrained")
    if trainable == "head":
        noise_factor = 1.0
        lr = head_displacement / steps
        reasons.append(f"learning rate {lr:.3g}: a new head (trainable='head') trained from "
                       f"zero moves each coordinate about the rate per step under DP-Adam "
                       f"(the noise fills Adam's second moment), so the rate is "
                       f"{head_displacement:g} / {steps} steps; the non-private rate plays "
                       "no part; it assumes features of norm about 4, which "
                       "keras_dp_lm.data.DPFeatureNormalization gives them")
    else:
        lr = learning_rate * scale * noise_factor
        reasons.append(f"learning rate {lr:.3g}: your non-private {learning_rate:g}, taken as "
                       f"tuned at batch {reference_batch_size} (reference_batch_size), times "
                       f"{scale:.2f} (square-root batch scaling "
                       f"for Adam, at most {max_learning_rate_scale:g}x) times "
                       f"{noise_factor:.2f} ({noise_reason})")
    if ratio is not None:
        regime = ("noise-dominated" if ratio > NOISE_DOMINATED else "signal-carrying")
        advice = (f" With {n} examples and {num_parameters} trainable parameters, train "
                  "fewer parameters (trainable='head' on frozen features, or LoRA; Tramer "
                  "& Boneh 2021), a larger batch, or tune privately "
                  "(keras_dp_lm.tuning.private_search)" if ratio > NOISE_DOMINATED
                  and trainable == "pretrained" else "")
        reasons.append(f"regime: {regime} (noise-to-signal r = {ratio:.3g} per coordinate; "
                       f"above {NOISE_DOMINATED:g} the noise swamps most coordinates' "
                       f"updates).{advice}")
        if advice:
            warnings.warn(
                f"suggest_recipe: noise-dominated DP fine-tuning (r = {ratio:.3g} > "
                f"{NOISE_DOMINATED:g}): expect a large loss of accuracy, possibly no "
                "learning at all (on 3,000 Rotten Tomatoes reviews, MiniLM's top 2 layers "
                "at r = 74 and LoRA at r = 21 stayed at the majority class; on 10,222 at "
                f"r = 23 the top 2 layers fell 5 points below non-private).{advice}.",
                NoiseDominatedWarning, stacklevel=2)
    if trainable == "head" and num_classes is not None:
        reasons.append(data_regime(n, num_classes))
    overflow_probability = overflow_delta / (1.0 + math.exp(target_epsilon))
    accumulation = 1
    if micro_batch_size is not None:
        micro = _positive("micro_batch_size", micro_batch_size, integer=True)
        cap = suggest_max_batch_size(n, q, steps,
                                     max_overflow_probability=overflow_probability)
        accumulation = max(1, math.ceil(cap / micro))
        reasons.append(f"{accumulation} micro-batches of at most {micro} per logical batch "
                       f"padded to at most {cap} (gradient accumulation: same privacy, "
                       "less memory)")
    reasons.append("chosen by fixed rules from the literature, not by tuning on the "
                   "private data, so choosing them spends no privacy; a sweep must run on "
                   "public or already-released data, or be accounted")
    return DPRecipe(
        dataset_size=n, target_epsilon=target_epsilon, delta=delta, batch_size=batch,
        sampling_rate=q, steps=steps, noise_multiplier=sigma, l2_norm_clip=l2_norm_clip,
        learning_rate=lr, gradient_accumulation_steps=accumulation, epsilon=spent,
        training_epsilon=training_eps, training_delta=training_delta,
        extra_events=extra_events, reasons=tuple(reasons),
        overflow_probability=overflow_probability, noise_learning_rate_factor=noise_factor,
        trainable=trainable, noise_to_signal=ratio)
