"""The privacy ledger's rows as arithmetic: merging, trimming and combining
histories, conservatively (never fewer updates, never a larger sigma or a
smaller q or batch than applied). Internal to :mod:`keras_dp_lm.training`.

A row is ``(noise_multiplier, sampling_rate, max_real_batch, updates)``.

Example:
    >>> from keras_dp_lm.training.ledger_rows import rows_after
    >>> rows_after([(1.0, 0.01, 50.0, 10), (2.0, 0.01, 50.0, 5)], 12)
    [(2.0, 0.01, 50.0, 3)]
"""

import os

import numpy as np
import tensorflow as tf

MAX_ROWS = 32
COLUMNS = 4  # sigma, q, max real batch, updates
PRIVACY_UNITS = {"example": 1, "user": 2}  # the ledger's unit code (0: no update yet)


def new_lineage_id():
    """A random nonzero id for a ledger's history (0 means unknown)."""
    return int.from_bytes(os.urandom(7), "big") + 1


def total_updates(rows):
    return sum(row[3] for row in rows)


def unit_name(code):
    return next((name for name, c in PRIVACY_UNITS.items() if c == code), None)


def unshared_rows(held, lineage, file_rows, file_lineage):
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
    file_updates = total_updates(file_rows)
    if file_id and file_id == own:
        return [] if file_updates <= total_updates(held) else list(file_rows)
    if file_id and file_id == parent:
        return rows_after(file_rows, from_parent) if file_updates > from_parent else []
    if file_parent and file_parent == own:
        return rows_after(file_rows, file_from_parent)
    return list(file_rows)


def merge_rows(a, b):
    """One row for the updates of rows ``a`` and ``b`` (tensors), conservatively:
    smallest sigma, largest q and batch, their counts summed."""
    return tf.stack([tf.minimum(a[0], b[0]), tf.maximum(a[1], b[1]),
                     tf.maximum(a[2], b[2]), a[3] + b[3]])


def by_kind(rows):
    """``[fixed-size rows (q == 0), Poisson rows (q > 0)]``."""
    return [[r for r in rows if r[1] == 0], [r for r in rows if r[1] > 0]]


def rows_after(rows, skip):
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
                 max(r[2] for r in kind), remaining) for kind in by_kind(rows) if kind]
    out = []
    for sigma, q, batch, updates in rows:
        kept = updates - min(skip, updates)
        skip -= updates - kept
        if kept:
            out.append((sigma, q, batch, kept))
    return out


def fit_table(rows):
    """``rows`` in at most ``MAX_ROWS`` rows: the last ones of each kind
    (fixed-size, q == 0; Poisson, q > 0) merged into one, conservatively. A
    fixed-size row is priced at its batch over the reader's dataset size, so it
    never merges with a Poisson row (its q would reprice it)."""
    if len(rows) <= MAX_ROWS:
        return rows
    kinds = by_kind(rows)
    room = MAX_ROWS - sum(1 for kind in kinds if kind)
    kept = rows[:room]
    merged = []
    for kind in kinds:
        tail = np.asarray([r for r in rows[room:] if (r[1] > 0) == (kind[0][1] > 0)]
                          if kind else np.zeros((0, COLUMNS)))
        if len(tail):
            merged.append((tail[:, 0].min(), tail[:, 1].max(), tail[:, 2].max(),
                           tail[:, 3].sum()))
    return kept + merged
