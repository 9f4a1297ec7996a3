"""``check_privacy``: test the DP step on *your* model, before you train it.

For a model compiled with a keras_dp_lm DP optimizer and a few batches of its (preprocessed)
training data, :func:`check_privacy`

(a) compares the DP step's per-example gradient norms and clipped sum with a naive loop that
    differentiates each example's loss on its own (the definition of per-example clipping);
(b) measures neighbouring-batch sensitivity on a few units spread over the batch (first, last and
    between: every micro-batch of an accumulated step): the clipped sum without one example must
    move by at most ``C`` (add/remove adjacency, what the accountant assumes) and by exactly that
    example's naive clipped gradient, and with one example replaced by an adversarial one (inputs
    scaled by 1e3 or random token ids, other labels, sample weight 1e9) by at most ``2 C``; these
    bounds hold to float32 rounding whatever ``tolerance`` says;
(c) checks that padding slots (marked with :func:`keras_dp_lm.data.attach_real_slots`) are inert:
    changing their contents arbitrarily leaves the clipped sum bit-identical;
(d) reports which variables run on fast clipping rules and which fall back to exact per-example
    gradients (and why), and, for a model the DP step refuses, the refusal (a pass: it happens
    before any update).

With ``examples_per_user=k`` the same checks run at the user level, as the step trains on
:func:`keras_dp_lm.data.poisson_user_batches`: rows ``u*k .. u*k+k-1`` of a batch are user ``u``'s
records; the naive loop differentiates each user's mean loss over its rows together; removing one
user (all its rows) must move the clipped sum by at most ``C`` and replacing all its rows by at
most ``2 C``; users with fewer than ``k`` records (padding slots inside them) are compared and
removed the same way; and a padding slot inside a real user, as well as whole padding users, must
be inert.

Only a :class:`~keras_dp_lm.errors.PrivacyRefusalError` of the DP step on its first call is
reported as a refusal (a pass: nothing was updated). An error the model itself (or its loss) raises
fails the check: a model that raises for some batch sizes may run, unchecked, on others in ``fit``.
A refusal on a later call (another batch size, padding) fails the check too: it could not finish.

Nothing is trained: the weights are never updated. The forward pass in training mode must be
deterministic for (a) and (b) to be meaningful (set dropout to 0 for the check). Opacus's
grad-sample tests and jax-privacy's auditing are the references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_dp_lm import clipping
from keras_dp_lm.data import attach_real_slots
from keras_dp_lm.data import split_real_slots
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.training import dp_clipped_gradient
from keras_dp_lm.training import per_example_losses


class _Refused(Exception):
    """The DP step refused the model (raised by the step, not by the checker)."""


class _Inconclusive(Exception):
    """The DP step raised after it had accepted the model (another batch shape)."""


class _ModelError(Exception):
    """The model (or its loss) raised an error that is not a refusal of the DP step."""


def _batches(batches):
    """A list of ``(x, y[, sample_weight])`` tuples, or a ``ValueError``."""
    batches = [batches] if isinstance(batches, tuple) else list(batches)
    for i, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)) or not 1 <= len(batch) <= 3:
            raise ValueError(
                "check_privacy takes one batch as a tuple (x, y) or (x, y, sample_weight), "
                f"or a list of such tuples; item {i} is a {type(batch).__name__}. A list "
                "[x, y] is read as two batches: pass (x, y).")
    return batches


@dataclasses.dataclass
class PrivacyCheckReport:
    """What :func:`check_privacy` measured; ``passed`` says whether every check held.

    Attributes:
        model_name: the model's ``name``.
        l2_norm_clip: C, the DP optimizer's clipping bound.
        tolerance: the relative tolerance of the comparisons with the naive loop.
        examples_per_user: k for a user-level check, else None.
        refused: the DP step's refusal of the model (a pass), or None.
        weights_unchanged: whether the model's weights were left as they were.
        num_examples: rows checked, over all batches.
        num_users: users checked (0 for an example-level check).
        max_norm_error: largest relative error of the step's per-unit norms.
        max_sum_error: largest relative error of the step's clipped sum.
        max_unit_error: largest gap, in C, of a unit's removal from its naive part.
        remove_one_ratio: largest move of the sum, in C, on removing a unit (<= 1).
        replace_one_ratio: largest move, in C, on replacing a unit adversarially (<= 2).
        padding_inert: whether padding slots left the clipped sum bit-identical.
        coverage: ``{method: number of variables}`` (``clipping_coverage``).
        exact_reasons: ``{variable path: reason}`` for exact per-example gradients.
        failures: one message per failed check (none: passed).
    """

    model_name: str
    l2_norm_clip: float
    tolerance: float
    examples_per_user: int | None = None
    refused: str | None = None
    weights_unchanged: bool = True
    num_examples: int = 0
    num_users: int = 0
    max_norm_error: float = 0.0
    max_sum_error: float = 0.0
    max_unit_error: float = 0.0
    remove_one_ratio: float = 0.0
    replace_one_ratio: float = 0.0
    padding_inert: bool = True
    coverage: dict[str, int] = dataclasses.field(default_factory=dict)
    exact_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def privacy_unit(self) -> str:
        """``"user"`` when checked with ``examples_per_user``, else ``"example"``."""
        return "example" if self.examples_per_user is None else "user"

    def __str__(self):
        rows = [("model", self.model_name), ("l2_norm_clip C", f"{self.l2_norm_clip:g}")]
        if self.refused:
            rows += [("refused before any update", self.refused.splitlines()[0][:100]),
                     ("weights unchanged", str(self.weights_unchanged))]
        else:
            tol, unit = self.tolerance, self.privacy_unit
            rows += [("examples checked", str(self.num_examples))]
            if self.examples_per_user is not None:
                rows += [("users checked", f"{self.num_users} ({self.examples_per_user} "
                                           "rows each)")]
            rows += [
                (f"per-{unit} norms vs naive loop", f"max rel. error {self.max_norm_error:.2e}"
                 f" (<= {tol:g})"),
                ("clipped sum vs naive loop", f"rel. error {self.max_sum_error:.2e} (<= {tol:g})"),
                (f"one {unit}'s part vs naive loop",
                 f"differs by {self.max_unit_error:.2e} C (<= {tol:g})"),
                (f"remove one {unit}", f"moves the sum by {self.remove_one_ratio:.4f} C (<= 1)"),
                (f"replace one {unit} (adversarial)",
                 f"moves the sum by {self.replace_one_ratio:.4f} C (<= 2)"),
                ("padding slots inert", str(self.padding_inert)),
                ("coverage", ", ".join(f"{k} {v}" for k, v in sorted(self.coverage.items()))),
            ]
            rows += [(f"exact: {path}", reason) for path, reason in self.exact_reasons.items()]
        rows.append(("result", "PASSED" if self.passed else "FAILED: " + "; ".join(self.failures)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _leaves(batch):
    x, y, sample_weight = (tuple(batch) + (None,) * 3)[:3]
    return x, y, sample_weight


def _take(structure, index):
    return tf.nest.map_structure(
        lambda t: None if t is None else np.asarray(t)[index], structure)


def _flat(grads):
    return np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in grads])


def _naive(model, x, y, sample_weight, clip, k=1, real=None, keep=(), clip_norms=None):
    """Each unit alone (an example, or a user's ``k`` rows): its loss (the
    mean over the unit's real rows), gradient, norm, clip; the sum, and the
    clipped contributions of the units in ``keep`` (a dict). With
    ``clip_norms`` (one per real unit: the step's norms, which include its
    rounding allowance), each unit is clipped at that norm instead of its own."""
    variables = model.trainable_variables
    size = len(tf.nest.flatten(x)[0])
    real = np.ones(size, bool) if real is None else np.asarray(real, bool)
    total, norms, kept = 0.0, [], {}
    for u in range(size // k):
        rows = np.arange(u * k, (u + 1) * k)[real[u * k:(u + 1) * k]]
        if not len(rows):
            continue
        xu, yu = _take(x, rows), _take(y, rows)
        swu = None if sample_weight is None else _take(sample_weight, rows)
        with tf.GradientTape() as tape:
            outputs = model(xu, training=True)
            loss = tf.reduce_mean(per_example_losses(model, xu, yu, outputs, swu))
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(tape.gradient(loss, variables), variables)]
        flat = _flat(grads)
        norm = float(np.linalg.norm(flat))
        at = norm if clip_norms is None else float(clip_norms[len(norms)])
        norms.append(norm)
        contribution = (min(1.0, clip / at) if at > 0 else 1.0) * flat
        total = total + contribution
        if u in keep:
            kept[u] = contribution
    return np.asarray(norms), total, kept


def _adversarial(rng, leaf, scale, values):
    """Replacement values for ``leaf``: large random floats; for integers (token
    ids, labels), values drawn from ``values``, those the batch holds, so that
    an id stays inside any vocabulary the batch fits."""
    leaf = np.asarray(leaf)
    if leaf.dtype.kind == "f":
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
    if leaf.dtype.kind in "iu":
        return rng.choice(np.unique(values), size=leaf.shape).astype(leaf.dtype)
    return leaf[::-1].copy()


def _replace(structure, rows, rng, scale):
    """``structure`` with ``rows`` (an int or a slice) replaced by adversarial values."""
    rows = slice(rows, rows + 1) if isinstance(rows, (int, np.integer)) else rows

    def one(t):
        if t is None:
            return None
        t = np.array(t, copy=True)
        t[rows] = _adversarial(rng, t[rows], scale, t)
        return t
    return tf.nest.map_structure(one, structure)


def _slots(real, k):
    """The real-slot mask the step reads: ``[B]`` for examples, ``[B / k, k]``
    (a user batch, as :func:`keras_dp_lm.data.poisson_user_batches` makes)."""
    real = np.asarray(real, "float32")
    return real if k is None else real.reshape(-1, k)


def check_privacy(model: keras.Model, batches: tuple[Any, ...] | Sequence[tuple[Any, ...]],
                  num_examples: int | None = None, adversarial_scale: float = 1e3,
                  tolerance: float | None = None, seed: int = 0, raise_on_failure: bool = False,
                  examples_per_user: int | None = None) -> PrivacyCheckReport:
    """Check the DP step of ``model`` on a few batches; returns a :class:`PrivacyCheckReport`.

    Args:
        model: a model compiled with a keras_dp_lm DP optimizer (any
            ``noise_multiplier``: no noise is drawn, nothing is updated).
        batches: one batch ``(x, y)`` / ``(x, y, sample_weight)`` of arrays, or
            a list of them, as the model's ``train_step`` receives them (for
            KerasHub tasks: the preprocessor's output).
        num_examples: how many units (examples, or users) of each batch to
            remove / replace for the sensitivity checks, spread over the batch.
            Default: 4, and every unit when the compute dtype is bfloat16. A
            leak confined to a unit not removed shows only in the comparison of
            the whole sum, relative to its norm: at float32's 1e-4 that is a
            small fraction of ``C``, at bfloat16's 2e-2 of a 32-unit batch it
            could be ``0.3 C``, hence the full sweep there. Pass the number of
            units in a batch to remove every one at any dtype.
        adversarial_scale: scale of the adversarial float inputs.
        tolerance: relative tolerance of (a) and of the bounds in (b);
            default 1e-4, 2e-2 when the compute dtype is bfloat16 (the naive
            loop then differs by bfloat16 rounding; the bound itself is exact to
            float32 rounding, checked at 1e-5).
        seed: seed of the adversarial examples.
        raise_on_failure: raise ``AssertionError`` with the report if a check fails.
        examples_per_user: check user-level DP instead: every ``k`` consecutive
            rows of a batch are one user's records (the batch size must be a
            multiple of ``k``), clipped and removed / replaced together.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=1.0),
        ...               loss="mse")
        >>> x, y = np.random.default_rng(0).normal(size=(2, 6, 4)).astype("float32")[0], \\
        ...     np.zeros((6, 3), "float32")
        >>> report = kdp.testing.check_privacy(model, (x, y))
        >>> report.passed, round(report.remove_one_ratio, 3)
        (True, 1.0)
        >>> print(report)  # doctest: +ELLIPSIS
        model ...
        result ... PASSED
        >>> users = kdp.testing.check_privacy(model, (x, y), examples_per_user=3)
        >>> users.passed, users.privacy_unit, users.num_users
        (True, 'user', 2)
    """
    optimizer = getattr(model, "optimizer", None)
    if not is_dp_optimizer(optimizer):
        raise ValueError("check_privacy needs a model compiled with a keras_dp_lm DP "
                         "optimizer, e.g. model.compile(optimizer=kdp.DPSGD(...), loss=...).")
    if examples_per_user is not None and (
            not isinstance(examples_per_user, (int, np.integer)) or examples_per_user < 1):
        raise ValueError(f"`examples_per_user` must be a positive int or None, got "
                         f"{examples_per_user!r}.")
    user_k = None if examples_per_user is None else int(examples_per_user)
    k = user_k or 1
    batches = _batches(batches)
    clip = float(optimizer.l2_norm_clip)
    compute = getattr(getattr(model, "dtype_policy", None), "compute_dtype", "float32")
    if tolerance is None:
        tolerance = 2e-2 if compute == "bfloat16" else 1e-4
    if num_examples is None:
        num_examples = np.inf if compute == "bfloat16" else 4
    elif not isinstance(num_examples, (int, np.integer)) or num_examples < 1:
        raise ValueError(f"`num_examples` must be a positive int or None, got "
                         f"{num_examples!r}.")
    # The C and 2 C bounds hold to float32 rounding whatever the compute dtype:
    # `tolerance` (the comparison with the naive loop) does not loosen them.
    bound_tol = 1e-4
    accepted = []  # the step has run once: a later error is not a refusal
    report = PrivacyCheckReport(model_name=getattr(model, "name", type(model).__name__),
                                l2_norm_clip=clip, tolerance=tolerance,
                                examples_per_user=user_k)
    before = [np.array(v.numpy()) for v in model.trainable_variables]

    @tf.function(reduce_retracing=True, autograph=False)
    def clipped(x, y, sample_weight):
        result = dp_clipped_gradient(model, (x, y, sample_weight))
        mask = result.mask if result.mask is not None else tf.ones_like(result.norms)
        rounding = (tf.zeros_like(result.norms) if result.rounding is None
                    else result.rounding)
        return result.grads, result.norms, mask, rounding

    def step(x, y, sample_weight, real=None):
        """The step's clipped sum and the norms of its real units; ``real`` marks
        the real rows (all of them by default; a user batch is always marked)."""
        if real is not None or user_k is not None:
            size = len(tf.nest.flatten(x)[0])
            real = np.ones(size, bool) if real is None else real
            sample_weight = attach_real_slots(sample_weight, _slots(real, user_k))
        try:
            grads, norms, mask, rounding = clipped(x, y, sample_weight)
        except PrivacyRefusalError as error:  # only the DP step's own refusals count
            if accepted:
                raise _Inconclusive(f"{type(error).__name__}: {error}") from error
            raise _Refused(f"{type(error).__name__}: {error}") from error
        except (ValueError, TypeError, NotImplementedError) as error:
            # the model's (or its loss's) own error: the check cannot vouch for a
            # model it could not run, and fit may meet other batch sizes
            if accepted:
                raise _Inconclusive(f"{type(error).__name__}: {error}") from error
            size = len(tf.nest.flatten(x)[0])
            raise _ModelError(f"{type(error).__name__} on a batch of {size} rows: "
                              f"{error}") from error
        accepted.append(True)
        # accumulation pads the batch to a multiple of its steps: keep real units
        norms, mask, rounding = norms.numpy(), mask.numpy(), rounding.numpy()
        if user_k is not None and len(norms) != len(mask):
            mask = mask.reshape(-1, user_k).max(axis=1)
        if len(norms) != len(mask):  # not one norm per unit: no unit-wise comparison
            return _flat([g.numpy() for g in grads]), np.full((2, len(mask)), np.inf)
        return _flat([g.numpy() for g in grads]), np.stack([norms[mask > 0],
                                                            rounding[mask > 0]])

    def compare(norms, ref_norms, full, ref_sum):
        """``norms``: the step's (norms, rounding allowances) per real unit. Its
        float32 reading (the norm without the allowance) must match the naive
        norm; its sum, the naive units clipped at the step's norms."""
        if norms.shape[1:] != ref_norms.shape:
            report.max_norm_error = np.inf
        else:
            norms, rounding = norms.astype("float64")
            reading = np.sqrt(np.maximum(norms ** 2 - rounding, 0.0))
            report.max_norm_error = max(report.max_norm_error, float(np.max(
                np.abs(reading - ref_norms) / np.maximum(ref_norms, 1e-12), initial=0.0)))
        report.max_sum_error = max(report.max_sum_error, float(
            np.linalg.norm(full - ref_sum) / max(np.linalg.norm(ref_sum), 1e-12)))

    rng = np.random.default_rng(seed)
    try:
        for batch in batches:
            x, y, sample_weight = _leaves(batch)
            mask, _, weight = split_real_slots(sample_weight)
            if mask is not None:
                raise ValueError("Pass unpadded batches; check_privacy adds its own padding.")
            size = len(tf.nest.flatten(x)[0])
            if size % k:
                raise ValueError(f"A batch of {size} rows does not split into users of "
                                 f"examples_per_user={k} rows each.")
            units = size // k
            # The model runs on the batch outside the DP step: an error here is
            # the batch's or the model's, never a refusal (raised as is).
            model(x, training=False)
            full, norms = step(x, y, sample_weight)
            again, _ = step(x, y, sample_weight)
            if not np.allclose(full, again, rtol=1e-6, atol=0.0):
                report.failures.append(
                    "the training forward pass is not deterministic (two steps on the same "
                    "batch differ), so nothing can be compared: set dropout (and other "
                    "training-time randomness) to 0 for the check")
                break
            # the units removed / replaced: spread over the batch (first, last,
            # every micro-batch), not only its first rows
            tested = np.unique(np.linspace(0, units - 1, min(num_examples, units)).round()
                               .astype(int))
            ref_norms, ref_sum, ref_units = _naive(model, x, y, weight, clip, k, keep=tested,
                                                   clip_norms=norms[0])
            report.num_examples += size
            report.num_users += units if user_k else 0
            compare(norms, ref_norms, full, ref_sum)

            def remove(u, base, reference, real):
                """Remove unit ``u`` from the batch whose real rows are ``real``:
                the sum must move by <= C, and by exactly u's naive clipped part."""
                keep = real.copy()
                keep[u * k:(u + 1) * k] = False
                removed, _ = step(x, y, sample_weight, keep)
                moved = base - removed
                report.remove_one_ratio = max(report.remove_one_ratio,
                                              float(np.linalg.norm(moved)) / clip)
                report.max_unit_error = max(report.max_unit_error, float(
                    np.linalg.norm(moved - reference)) / clip)

            for u in tested:
                rows = slice(u * k, (u + 1) * k)
                remove(u, full, ref_units[u], np.ones(size, bool))
                adv_x = _replace(x, rows, rng, adversarial_scale)
                adv_y = _replace(y, rows, rng, adversarial_scale)
                adv_w = sample_weight
                if sample_weight is not None:
                    adv_w = np.array(sample_weight, dtype="float32", copy=True)
                    adv_w[rows] = 1e9
                replaced, _ = step(adv_x, adv_y, adv_w)
                report.replace_one_ratio = max(report.replace_one_ratio,
                                               float(np.linalg.norm(full - replaced)) / clip)
            if user_k is not None and k > 1:
                # users with fewer than k records (padding slots inside them):
                # the naive comparison, and removing such a user, as above
                partial = np.ones(size, bool)
                for i, u in enumerate(tested):
                    partial[u * k + 1 + i % (k - 1):(u + 1) * k] = False
                part_sum, part_norms = step(x, y, sample_weight, partial)
                ref_norms, ref_sum, ref_units = _naive(model, x, y, weight, clip, k,
                                                       partial, keep=tested,
                                                       clip_norms=part_norms[0])
                compare(part_norms, ref_norms, part_sum, ref_sum)
                for u in tested:
                    remove(u, part_sum, ref_units[u], partial)
            # padding: two extra units with arbitrary contents change nothing, nor
            # (user level) a padding slot inside the first, real user
            pad = np.concatenate([np.ones(size, bool), np.zeros(2 * k, bool)])
            if user_k is not None and k > 1:
                pad[k - 1] = False
            index = np.concatenate([np.arange(size), rng.integers(0, size, 2 * k)])
            px, py = _take(x, index), _take(y, index)
            pw = None if sample_weight is None else _take(sample_weight, index)
            first, _ = step(px, py, pw, pad)
            qx, qy = px, py
            for row in np.flatnonzero(~pad):
                qx = _replace(qx, row, rng, adversarial_scale)
                qy = _replace(qy, row, rng, adversarial_scale)
            second, _ = step(qx, qy, pw, pad)
            report.padding_inert = report.padding_inert and bool(np.array_equal(first, second))
    except _Refused as refusal:
        report.refused = str(refusal)
    except _ModelError as error:
        report.failures.append(
            "the model itself raised (not a refusal of the DP step), so the check could "
            f"not run it: {' '.join(str(error).split())[:300]}")
    except _Inconclusive as error:
        report.failures.append(
            "the DP step accepted this model, then raised on a batch of another size "
            f"or padding, so the check could not finish: {str(error).splitlines()[0][:300]}")
    after = [np.array(v.numpy()) for v in model.trainable_variables]
    report.weights_unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
    if report.refused is None and not report.num_examples and not report.failures:
        report.failures.append("no example was checked (empty batches)")
    if report.refused is None:
        coverage = clipping.clipping_coverage(model)
        report.coverage = {k: sum(1 for v in coverage.values() if v == k)
                           for k in set(coverage.values())}
        report.exact_reasons = {
            v.path: clipping.exact_reason(model, v) for v in model.trainable_variables
            if coverage.get(v.path) == "exact"}
        if report.max_norm_error > tolerance:
            report.failures.append(f"per-{report.privacy_unit} norms differ by "
                                   f"{report.max_norm_error:.2e}")
        if report.max_sum_error > tolerance:
            report.failures.append(f"clipped sum differs by {report.max_sum_error:.2e}")
        if report.max_unit_error > tolerance:
            report.failures.append(
                f"removing a {report.privacy_unit} moved the sum by {report.max_unit_error:.2e} C "
                f"more or less than its naive clipped gradient")
        if report.remove_one_ratio > 1 + bound_tol:
            report.failures.append(f"removing one {report.privacy_unit} moved the sum by "
                                   f"{report.remove_one_ratio:.4f} C")
        if report.replace_one_ratio > 2 * (1 + bound_tol):
            report.failures.append(f"replacing one {report.privacy_unit} moved the sum by "
                                   f"{report.replace_one_ratio:.4f} C")
        if not report.padding_inert:
            report.failures.append("padding slots changed the clipped sum")
    if not report.weights_unchanged:
        report.failures.append("the weights changed")
    if raise_on_failure and not report.passed:
        raise AssertionError(str(report))
    return report
