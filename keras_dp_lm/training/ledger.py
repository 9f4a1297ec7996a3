"""The model's privacy ledger: what every noised update actually used.

The ledger belongs to the **model** (and to its saved file), not to whichever
optimizer object is attached: recompiling with a fresh DP optimizer, assigning
``model.optimizer = ...`` or reloading a ``.keras`` / ``.weights.h5`` file keeps
counting from what the model has received.

It is a small table of rows ``(noise_multiplier, sampling_rate,
max_real_batch, updates)``, written by the traced DP step from the values the
step itself used (never from Python attributes read later):

* ``noise_multiplier``: sigma baked into the traced step;
* ``sampling_rate``: the larger of the Poisson rate the batch carries (see
  :func:`keras_dp_lm.data.attach_real_slots`; 0 for fixed-size batches) and
  the rate of the :class:`~keras_dp_lm.callbacks.PrivacyAccountant` that
  checked the update (its ``batch_size / dataset_size``). A fixed-size batch
  trained with no accountant attached has 0 and is accounted at
  ``max_real_batch / dataset_size`` of whichever accountant reads it;
* ``max_real_batch``: the largest number of real (non-padding) examples of a
  logical batch in that row (users, for user-level training).

The ledger also holds its privacy unit (:attr:`PrivacyLedger.privacy_unit`):
``"example"``, or ``"user"`` when the updates clipped each user's gradient
(:func:`keras_dp_lm.data.poisson_user_batches`); the step refuses to mix them.

Consecutive updates with the same sigma and q share a row. When the table is
full, a new update is merged into the last row of its kind (fixed-size, q = 0;
Poisson, q > 0) conservatively (smallest sigma, largest q and batch), which can
only over-report epsilon; a fixed-size row is never merged into a Poisson row,
whose q would reprice it.

The accountant registers the parameters it assumes (:meth:`PrivacyLedger.set_limits`);
the step then checks every batch against them *before* applying the update.

Example:
    >>> import keras, numpy as np, keras_dp_lm as kdp
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
    ...               loss="mse")
    >>> _ = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=4, verbose=0)
    >>> kdp.ledger_of(model).rows()   # no accountant attached: q unknown (0)
    [LedgerRow(noise_multiplier=1.0, sampling_rate=0.0, max_real_batch=4.0, updates=2)]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
import keras
import tensorflow as tf

from keras_dp_lm.accounting.events import LedgerRow
from keras_dp_lm.accounting.overflow import bernstein_excess
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm import _keras_internals as keras_internals
from keras_dp_lm.training.ledger_rows import COLUMNS
from keras_dp_lm.training.ledger_rows import MAX_ROWS
from keras_dp_lm.training.ledger_rows import PRIVACY_UNITS
from keras_dp_lm.training.ledger_rows import fit_table
from keras_dp_lm.training.ledger_rows import merge_rows
from keras_dp_lm.training.ledger_rows import new_lineage_id
from keras_dp_lm.training.ledger_rows import rows_after
from keras_dp_lm.training.ledger_rows import total_updates
from keras_dp_lm.training.ledger_rows import unit_name
from keras_dp_lm.training.ledger_rows import unshared_rows
from keras_dp_lm.training.weight_marks import mark_dp_trained

_LIMITS = 5
# The conditions PrivacyLedger.check_parts returns, in order.
CHECKS = ("noise_multiplier", "sampling_rate", "poisson_cap", "running_total",
          "fixed_batch", "unit")
# The running total of Poisson batches' real counts is refused above a bound
# that honest draws exceed with probability at most 1e-12 over 1e6 checks.
_CUMULATIVE_LOG_TERM = float(np.log(1e6 / 1e-12))


class PrivacyLedger(keras_internals.KerasSaveable):
    """Rows of ``(noise_multiplier, sampling_rate, max_real_batch, updates)``.

    Create it with :func:`ledger_of`; do not construct it directly.
    """

    def __init__(self) -> None:
        with tf.init_scope():
            self.table = keras.Variable(
                np.zeros((MAX_ROWS, COLUMNS)), dtype="float64", trainable=False,
                name="dp_ledger_table", aggregation="only_first_replica")
            self.num_rows = keras.Variable(
                0, dtype="int64", trainable=False, name="dp_ledger_rows",
                aggregation="only_first_replica")
            # Accounted limits: (smallest sigma, largest q, largest real batch of
            # a fixed-size batch, largest real batch of a Poisson batch, expected
            # real count of a Poisson batch); 0 means "not checked".
            self.limits = keras.Variable(
                np.zeros((_LIMITS,)), dtype="float64", trainable=False,
                name="dp_ledger_limits", aggregation="only_first_replica")
            # Every Poisson batch checked by an accountant, over the model's
            # life (saved with it): (expected real examples, their variance,
            # real examples), for the check of the running total.
            self.poisson_seen = keras.Variable(
                np.zeros((3,)), dtype="float64", trainable=False,
                name="dp_ledger_poisson_seen", aggregation="only_first_replica")
            self.violations = keras.Variable(
                0, dtype="int64", trainable=False, name="dp_ledger_violations",
                aggregation="only_first_replica")
            # What one row of the batch dimension protects: PRIVACY_UNITS code.
            self.unit = keras.Variable(
                0, dtype="int64", trainable=False, name="dp_ledger_unit",
                aggregation="only_first_replica")
            # (this ledger's random id, the id of the ledger it started from,
            # how many of that ledger's updates it started with): a loaded
            # file's rows are combined with the rows already held by what the
            # two histories share (see load_own_variables).
            # A private hyperparameter search this model was released by
            # (keras_dp_lm.tuning.private_search): (its epsilon, its delta, how
            # many of the first updates are the released trial's, which its
            # epsilon already covers). Zeros: none. The number of trials is
            # not recorded.
            self.selection = keras.Variable(
                np.zeros((3,)), dtype="float64", trainable=False,
                name="dp_ledger_selection", aggregation="only_first_replica")
            self.lineage = keras.Variable(
                np.array([new_lineage_id(), 0, 0]), dtype="int64", trainable=False,
                name="dp_ledger_lineage", aggregation="only_first_replica")
        # The accountant whose limits are registered (a weak reference).
        self._limits_owner = None
        # Set when a load gave the model updates the ledger cannot count.
        self._refusal = None
        # Ledgers whose rows this one took over when it was created (inherit),
        # with how many updates each had then.
        self._includes = weakref.WeakKeyDictionary()

    # -- Keras saving (the ledger is saved with the model's weights) ---------
    def _obj_type(self):
        return "Loss"  # any type Keras walks; the ledger has no saveable children

    def save_own_variables(self, store: MutableMapping[str, Any]) -> None:
        store["table"] = np.asarray(self.table.numpy())
        store["num_rows"] = np.asarray(self.num_rows.numpy())
        store["unit"] = np.asarray(self.unit.numpy())
        store["poisson_seen"] = np.asarray(self.poisson_seen.numpy())
        store["lineage"] = np.asarray(self.lineage.numpy())
        store["selection"] = np.asarray(self.selection.numpy())

    def load_own_variables(self, store: Mapping[str, Any] | None) -> None:
        """Combine a saved ledger with the updates the model already holds.

        Keras restores the layers before the ledger, and with
        ``load_weights(..., skip_mismatch=True)`` (or a file holding only some
        of the model's layers) the weights it skipped keep what they had
        received. The rows held are therefore never dropped: the file's rows
        are added to them, except the updates both histories share (the file
        is an earlier state of this ledger, of the ledger it started from, or
        started from this one). A file with no DP update adds nothing; a model
        with no DP update takes the file's rows as they are. This can only
        over-report: reloading public weights into a DP-trained model keeps
        its count (build a fresh model to start over). ``store``: the layer's
        Keras weights store (None, or no ``table`` entry: nothing saved).
        """
        # A file saved before any DP training (or by a plain Keras model) has
        # no ledger: the model has received no noised update.
        if store is None or "table" not in list(store.keys()):
            return
        keys = list(store.keys())
        table = np.asarray(store["table"], dtype="float64")
        count = int(np.asarray(store["num_rows"]))
        missing = sorted({"unit", "poisson_seen", "lineage", "selection"} - set(keys))
        if table.shape != (MAX_ROWS, COLUMNS) or not 0 <= count <= MAX_ROWS or missing:
            raise ValueError(
                f"The saved privacy ledger has shape {table.shape} and {count} rows"
                + (f" and lacks {missing}" if missing else "")
                + f"; expected ({MAX_ROWS}, {COLUMNS}) and every entry. It was written by "
                "an incompatible keras_dp_lm version.")
        file_rows = [(float(s), float(q), float(b), int(n)) for s, q, b, n in table[:count]]
        if not file_rows:
            return
        file_unit = int(np.asarray(store["unit"]))
        file_seen = np.asarray(store["poisson_seen"], dtype="float64")
        file_lineage = np.asarray(store["lineage"], dtype="int64").tolist()
        file_selection = np.asarray(store["selection"], dtype="float64")
        held = self.rows()
        new = unshared_rows(held, self.lineage.numpy().tolist(), file_rows, file_lineage)
        if new and file_selection[0] > 0:
            self._add_selection(file_selection, first=not held)
        if new:
            units = {int(self.unit.numpy()), file_unit} - {0}
            if len(units) > 1:
                # Keras turns an error here into a warning under
                # skip_mismatch=True, with the weights loaded: the ledger then
                # refuses every later use (see rows()).
                self._refusal = PrivacyRefusalError(
                    "The weights loaded into this model were trained at another "
                    f"privacy unit ({unit_name(file_unit)}) than the model's "
                    f"({self.privacy_unit}), and one ledger counts one unit, so its "
                    "epsilon is unknown. Load them into a fresh model, or train at "
                    "one unit.")
                raise self._refusal
            rows = fit_table(held + new)
            padded = np.zeros((MAX_ROWS, COLUMNS))
            padded[:len(rows)] = rows
            self.table.assign(padded)
            self.num_rows.assign(len(rows))
            self.unit.assign(file_unit)
            self.poisson_seen.assign(self.poisson_seen.numpy() + file_seen)
            if not held:  # the model's history starts at the file's
                own = self.lineage.numpy()
                self.lineage.assign(np.array([own[0], file_lineage[0], total_updates(file_rows)]))
        holder = self.__dict__.get("_holder", lambda: None)()
        if holder is not None:
            # The weights loaded with these DP updates refuse non-DP training,
            # also inside another model (keras_dp_lm.training.fit_guards), and
            # are not written to a legacy .h5 file, which drops the ledger.
            # (the save guards listen: keras_dp_lm.training.save_guards)
            mark_dp_trained(holder.weights, self, model=holder)

    def inherit(self, sources: Iterable[PrivacyLedger]) -> None:
        """Start from the DP updates of ``sources``: the ledgers of the DP steps
        (or loaded files) that trained weights this ledger's model holds. A
        model built on DP-trained weights (a new head on a DP-trained base, a
        layer reused from a DP model) has received those updates too, so its
        ledger counts them. What a source took over from another when it was
        created is not counted again, but what that other gained since is.
        Rows beyond the table merge conservatively within their kind
        (fixed-size, Poisson): smallest sigma, largest q and batch."""
        sources = list(sources)
        taken = {}  # ledger -> updates some source took over from it
        for source in sources:
            for ledger, updates in source._includes.items():
                taken[ledger] = max(taken.get(ledger, 0), updates)
        rows, units, contributed = [], set(), []
        for source in sources:
            new = rows_after(source.rows(), taken.get(source, 0))
            rows += new
            if new:
                units.add(source.privacy_unit)
                contributed.append(source)
        units -= {None}
        if len(units) > 1:
            holder = self.__dict__.get("_holder", lambda: None)()
            raise ValueError(
                f"keras_dp_lm cannot count the DP updates of the model "
                f"'{getattr(holder, 'name', '?')}': its weights were "
                f"trained at different privacy units ({sorted(units)}) by different "
                "models, and one ledger counts one unit. Train it from weights "
                "trained at one unit.")
        for source in sources:
            for ledger, updates in [(source, source.updates), *source._includes.items()]:
                self._includes[ledger] = max(self._includes.get(ledger, 0), updates)
        if not rows:
            return
        rows = fit_table(rows)
        table = np.zeros((MAX_ROWS, COLUMNS))
        table[:len(rows)] = rows
        self.table.assign(table)
        self.num_rows.assign(len(rows))
        self.unit.assign(PRIVACY_UNITS[units.pop()])
        for source in contributed:  # a search a source was released by
            if source.selection.numpy()[0] > 0:
                self._add_selection(source.selection.numpy(),
                                    first=len(contributed) == 1 and not taken)
        if len(contributed) == 1 and not taken:
            # its history starts at that ledger's: a file of it shares these
            source = contributed[0]
            self.lineage.assign(np.array(
                [self.lineage.numpy()[0], source.lineage.numpy()[0], source.updates]))

    # -- reading ---------------------------------------------------------------
    def rows(self) -> list[LedgerRow]:
        """The rows, as :class:`~keras_dp_lm.accounting.LedgerRow` tuples
        ``(noise_multiplier, sampling_rate, max_real_batch, updates)``.

        Raises :class:`~keras_dp_lm.PrivacyRefusalError` if a load gave the
        model updates this ledger cannot count (another privacy unit)."""
        if self._refusal is not None:
            raise self._refusal
        table = np.asarray(self.table.numpy())
        count = int(self.num_rows.numpy())
        return [LedgerRow(float(s), float(q), float(b), int(n)) for s, q, b, n in table[:count]]

    def record_selection(self, epsilon: float, delta: float, covers: int | None = None) -> None:
        """Record that this model was released by a private hyperparameter
        search spending ``(epsilon, delta)`` (:func:`keras_dp_lm.tuning.private_search`),
        whose epsilon covers the first ``covers`` updates the ledger holds (the
        released trial's; default: all of them). Updates it does not cover are
        counted on top of it."""
        covers = self.updates if covers is None else int(covers)
        if self.selection.numpy()[0] > 0 or not self.updates or not 0 <= covers <= self.updates:
            raise ValueError("record_selection() needs a ledger holding one trial's "
                             "updates and no earlier search.")
        self.selection.assign(np.array([float(epsilon), float(delta), float(covers)]))

    def _add_selection(self, other, first):
        """Compose another search's ``(epsilon, delta, covered)`` with this
        ledger's: epsilons and deltas add; the updates it covers stay excluded
        only if its rows come first (``first``), else they are counted too."""
        own = self.selection.numpy()
        covered = own[2] if own[0] > 0 else (other[2] if first else 0.0)
        self.selection.assign(np.array([own[0] + other[0], own[1] + other[1], covered]))

    def accounted_rows(self) -> list[LedgerRow]:
        """The rows an accountant prices as DP-SGD updates: :meth:`rows` without
        the updates a recorded search's epsilon covers (:meth:`selection_events`)."""
        return [LedgerRow(*row) for row in rows_after(self.rows(),
                                                      int(self.selection.numpy()[2]))]

    def selection_events(self) -> list[tuple[float, float]]:
        """``[(epsilon, delta)]`` of the private search this model was released
        by (composed with :meth:`accounted_rows`), or ``[]``."""
        epsilon, delta, _ = self.selection.numpy()
        return [(float(epsilon), float(delta))] if epsilon > 0 else []

    @property
    def privacy_unit(self) -> str | None:
        """``"example"``, ``"user"`` (what each update's clipping protected), or
        ``None`` before the first update."""
        code = int(self.unit.numpy())
        return next((name for name, c in PRIVACY_UNITS.items() if c == code), None)

    @property
    def updates(self) -> int:
        """Total number of noised updates the model has received."""
        return sum(row.updates for row in self.rows())

    def updates_so_far(self) -> tf.Tensor:
        """The number of updates recorded, as an int64 tensor (for the traced step)."""
        table = tf.convert_to_tensor(self.table.value)
        return tf.cast(tf.reduce_sum(table[:, 3]), tf.int64)

    def set_limits(self, noise_multiplier: float = 0.0, sampling_rate: float = 0.0,
                   batch_size: float = 0.0, poisson_batch_cap: float = 0.0,
                   poisson_mean: float = 0.0, owner: object = None) -> None:
        """Parameters the accountant assumes; the step refuses batches beyond them.

        ``noise_multiplier``: the smallest sigma; ``sampling_rate``: the largest
        Poisson rate; ``batch_size``: the largest real batch of a fixed-size batch
        (0 for each: not checked).

        ``poisson_batch_cap``: the most real examples a Poisson batch at
        ``sampling_rate`` may hold (a draw larger than it has negligible
        probability; a batch regrouped after sampling is refused).
        ``poisson_mean``: the expected real count of such a draw,
        ``(dataset_size + 1) * sampling_rate``: the running total of every
        Poisson batch an accountant has checked on this model (across fits,
        and saved with it) is refused once it exceeds what as many draws
        reach with probability 1e-12 (batches regrouped to below the cap, a
        few times the mean, are refused after a few updates; the ones before
        were not Poisson draws). ``owner``:
        the registering accountant; while another one is in a fit with its
        limits registered, a second one is refused (the ledger records one
        accountant's rate, and the step checks one set of limits).
        """
        current = self._limits_owner() if self._limits_owner is not None else None
        if owner is not None and current is not None and current is not owner and getattr(
                current, "in_fit", False):
            raise ValueError(
                "Two PrivacyAccountant callbacks in one fit: the model's ledger records "
                "the updates at one accountant's sampling rate and the step checks one "
                "set of limits. Pass a single PrivacyAccountant.")
        self.limits.assign(np.array(
            [noise_multiplier, sampling_rate, batch_size, poisson_batch_cap, poisson_mean],
            dtype="float64"))
        self.violations.assign(0)
        if owner is not None:
            self._limits_owner = weakref.ref(owner)

    def clear_limits(self) -> None:
        """Forget the registered limits (and their accountant)."""
        self.limits.assign(np.zeros((_LIMITS,)))
        self._limits_owner = None

    # -- writing (inside the traced step) -------------------------------------
    def check(self, noise_multiplier: tf.Tensor | float, sampling_rate: tf.Tensor | float,
              real_batch: tf.Tensor | float, unit: str = "example") -> tf.Tensor:
        """``ok`` (bool tensor): the batch is within the accounted limits, and
        of the ledger's privacy unit (``"example"`` or ``"user"``). The update's
        ``noise_multiplier``, its batch's ``sampling_rate`` (0: fixed-size) and
        ``real_batch``, its number of real units."""
        return tf.reduce_all(self.check_parts(noise_multiplier, sampling_rate, real_batch,
                                              unit))

    def check_parts(self, noise_multiplier: tf.Tensor | float, sampling_rate: tf.Tensor | float,
                    real_batch: tf.Tensor | float, unit: str = "example") -> tf.Tensor:
        """The conditions :meth:`check` requires, one bool each, in the order
        of ``CHECKS`` (a condition that does not apply to this kind of batch
        holds)."""
        limits = tf.convert_to_tensor(self.limits.value)
        sigma = tf.constant(noise_multiplier, tf.float64)
        q = tf.cast(sampling_rate, tf.float64)
        batch = tf.cast(real_batch, tf.float64)
        poisson = q > 0
        sigma_ok = (limits[0] <= 0) | (sigma >= limits[0] * (1 - 1e-12))
        # a Poisson batch's real count: the accountant's cap, or its batch size
        # when it accounts fixed-size batches (no cap)
        cap = tf.where(limits[3] > 0, limits[3], limits[2])
        rate_ok = (limits[1] <= 0) | (q <= limits[1] * (1 + 1e-9))
        cap_ok = (cap <= 0) | (batch <= cap * (1 + 1e-9))
        fixed_ok = (limits[2] <= 0) | (batch <= limits[2] * (1 + 1e-9))
        code = tf.constant(PRIVACY_UNITS[unit], tf.int64)
        held = tf.convert_to_tensor(self.unit.value)
        unit_ok = tf.equal(held, 0) | tf.equal(held, code)
        return tf.stack([sigma_ok, rate_ok | ~poisson, cap_ok | ~poisson,
                         self._running_total_ok(batch) | ~poisson, fixed_ok | poisson,
                         unit_ok])

    def _running_total_ok(self, batch):
        """The Poisson batches checked so far plus this one hold no more real
        examples than as many independent draws at their accountants' rates
        reach with probability 1e-12 (a sum of Binomials: Bernstein's bound
        on its expected value and variance)."""
        limits = tf.convert_to_tensor(self.limits.value)
        seen = tf.convert_to_tensor(self.poisson_seen.value) + self._expected_draw()
        bound = seen[0] + bernstein_excess(seen[1], _CUMULATIVE_LOG_TERM, sqrt=tf.sqrt)
        return (limits[4] <= 0) | (seen[2] + batch <= bound * (1 + 1e-9))

    def _expected_draw(self):
        """``(mean, variance, 0)`` of the real count of one draw at the
        registered accountant's rate (zeros without one)."""
        limits = tf.convert_to_tensor(self.limits.value)
        mean, q = limits[4], limits[1]
        return tf.stack([mean, mean * (1.0 - q), tf.constant(0.0, tf.float64)])

    def recorded_rate(self, sampling_rate: tf.Tensor | float) -> tf.Tensor:
        """The rate :meth:`record` writes for a batch carrying ``sampling_rate``:
        at least the registered accountant's (see :meth:`record`)."""
        return tf.maximum(tf.cast(sampling_rate, tf.float64),
                          tf.convert_to_tensor(self.limits.value)[1])

    def record(self, noise_multiplier: tf.Tensor | float, sampling_rate: tf.Tensor | float,
               real_batch: tf.Tensor | float, ok: tf.Tensor | bool, unit: str = "example") -> None:
        """Append one update (branch-free, so it runs in replica context and XLA).

        ``noise_multiplier``, ``sampling_rate``, ``real_batch`` and ``unit`` as for
        :meth:`check`; ``ok`` is its result: a False one is counted in
        ``violations`` (a ``PrivacyAccountant`` then stops the fit) and leaves
        the ledger's unit unchanged."""
        held = tf.convert_to_tensor(self.unit.value)
        self.unit.assign(tf.where(ok, tf.constant(PRIVACY_UNITS[unit], tf.int64), held))
        table = tf.convert_to_tensor(self.table.value)
        rows = tf.convert_to_tensor(self.num_rows.value)
        sigma = tf.constant(noise_multiplier, tf.float64)
        # With an accountant attached, an update is recorded at its rate when
        # the batch carries a smaller one or none: a fixed-size batch at the
        # accountant's batch / dataset_size (which the check bounds it by), so
        # a later accountant with another dataset_size cannot reprice it; a
        # Poisson batch labelled with a smaller rate than the accountant allows
        # (its label is the user's word) at the accountant's. Without one, a
        # fixed-size batch has rate 0 (priced at the reader's dataset_size).
        q = self.recorded_rate(sampling_rate)
        batch = tf.cast(real_batch, tf.float64)
        fresh = tf.stack([sigma, q, batch, tf.constant(1.0, tf.float64)])
        last = tf.maximum(rows - 1, 0)
        previous = tf.gather(table, last)
        same = (rows > 0) & tf.equal(previous[0], sigma) & tf.equal(previous[1], q)
        full = rows >= MAX_ROWS
        # A full table merges the update into the last row of its kind
        # (fixed-size, q == 0, priced at its batch over the reader's dataset
        # size; Poisson, q > 0): a fixed-size row merged into a Poisson row
        # would be repriced at the Poisson rate. With no row of its
        # kind, the last two rows (of the other kind) merge to make room.
        slots = tf.range(MAX_ROWS, dtype=rows.dtype)
        of_kind = (slots < rows) & tf.equal(table[:, 1] > 0, q > 0)
        kind_last = tf.reduce_max(tf.where(of_kind, slots, -1))
        target = tf.where(same, last, tf.maximum(kind_last, 0))
        into_row = same | (full & (kind_last >= 0))
        compact = full & ~into_row
        merged = merge_rows(tf.gather(table, target), fresh)
        table = tf.where(
            compact,
            tf.concat([table[:MAX_ROWS - 2],
                       merge_rows(table[MAX_ROWS - 2], table[MAX_ROWS - 1])[None],
                       fresh[None]], axis=0),
            tf.tensor_scatter_nd_update(
                table, tf.reshape(tf.where(into_row, target, tf.minimum(rows, MAX_ROWS - 1)),
                                  [1, 1]),
                tf.where(into_row, merged, fresh)[None]))
        self.table.assign(table)
        self.num_rows.assign(tf.where(into_row | compact, rows, rows + 1))
        self.violations.assign_add(tf.cast(tf.logical_not(ok), tf.int64))
        # only what an accountant checked (its expected count is known)
        counted = (ok & (tf.cast(sampling_rate, tf.float64) > 0)
                   & (tf.convert_to_tensor(self.limits.value)[4] > 0))
        zero = tf.constant(0.0, tf.float64)
        self.poisson_seen.assign_add(tf.where(
            counted, self._expected_draw() + tf.stack([zero, zero, batch]),
            tf.zeros([3], tf.float64)))
