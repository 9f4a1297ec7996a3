"""Which ledger a model has: :func:`ledger_of`, and the ledger Keras saves.

A model's :class:`~keras_dp_lm.training.ledger.PrivacyLedger` is kept here,
keyed by the model (weakly), not as an attribute of it; Keras saves it as the
model's ``dp_ledger``. A KerasHub task keeps its ledger with its backbone.
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from keras_dp_lm import _keras_internals as keras_internals
from keras_dp_lm.training.ledger import PrivacyLedger
from keras_dp_lm.training.weight_marks import marking_ledgers
from keras_dp_lm.training.weight_marks import register_model
from keras_dp_lm.training.weight_marks import registered_models


def _is_keras_hub_task(model):
    return any(cls.__name__ == "Task"
               and cls.__module__.startswith(("keras_hub.", "keras_nlp."))
               for cls in type(model).__mro__)


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


def ledger_of(model: keras.Model, create: bool = True) -> PrivacyLedger | None:
    """The :class:`PrivacyLedger` of ``model`` (created empty on first use).

    A KerasHub task keeps its ledger with its backbone, so ``save_to_preset``
    / ``from_preset`` (which save and load the backbone's weights) carry it,
    and every task built on that backbone counts the updates its weights
    received. ``create=False`` returns None instead of creating a ledger for a
    model that has none.

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
            ledger.inherit(marking_ledgers(holder))  # kept only if it could
        _LEDGERS[holder] = ledger
        register_model(holder)
    return ledger


# model -> its ledger. Not an attribute of the model: Keras saving walks a
# model's attributes, and a ledger reachable at a second path would be loaded
# twice, the second (empty) path clearing a refusal of the first.
# Kept across importlib.reload (autoreload): a fresh one would hand every model
# an empty ledger, and the accountant would count from zero.
if "_LEDGERS" not in globals():
    _LEDGERS = weakref.WeakKeyDictionary()


def sharing_ledgers(model):
    """The ledgers of the other models holding weights that a DP step of
    ``model`` trains (created if missing), other than ``model``'s own: each
    records that step's updates, so a model trained as part of another one (a
    layer of it, held by a wrapper or custom layer, or the base of a new head)
    and then saved or reused alone carries what its weights received. A step traced before such a model registered is traced again at its
    next call (``keras_dp_lm.training.step``). A model that never registered
    (never compiled, its ledger never read) is not seen: its ledger, once
    created, inherits what its weights received."""
    own = ledger_of(model)
    trained = {id(v) for v in model.trainable_variables}
    ledgers = []
    for other in registered_models():
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


def dp_history(model):
    """What DP training ``model``'s weights have received, as a comparable
    value: the rows of its ledger and of every ledger that marked one of its
    variables. Equal values mean no DP update and no DP file arrived between
    the two readings (a model's own checkpoint reloaded leaves it equal)."""
    ledgers = marking_ledgers(model) + [ledger_of(model)]
    return frozenset((id(ledger), tuple(ledger.rows())) for ledger in ledgers
                     if ledger.num_rows.numpy() > 0)


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
