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
    [(1.0, 0.0, 4.0, 2)]
"""

import os
import weakref

import numpy as np
import keras
import tensorflow as tf

from keras_dp_lm.accounting.overflow import bernstein_excess
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.training import keras_internals

MAX_ROWS = 32
_COLUMNS = 4  # sigma, q, max real batch, updates
PRIVACY_UNITS = {"example": 1, "user": 2}  # the ledger's unit code (0: no update yet)
_LIMITS = 5
# The running total of Poisson batches' real counts is refused above a bound
# that honest draws exceed with probability at most 1e-12 over 1e6 checks.
_CUMULATIVE_LOG_TERM = float(np.log(1e6 / 1e-12))


class PrivacyLedger(keras_internals.KerasSaveable):
    """Rows of ``(noise_multiplier, sampling_rate, max_real_batch, updates)``.

    Create it with :func:`ledger_of`; do not construct it directly.
    """

    def __init__(self):
        with tf.init_scope():
            self.table = keras.Variable(
                np.zeros((MAX_ROWS, _COLUMNS)), dtype="float64", trainable=False,
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
            self.lineage = keras.Variable(
                np.array([_new_lineage_id(), 0, 0]), dtype="int64", trainable=False,
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

    def save_own_variables(self, store):
        store["table"] = np.asarray(self.table.numpy())
        store["num_rows"] = np.asarray(self.num_rows.numpy())
        store["unit"] = np.asarray(self.unit.numpy())
        store["poisson_seen"] = np.asarray(self.poisson_seen.numpy())
        store["lineage"] = np.asarray(self.lineage.numpy())

    def load_own_variables(self, store):
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
        its count (build a fresh model to start over).
        """
        # A file saved before any DP training (or by a plain Keras model) has
        # no ledger: the model has received no noised update.
        if store is None or "table" not in list(store.keys()):
            return
        keys = list(store.keys())
        table = np.asarray(store["table"], dtype="float64")
        count = int(np.asarray(store["num_rows"]))
        if table.shape != (MAX_ROWS, _COLUMNS) or not 0 <= count <= MAX_ROWS:
            raise ValueError(
                f"The saved privacy ledger has shape {table.shape} and {count} rows; "
                f"expected ({MAX_ROWS}, {_COLUMNS}). It was written by an "
                "incompatible keras_dp_lm version.")
        file_rows = [(float(s), float(q), float(b), int(n)) for s, q, b, n in table[:count]]
        if not file_rows:
            return
        # Files from before user-level DP hold example-level updates only.
        file_unit = (int(np.asarray(store["unit"])) if "unit" in keys
                     else PRIVACY_UNITS["example"])
        file_seen = (np.asarray(store["poisson_seen"], dtype="float64")
                     if "poisson_seen" in keys else np.zeros((3,)))
        # Files from before lineages share nothing known with any ledger.
        file_lineage = (np.asarray(store["lineage"], dtype="int64").tolist()
                        if "lineage" in keys else [0, 0, 0])
        held = self.rows()
        new = _unshared_rows(held, self.lineage.numpy().tolist(), file_rows, file_lineage)
        if new:
            units = {int(self.unit.numpy()), file_unit} - {0}
            if len(units) > 1:
                # Keras turns an error here into a warning under
                # skip_mismatch=True, with the weights loaded: the ledger then
                # refuses every later use (see rows()).
                self._refusal = PrivacyRefusalError(
                    "The weights loaded into this model were trained at another "
                    f"privacy unit ({_unit_name(file_unit)}) than the model's "
                    f"({self.privacy_unit}), and one ledger counts one unit, so its "
                    "epsilon is unknown. Load them into a fresh model, or train at "
                    "one unit.")
                raise self._refusal
            rows = _fit_table(held + new)
            padded = np.zeros((MAX_ROWS, _COLUMNS))
            padded[:len(rows)] = rows
            self.table.assign(padded)
            self.num_rows.assign(len(rows))
            self.unit.assign(file_unit)
            self.poisson_seen.assign(self.poisson_seen.numpy() + file_seen)
            if not held:  # the model's history starts at the file's
                own = self.lineage.numpy()
                self.lineage.assign(np.array([own[0], file_lineage[0], _total(file_rows)]))
        holder = self.__dict__.get("_holder", lambda: None)()
        if holder is not None:
            # The weights loaded with these DP updates refuse non-DP training,
            # also inside another model (keras_dp_lm.training.fit_guards), and
            # are not written to a legacy .h5 file, which drops the ledger.
            mark_dp_trained(holder.weights, self)
            from keras_dp_lm.training import save_guards  # pylint: disable=import-outside-toplevel
            save_guards.guard_model(holder)
            save_guards.guard_layers(keras_internals.flatten_layers(holder, include_self=True))

    def inherit(self, sources):
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
            new = _rows_after(source.rows(), taken.get(source, 0))
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
        rows = _fit_table(rows)
        table = np.zeros((MAX_ROWS, _COLUMNS))
        table[:len(rows)] = rows
        self.table.assign(table)
        self.num_rows.assign(len(rows))
        self.unit.assign(PRIVACY_UNITS[units.pop()])
        if len(contributed) == 1 and not taken:
            # its history starts at that ledger's: a file of it shares these
            source = contributed[0]
            self.lineage.assign(np.array(
                [self.lineage.numpy()[0], source.lineage.numpy()[0], source.updates]))

    # -- reading ---------------------------------------------------------------
    def rows(self):
        """The rows as ``[(sigma, q, max_real_batch, updates), ...]`` (Python).

        Raises :class:`~keras_dp_lm.PrivacyRefusalError` if a load gave the
        model updates this ledger cannot count (another privacy unit)."""
        if self._refusal is not None:
            raise self._refusal
        table = np.asarray(self.table.numpy())
        count = int(self.num_rows.numpy())
        return [(float(s), float(q), float(b), int(n)) for s, q, b, n in table[:count]]

    @property
    def privacy_unit(self):
        """``"example"``, ``"user"`` (what each update's clipping protected), or
        ``None`` before the first update."""
        code = int(self.unit.numpy())
        return next((name for name, c in PRIVACY_UNITS.items() if c == code), None)

    @property
    def updates(self):
        """Total number of noised updates the model has received."""
        return sum(row[3] for row in self.rows())

    def updates_so_far(self):
        """The number of updates recorded, as an int64 tensor (for the traced step)."""
        table = tf.convert_to_tensor(self.table.value)
        return tf.cast(tf.reduce_sum(table[:, 3]), tf.int64)

    def set_limits(self, noise_multiplier=0.0, sampling_rate=0.0, batch_size=0.0,
                   poisson_batch_cap=0.0, poisson_mean=0.0, owner=None):
        """Parameters the accountant assumes; the step refuses batches beyond them.

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

    def clear_limits(self):
        """Forget the registered limits (and their accountant)."""
        self.limits.assign(np.zeros((_LIMITS,)))
        self._limits_owner = None

    # -- writing (inside the traced step) -------------------------------------
    def check(self, noise_multiplier, sampling_rate, real_batch, unit="example"):
        """``ok`` (bool tensor): the batch is within the accounted limits, and
        of the ledger's privacy unit (``"example"`` or ``"user"``)."""
        limits = tf.convert_to_tensor(self.limits.value)
        sigma = tf.constant(noise_multiplier, tf.float64)
        q = tf.cast(sampling_rate, tf.float64)
        batch = tf.cast(real_batch, tf.float64)
        sigma_ok = (limits[0] <= 0) | (sigma >= limits[0] * (1 - 1e-12))
        # a Poisson batch's real count: the accountant's cap, or its batch size
        # when it accounts fixed-size batches (no cap)
        cap = tf.where(limits[3] > 0, limits[3], limits[2])
        poisson_ok = (((limits[1] <= 0) | (q <= limits[1] * (1 + 1e-9)))
                      & ((cap <= 0) | (batch <= cap * (1 + 1e-9)))
                      & self._running_total_ok(batch))
        fixed_ok = (limits[2] <= 0) | (batch <= limits[2] * (1 + 1e-9))
        code = tf.constant(PRIVACY_UNITS[unit], tf.int64)
        held = tf.convert_to_tensor(self.unit.value)
        unit_ok = tf.equal(held, 0) | tf.equal(held, code)
        return sigma_ok & unit_ok & tf.where(q > 0, poisson_ok, fixed_ok)

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

    def recorded_rate(self, sampling_rate):
        """The rate :meth:`record` writes for a batch carrying ``sampling_rate``:
        at least the registered accountant's (see :meth:`record`)."""
        return tf.maximum(tf.cast(sampling_rate, tf.float64),
                          tf.convert_to_tensor(self.limits.value)[1])

    def record(self, noise_multiplier, sampling_rate, real_batch, ok, unit="example"):
        """Append one update (branch-free, so it runs in replica context and XLA)."""
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
        # would be repriced at the Poisson rate (r37 U4). With no row of its
        # kind, the last two rows (of the other kind) merge to make room.
        slots = tf.range(MAX_ROWS, dtype=rows.dtype)
        of_kind = (slots < rows) & tf.equal(table[:, 1] > 0, q > 0)
        kind_last = tf.reduce_max(tf.where(of_kind, slots, -1))
        target = tf.where(same, last, tf.maximum(kind_last, 0))
        into_row = same | (full & (kind_last >= 0))
        compact = full & ~into_row
        merged = _merge_rows(tf.gather(table, target), fresh)
        table = tf.where(
            compact,
            tf.concat([table[:MAX_ROWS - 2],
                       _merge_rows(table[MAX_ROWS - 2], table[MAX_ROWS - 1])[None],
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


def _new_lineage_id():
    """A random nonzero id for a ledger's history (0 means unknown)."""
    return int.from_bytes(os.urandom(7), "big") + 1


def _total(rows):
    return sum(row[3] for row in rows)


def _unit_name(code):
    return next((name for name, c in PRIVACY_UNITS.items() if c == code), None)


def _unshared_rows(held, lineage, file_rows, file_lineage):
    """The rows of a loaded file that the ledger holding ``held`` (with
    ``lineage``: own id, parent id, updates taken from the parent) does not
    already count.

    * nothing held: all of the file's rows;
    * the file is an earlier state of this ledger, or of (a state no later
      than) the one this ledger started from: none;
    * the file continues the ledger this one started from (or this ledger):
      its rows after the updates the two share;
    * otherwise (an unrelated history, or a file from before lineages): all.
    """
    if not held:
        return list(file_rows)
    own, parent, from_parent = lineage
    file_id, file_parent, file_from_parent = file_lineage
    file_updates = _total(file_rows)
    if file_id and file_id == own:
        return [] if file_updates <= _total(held) else list(file_rows)
    if file_id and file_id == parent:
        return _rows_after(file_rows, from_parent) if file_updates > from_parent else []
    if file_parent and file_parent == own:
        return _rows_after(file_rows, file_from_parent)
    return list(file_rows)


def _is_keras_hub_task(model):
    return any(cls.__name__ == "Task"
               and cls.__module__.startswith(("keras_hub.", "keras_nlp."))
               for cls in type(model).__mro__)


def _merge_rows(a, b):
    """One row for the updates of rows ``a`` and ``b`` (tensors), conservatively:
    smallest sigma, largest q and batch, their counts summed."""
    return tf.stack([tf.minimum(a[0], b[0]), tf.maximum(a[1], b[1]),
                     tf.maximum(a[2], b[2]), a[3] + b[3]])


def _by_kind(rows):
    """``[fixed-size rows (q == 0), Poisson rows (q > 0)]``."""
    return [[r for r in rows if r[1] == 0], [r for r in rows if r[1] > 0]]


def _rows_after(rows, skip):
    """``rows`` without their first ``skip`` updates.

    Rows are in order until the table fills: a full table merges an update
    into the last row *of its kind*, which may be an earlier row. Then the
    ``n`` updates after ``skip`` cannot be told apart by position, and are
    priced conservatively: ``n`` updates in each kind present, at that kind's
    smallest sigma and largest q and batch (over-reports, never under)."""
    if skip and len(rows) >= MAX_ROWS:
        remaining = sum(r[3] for r in rows) - skip
        if remaining <= 0:
            return []
        return [(min(r[0] for r in kind), max(r[1] for r in kind),
                 max(r[2] for r in kind), remaining) for kind in _by_kind(rows) if kind]
    out = []
    for sigma, q, batch, updates in rows:
        kept = updates - min(skip, updates)
        skip -= updates - kept
        if kept:
            out.append((sigma, q, batch, kept))
    return out


def _fit_table(rows):
    """``rows`` in at most ``MAX_ROWS`` rows: the last ones of each kind
    (fixed-size, q == 0; Poisson, q > 0) merged into one, conservatively. A
    fixed-size row is priced at its batch over the reader's dataset size, so it
    never merges with a Poisson row (its q would reprice it)."""
    if len(rows) <= MAX_ROWS:
        return rows
    kinds = _by_kind(rows)
    room = MAX_ROWS - sum(1 for kind in kinds if kind)
    kept = rows[:room]
    merged = []
    for kind in kinds:
        tail = np.asarray([r for r in rows[room:] if (r[1] > 0) == (kind[0][1] > 0)]
                          if kind else np.zeros((0, _COLUMNS)))
        if len(tail):
            merged.append((tail[:, 0].min(), tail[:, 1].max(), tail[:, 2].max(),
                           tail[:, 3].sum()))
    return kept + merged


def _ledger_holder(model):
    """The model whose weights the ledger describes: a KerasHub task's backbone
    (saved alone by ``save_to_preset``, shared by the tasks built on it), else
    the model itself (any other model with a ``backbone`` attribute keeps its
    own: a shared public encoder is not charged with each head's updates)."""
    if not _is_keras_hub_task(model):
        return model
    try:
        backbone = getattr(model, "backbone", None)
    except Exception:  # a property that cannot answer yet
        backbone = None
    return backbone if isinstance(backbone, keras.Model) and backbone is not model else model


def ledger_of(model, create=True):
    """The :class:`PrivacyLedger` of ``model`` (created empty on first use).

    A KerasHub task keeps its ledger with its backbone, so ``save_to_preset``
    / ``from_preset`` (which save and load the backbone's weights) carry it,
    and every task built on that backbone counts the updates its weights
    received.

    Example:
        >>> import keras, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> kdp.ledger_of(model).updates
        0
    """
    holder = _ledger_holder(model)
    ledger = _LEDGERS.get(holder)
    if ledger is None and create:
        ledger = PrivacyLedger()
        ledger.__dict__["_holder"] = weakref.ref(holder)
        with tf.init_scope():  # eager, also when first asked inside a traced step
            ledger.inherit(_marking_ledgers(holder))  # kept only if it could
        _LEDGERS[holder] = ledger
        register_model(holder)
    return ledger


# model -> its ledger. Not an attribute of the model: Keras saving walks a
# model's attributes, and a ledger reachable at a second path would be loaded
# twice, the second (empty) path clearing a refusal of the first.
_LEDGERS = weakref.WeakKeyDictionary()


def _marking_ledgers(model):
    """The ledgers that marked any of ``model``'s variables (:func:`mark_dp_trained`)."""
    found = {}
    for variable in model.weights:
        for ledger in getattr(variable, _DP_TRAINED, ()):
            found[id(ledger)] = ledger
    return list(found.values())


_MODELS = weakref.WeakSet()  # models compiled, or whose ledger was read (registered)
_REGISTERED = [0]  # how many models have registered so far


def register_model(model):
    """Remember ``model`` (weakly), so that a DP step training its weights
    through another model records the update in its ledger
    (:func:`sharing_ledgers`), and so that it refuses non-DP training once
    they are DP-trained (:func:`mark_dp_trained`). A model registers when it
    is compiled (:mod:`keras_dp_lm.training.binding`) and when its ledger is
    created; a model that is neither has no ledger to update, and the one it
    gets later starts from what its weights received (:meth:`PrivacyLedger.inherit`)."""
    if model not in _MODELS:
        _MODELS.add(model)
        _REGISTERED[0] += 1


def registered_models():
    """The models alive that registered (:func:`register_model`)."""
    return list(_MODELS)


def models_registered():
    """How many models have registered so far (:func:`register_model`): a
    traced DP step whose value is older may miss a model sharing its weights."""
    return _REGISTERED[0]


def sharing_ledgers(model):
    """The ledgers of the other models holding weights that a DP step of
    ``model`` trains (created if missing), other than ``model``'s own: each
    records that step's updates, so a model trained as part of another one (a
    layer of it, held by a wrapper or custom layer, or the base of a new head)
    and then saved or reused alone carries what its weights received (r34d
    D2). A step traced before such a model registered is traced again at its
    next call (``keras_dp_lm.training.step``). A model that never registered
    (never compiled, its ledger never read) is not seen: its ledger, once
    created, inherits what its weights received."""
    own = ledger_of(model)
    trained = {id(v) for v in model.trainable_variables}
    ledgers = []
    for other in list(_MODELS):
        try:
            weights = other.weights
        except Exception:  # a model whose construction failed has no weights
            continue
        if other is model or not any(id(v) in trained for v in weights):
            continue
        ledger = ledger_of(other)
        if ledger is not own and all(ledger is not seen for seen in ledgers):
            ledgers.append(ledger)
    return ledgers


_DP_TRAINED = "_keras_dp_lm_dp_trained"
_ANY_MARKED = [False]  # set once any variable in this process is marked


def mark_dp_trained(variables, ledger):
    """Mark ``variables`` as holding weights that DP training updated, with
    the ``ledger`` that counts those updates: a DP step traced them, or they
    were loaded with a ledger holding DP updates. Any model then refuses to
    train them with a non-DP optimizer
    (:func:`keras_dp_lm.training.fit_guards.check_training_is_private`).
    The variables hold the ledger itself, not a weak reference: a model built
    on them after the training model is gone still finds those updates."""
    for variable in variables:
        ledgers = getattr(variable, _DP_TRAINED, None)
        if ledgers is None:
            ledgers = []
            setattr(variable, _DP_TRAINED, ledgers)
        if all(ledger is not held for held in ledgers):
            ledgers.append(ledger)
    _ANY_MARKED[0] = True
    # Every registered model holding them now refuses non-DP training.
    from keras_dp_lm.training import binding  # pylint: disable=import-outside-toplevel
    with tf.init_scope():
        binding.guard_models_holding(variables)


def is_dp_trained(variable):
    """Whether :func:`mark_dp_trained` marked ``variable``."""
    return getattr(variable, _DP_TRAINED, None) is not None


def dp_history(model):
    """What DP training ``model``'s weights have received, as a comparable
    value: the rows of its ledger and of every ledger that marked one of its
    variables. Equal values mean no DP update and no DP file arrived between
    the two readings (a model's own checkpoint reloaded leaves it equal)."""
    ledgers = _marking_ledgers(model) + [ledger_of(model)]
    return frozenset((id(ledger), tuple(ledger.rows())) for ledger in ledgers
                     if ledger.num_rows.numpy() > 0)


def any_dp_trained():
    """Whether any variable of this process is marked. Every ledger row comes
    from a traced DP step or a load, and both mark, so until then no model
    holds DP updates (plain Keras training skips the guard's walk)."""
    return _ANY_MARKED[0]


class _LedgerView(keras_internals.KerasSaveable):
    """A task's ``dp_ledger`` as Keras saving sees it: its backbone's ledger,
    saved again at the task's own path (files written before the ledger moved
    to the backbone hold it there; Keras visits the backbone first, so this
    path, loaded last, wins)."""

    def __init__(self, ledger):
        self._ledger = lambda: ledger  # a callable: Keras does not walk into it

    def _obj_type(self):
        return self._ledger()._obj_type()

    def save_own_variables(self, store):
        self._ledger().save_own_variables(store)

    def load_own_variables(self, store):
        self._ledger().load_own_variables(store)


def saved_ledger(model):
    """``model.dp_ledger``: what Keras saves and loads as the model's ledger."""
    ledger = ledger_of(model)
    return ledger if _ledger_holder(model) is model else _LedgerView(ledger)
