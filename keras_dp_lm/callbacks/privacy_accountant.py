"""``PrivacyAccountant``: epsilon in ``fit``'s logs and a stop before a target epsilon."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_dp_lm.accounting._arguments import SAMPLING_MODES
from keras_dp_lm.accounting._arguments import SHUFFLE_NOTE
from keras_dp_lm.accounting._arguments import PrivacyBudgetExhaustedError
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_positive_int
from keras_dp_lm.accounting._arguments import check_number
from keras_dp_lm.accounting.epsilon import composed_curve
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.epsilon import largest_within
from keras_dp_lm.accounting.epsilon import compose_epsilon
from keras_dp_lm.accounting.epsilon import ledger_epsilon
from keras_dp_lm.accounting.epsilon import max_steps
from keras_dp_lm.accounting.events import as_event
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import ledger_events
from keras_dp_lm.accounting.report import privacy_statement
from keras_dp_lm.training.binding import is_bound_to_dp_step
from keras_dp_lm.training.fit_guards import check_optimizer_matches_step
from keras_dp_lm.training.model_ledgers import ledger_of
from keras_dp_lm.callbacks.accountant_report import accountant_report
from keras_dp_lm.callbacks.feature_releases import check_feature_releases
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.callbacks.batch_epsilon import BatchEpsilon
from keras_dp_lm.callbacks.fit_assumptions import resolve_fit_assumptions

if TYPE_CHECKING:
    import dp_accounting
    import tensorflow as tf


def _ledger(model):
    return ledger_of(model)


class PrivacyAccountant(keras.callbacks.Callback):
    """Keras callback: epsilon in the logs, and a stop before a target epsilon.

    Epsilon is computed from the model's privacy ledger
    (:func:`keras_dp_lm.ledger_of`), which the DP step writes with the noise
    multiplier, sampling rate and real batch size each update actually used,
    and which is saved with the model's weights. Several ``fit`` calls,
    recompiles with a fresh DP optimizer, ``BackupAndRestore`` resumes and
    reloaded models are all counted from what the model actually received.

    At the start of ``fit`` the accountant registers what it assumes (sigma,
    q, logical batch size) on the ledger; the DP step then refuses, before the
    update, any batch with a smaller sigma, a higher Poisson rate or more real
    examples than assumed, so the stop-before-target guarantee holds for every
    batch, also with ``steps_per_execution > 1``.

    Args:
        target_epsilon: optional budget for the training epsilon at ``delta``.
            Training stops BEFORE an update (or a ``steps_per_execution``
            group of updates) that would exceed it; ``fit`` refuses to start
            (:class:`PrivacyBudgetExhaustedError`) if no further group fits.
        delta: target delta; a warning is issued when ``delta >= 1/dataset_size``.
        dataset_size: number of training examples N (required unless
            ``batches`` gives it).
        accountant: ``"pld"`` (default, tight) or ``"rdp"``.
        batch_size: logical batch size of fixed-size batches. Defaults to the
            optimizer's ``expected_batch_size``, else ``ceil(N / steps_per_epoch)``
            with a warning. A batch with more real examples is refused.
        sampling: ``"poisson"``, ``"shuffle"`` (fixed-size shuffled batches,
            accounted as if Poisson, with a warning) or ``"auto"``: Poisson when
            ``batches`` or the optimizer's ``expected_batch_size`` is given.
        batches: the dataset from :func:`keras_dp_lm.data.poisson_batches`
            (or :func:`~keras_dp_lm.data.poisson_user_batches`, whose
            ``dataset_size`` is the number of users: epsilon is then
            user-level); its ``sampling_rate`` and ``dataset_size`` are used,
            so the rate is stated once.
        extra_events: other releases about the same data (``dp_accounting.DpEvent``
            or ``(epsilon, delta)`` pairs), composed with training in
            :meth:`report`. ``target_epsilon`` bounds the training alone.
        examples_per_user: optional k, for EXAMPLE-level training: :meth:`report`
            adds a user-level epsilon by group privacy (see
            :func:`user_level_epsilon`). Training on user batches is user-level
            already and needs no group privacy.
        verbose: 1 prints one line when training is stopped for the budget.

    ``logs["epsilon"]`` always comes from the chosen accountant. At the end of
    each epoch it is the exact epsilon of the ledger. Per batch, with
    ``"pld"``, it is an upper bound from the same accountant that never
    decreases: when training starts, epsilon is computed once at ~20 step
    counts up to the planned end (the budget limit, or ``epochs`` x ``steps``)
    with :func:`keras_dp_lm.accounting.epsilon_curve` (PLD composition reused
    across step counts, a small pessimistic margin for FFT round-off), and
    each batch logs the value at the next of these counts. The last batch of
    a run that ends as planned (budget stop, last step of the last epoch, or
    a callback's ``stop_training``) logs the exact value, equal to the
    epoch-end one. With ``"rdp"`` every value is exact.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> from keras_dp_lm.callbacks import PrivacyAccountant
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
        ...                                   noise_multiplier=1.0, seed=0),
        ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        >>> accountant = PrivacyAccountant(target_epsilon=2.0, delta=1e-3, dataset_size=64,
        ...                                batch_size=8, accountant="rdp", verbose=0)
        >>> history = model.fit(np.ones((64, 4)), np.zeros((64,)), batch_size=8,
        ...                     epochs=10, callbacks=[accountant], verbose=0)
        >>> accountant.dp_updates <= accountant.max_steps < accountant.dp_updates + 1
        True
        >>> history.history["epsilon"][-1] <= 2.0
        True
    """

    def __init__(self, target_epsilon: float | None = None, delta: float | None = None,
                 dataset_size: int | None = None, accountant: str = "pld",
                 batch_size: float | None = None, sampling: str = "auto",
                 batches: tf.data.Dataset | None = None,
                 extra_events: Sequence[dp_accounting.DpEvent | tuple[float, float]] = (),
                 examples_per_user: int | None = None, verbose: int = 1) -> None:
        super().__init__()
        self._batches_rate = None
        # A Poisson draw above the batches' padded cap (module docstring of
        # keras_dp_lm.data.poisson): the guarantee's delta grows by (1 + e^eps) p,
        # p over the updates applied (the report reads them from the ledger).
        self._overflow_cap = getattr(batches, "overflow_cap", None)
        # User batches (keras_dp_lm.data.poisson_user_batches) carry their k.
        self._user_batches = getattr(batches, "examples_per_user", None) is not None
        self._unit_pending = False
        if batches is not None:
            rate = getattr(batches, "sampling_rate", None)
            size = getattr(batches, "dataset_size", None)
            if rate is None or size is None:
                raise ValueError(
                    "`batches` must be a dataset from keras_dp_lm.data."
                    "poisson_batches (it carries sampling_rate and dataset_size).")
            if dataset_size is not None and int(dataset_size) != int(size):
                raise ValueError(
                    f"dataset_size={dataset_size} but the batches were drawn from "
                    f"{size} examples.")
            dataset_size, self._batches_rate = size, float(rate)
            if sampling == "shuffle":
                raise ValueError("Poisson `batches` cannot be accounted as shuffled.")
            sampling = "poisson"
        if delta is None:
            raise ValueError("PrivacyAccountant needs `delta` (e.g. 1/(10 * dataset_size)).")
        if dataset_size is None:
            raise ValueError(
                "PrivacyAccountant needs `dataset_size`: the number of training "
                "examples N (the sampling rate is batch_size / N). Keras cannot "
                "know it for generic datasets.")
        self.target_epsilon = (None if target_epsilon is None
                               else check_epsilon(target_epsilon))
        self.delta = check_delta(delta)
        self.dataset_size = check_positive_int("dataset_size", dataset_size)
        self.accountant = check_accountant(accountant)
        if batch_size is not None:
            batch_size = check_number("batch_size", batch_size)
            if batch_size <= 0:
                raise ValueError(f"`batch_size` must be > 0, got {batch_size!r}.")
        self.batch_size = batch_size
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"`sampling` must be one of {SAMPLING_MODES}, got {sampling!r}.")
        self.sampling = sampling
        self.extra_events = [as_event(e) for e in extra_events]
        self.examples_per_user = check_positive_int(
            "examples_per_user", examples_per_user, allow_none=True)
        self.verbose = verbose
        if self.delta >= 1.0 / self.dataset_size:
            warnings.warn(
                f"delta={self.delta:g} >= 1/dataset_size={1.0 / self.dataset_size:g}: "
                "a mechanism that publishes one random example outright satisfies "
                "this delta. Use delta well below 1/N (e.g. 1/(10 N)).", stacklevel=2)
        self._assumptions = None  # FitAssumptions of the last fit
        self._report_cache = (None, None)
        self._last_count = None
        self._limit = None
        self._shuffle_warned = False
        self._begin_checked = True
        self.in_fit = False  # between on_train_begin and on_train_end
        self.stopped_at = None
        self._exact_cache = {}  # exact epsilon by ledger rows (a few entries)
        self._batch_epsilon = BatchEpsilon(self._exact_epsilon)
        self._fit_start = None  # ledger count before the fit's first batch
        self._epoch = 0

    def _resolve(self):
        assumptions = resolve_fit_assumptions(
            self.model, dataset_size=self.dataset_size, batch_size=self.batch_size,
            sampling=self.sampling, batches_rate=self._batches_rate,
            steps=(self.params or {}).get("steps"))
        if assumptions.sampling == "shuffle" and not self._shuffle_warned:
            self._shuffle_warned = True
            warnings.warn(
                "PrivacyAccountant: batches are treated as " + SHUFFLE_NOTE + ". For "
                "a guarantee that matches the analysis, feed Poisson batches "
                "(keras_dp_lm.data.poisson_batches) and pass batches=dataset.",
                stacklevel=3)
        return assumptions

    def _rows(self):
        """The ledger's DP-SGD rows (without those a recorded search covers)."""
        return _ledger(self.model).accounted_rows()

    def _selection_events(self):
        """The private search the model was released by, if any, as events."""
        return [as_event(e) for e in _ledger(self.model).selection_events()]

    def _compute_limit(self):
        """Most total updates within the target, given the ledger so far."""
        if self.target_epsilon is None:
            return None
        sigma, rate = self._assumptions.noise_multiplier, self._assumptions.sampling_rate
        rows = self._rows()
        done = sum(row.updates for row in rows)
        selection = self._selection_events()
        if self._assumptions.dominates(rows, self.dataset_size) and not selection:
            # every update so far counted at this fit's cost: conservative, and
            # exact for a resumed fit; when that leaves no room (cheaper updates
            # of another kind: a DP linear probe's), compose them exactly
            quick = max_steps(self.target_epsilon, self.delta, sigma, rate, self.accountant)
            if quick > done:
                return quick
        prior = ledger_events(rows, self.dataset_size) + selection
        exact = {}

        def eps(extra):
            if extra not in exact:
                events = prior + ([dp_sgd_event(sigma, rate, extra)] if extra else [])
                exact[extra] = compose_epsilon(events, self.delta, self.accountant)
            return exact[extra]

        search = composed_curve(sigma, rate, self.delta, self.accountant, prior)
        return done + largest_within(search, eps, self.target_epsilon)

    @property
    def max_steps(self) -> int | None:
        """Most updates within ``target_epsilon`` (None without a target or before fit)."""
        if self.target_epsilon is None or self._assumptions is None:
            return None
        if self._limit is None:
            self._limit = self._compute_limit()
        return self._limit

    @property
    def sampling_rate(self) -> float | None:
        """q = logical batch size / dataset size (None before fit)."""
        return None if self._assumptions is None else self._assumptions.sampling_rate

    @property
    def dp_updates(self) -> int:
        """Noised updates the model has received (its saved privacy ledger)."""
        return _ledger(self.model).updates

    def dp_events(self) -> list[dp_accounting.DpEvent]:
        """The ``DpEvent`` of every noised update the model has received (its
        ledger, as applied), e.g. to compose with later training as
        ``extra_events`` of :func:`keras_dp_lm.recipes.suggest_recipe`."""
        if self.model is None:
            raise ValueError("dp_events() needs the accountant to have been used in fit().")
        return (ledger_events(self._rows(), self.dataset_size)
                + self._selection_events())

    @property
    def epsilon(self) -> float:
        """Training epsilon at ``delta`` of the ledger (chosen accountant)."""
        return self._exact_epsilon([row for row in self._rows() if row.updates])

    def _exact_epsilon(self, rows):
        selection = self._selection_events()
        key = (tuple(rows), tuple(selection), self.delta, self.accountant, self.dataset_size)
        if key not in self._exact_cache:
            if len(self._exact_cache) >= 8:
                self._exact_cache.pop(next(iter(self._exact_cache)))
            self._exact_cache[key] = (
                compose_epsilon(ledger_events(rows, self.dataset_size) + selection,
                                self.delta, self.accountant)
                if selection else
                ledger_epsilon(rows, self.dataset_size, self.delta, self.accountant))
        return self._exact_cache[key]

    def _count(self):
        count = self.dp_updates
        if self._last_count is not None and count < self._last_count:
            warnings.warn(
                f"The model's privacy ledger went down from {self._last_count} to "
                f"{count} updates: a backup or an older file was restored. Epsilon "
                "follows the model's saved ledger; updates from a discarded run "
                "are not counted, so never release that run's weights.", stacklevel=3)
            self._limit = None
        self._last_count = count
        return count

    def _check_budget(self, count):
        limit = self.max_steps
        spe = self._assumptions.steps_per_execution
        if limit is not None and count + spe > limit:
            spent = self.epsilon
            target = f"target_epsilon={self.target_epsilon:g} (delta={self.delta:g})"
            if spent > self.target_epsilon:  # the ledger alone is over the target
                status = (f", which already spend epsilon {spent:.3g}, more than {target}: "
                          "it allows no further update")
                larger = f"above {spent:.3g} (the cost of what is already applied)"
            elif count == 0:  # not even the first execution fits
                sigma, rate = self._assumptions.noise_multiplier, self._assumptions.sampling_rate
                first = compute_epsilon(sigma, rate, spe, self.delta, self.accountant)
                raise PrivacyBudgetExhaustedError(
                    f"Privacy budget too small for one step: {spe} update(s) at noise multiplier"
                    f" {sigma:g} and sampling rate {rate:.4g} cost epsilon {first:.3g}, more "
                    f"than {target}; nothing was applied. Raise the noise multiplier "
                    "(calibrate_noise_multiplier gives it for your number of steps), sample "
                    f"smaller batches, or choose a target above {first:.3g} before any result.")
            else:
                status = (f" (epsilon {spent:.3g} so far) and {target} allows {limit} in "
                          "total" + (": none remains" if limit <= count else
                                     f" ({limit - count} remain, fewer than "
                                     f"steps_per_execution={spe}: compile with "
                                     "steps_per_execution=1 to use them)"))
                larger = "larger than this one"
            raise PrivacyBudgetExhaustedError(
                f"Privacy budget exhausted: the model has applied {count} noised updates"
                f"{status}. The target bounds every update in the model's privacy ledger, "
                "those of earlier fits and saved files included. To train further, give "
                f"the accountant a target_epsilon {larger}, chosen before looking at the "
                "results, or start again from weights that have not seen the private "
                "data (an empty ledger).")

    def _register_limits(self):
        _ledger(self.model).set_limits(**self._assumptions.ledger_limits(), owner=self)

    # -- the per-batch epsilon (keras_dp_lm.callbacks.batch_epsilon) ---------
    def _reset_batch_epsilon(self):
        self._batch_epsilon.reset()
        self._fit_start = None

    def _epsilon_after_batch(self, count, batch, final):
        rows = [row for row in self._rows() if row.updates]
        exact = (self.accountant == "rdp" or final or count == self._fit_start
                 or bool(self._selection_events()))  # a recorded search: composed exactly
        return self._batch_epsilon.value(
            rows, self._assumptions, delta=self.delta, dataset_size=self.dataset_size,
            exact=exact,
            planned_end=lambda n, others: self._planned_end(n, others, batch))

    def _last_planned_batch(self, batch):
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        # With steps_per_execution > 1 Keras numbers the last execution of an
        # epoch past its end (8 steps in executions of 3: batch 8), hence >=.
        return bool(steps and epochs and self._epoch == epochs - 1 and batch >= steps - 1)

    def _planned_end(self, n, others, batch):
        """Smallest possible final count of the updates the assumptions dominate
        (``n`` so far; ``others`` updates they do not), or None."""
        ends = []
        if self.max_steps is not None:
            ends.append(self.max_steps - others - self._assumptions.steps_per_execution + 1)
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        if steps and epochs:
            remaining = (epochs - 1 - self._epoch) * steps + max(0, steps - 1 - batch)
            ends.append(n + remaining // self._assumptions.gradient_accumulation_steps)
        return min(ends) if ends else None

    # -- Keras hooks ---------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # A DP optimizer assigned without compile leaves Keras's plain step in
        # place: nothing would be clipped, noised or counted.
        check_optimizer_matches_step(self.model, is_bound_to_dp_step(self.model))
        self.in_fit = True
        self._assumptions = self._resolve()
        # The training's unit: from user batches, else from earlier updates, else
        # known only after the first update (checked then).
        self._unit_pending = check_feature_releases(
            self.model, self.extra_events,
            "user" if self._user_batches else ledger_of(self.model).privacy_unit
            or ("example" if self._batches_rate is not None else None))
        self._limit = None
        self.stopped_at = None
        self._reset_batch_epsilon()
        self._register_limits()
        self._check_budget(self._count())
        # Re-checked before the first batch, after every on_train_begin (e.g.
        # BackupAndRestore loading a backup) has run.
        self._begin_checked = False

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._fit_start is None:
            self._fit_start = self.dp_updates
        if not self._begin_checked:
            self._begin_checked = True
            self._limit = None
            self._register_limits()  # a restored file may have brought other limits
            self._check_budget(self._count())
            self._reset_batch_epsilon()
            self._fit_start = self.dp_updates

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        ledger, assumed = _ledger(self.model), self._assumptions
        if int(ledger.violations.numpy()):
            self.model.stop_training = True
            raise ValueError(
                "A batch exceeded what PrivacyAccountant assumes (more real examples, "
                "a higher sampling rate or a smaller noise multiplier; or Poisson "
                "batches whose running total of real examples no Poisson draws at "
                "this rate reach: batches regrouped after sampling, e.g. with "
                "unbatch().batch(), are not Poisson draws, and the epsilon of the "
                "updates before this one is not what the ledger reports), or the model "
                "mixes examples (refused for fast clipping; use clipping='exact'); it "
                "was refused and contributed nothing. Assumed: batch_size="
                f"{assumed.batch_size:g} ({assumed.batch_size_source}), "
                f"q={assumed.sampling_rate:.6g}, sigma={assumed.noise_multiplier:g}.")
        if self._unit_pending and ledger.privacy_unit is not None:
            self._unit_pending = False
            check_feature_releases(self.model, self.extra_events, ledger.privacy_unit,
                                   applied=ledger.updates)
        count = self._count()
        limit = self.max_steps
        budget_end = limit is not None and count + assumed.steps_per_execution > limit
        if logs is not None:
            logs["epsilon"] = self._epsilon_after_batch(count, batch, final=(
                budget_end or self.model.stop_training or self._last_planned_batch(batch)))
        if budget_end:
            if not self.model.stop_training and self.verbose:
                print(f"\nPrivacyAccountant: stopping after {count} noised updates; "
                      f"the next would exceed target_epsilon={self.target_epsilon:g} "
                      f"(at most {limit} updates).")
            self.stopped_at = count
            self.model.stop_training = True

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.in_fit = False
        _ledger(self.model).clear_limits()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None and self._assumptions is not None:
            logs["epsilon"] = self.epsilon

    # -- reports ---------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """:func:`privacy_report` for what the model has received so far, plus
        ``dp_updates, ledger, batch_size_source, sampling_source,
        steps_per_execution, gradient_accumulation_steps, stopped_at``. Raises
        ``PrivacyRefusalError`` if the model now holds a release its total leaves
        out (a layer adapted again, or priors released again, after ``fit``)."""
        if self.model is None:
            raise ValueError("report() needs the accountant to have been used in fit().")
        self._check_releases_still_counted()
        if self._assumptions is None:
            self._assumptions = self._resolve()
        rows = [row for row in self._rows() if row.updates]
        selection = self._selection_events()
        # everything the report reads (the public attributes may be set after
        # construction)
        key = (tuple(rows), tuple(selection), self._assumptions, self.delta, self.accountant,
               self.dataset_size, repr(self.extra_events), self.examples_per_user,
               self.target_epsilon, self.stopped_at)
        if self._report_cache[0] != key:
            self._report_cache = (key, accountant_report(
                self, self._assumptions, rows, selection,
                overflow_cap=self._overflow_cap, batches_rate=self._batches_rate))
        return copy.deepcopy(self._report_cache[1])

    def _check_releases_still_counted(self):
        """The check made before training, again: a layer adapted (or priors
        released) after ``fit`` is a release about this data that the report's
        total would leave out."""
        ledger = ledger_of(self.model)
        try:
            check_feature_releases(self.model, self.extra_events,
                                   "user" if self._user_batches else ledger.privacy_unit,
                                   applied=ledger.updates)
        except PrivacyRefusalError as error:
            raise PrivacyRefusalError(
                "report(): the model now holds a release about the training data that "
                "this accountant's total does not count (a layer adapted again, or "
                f"priors released again, after training?). {error}") from None

    def statement(self) -> str:
        """A readable paragraph (the same format as ``keras-dp-lm epsilon``)."""
        return privacy_statement(self.report())

