"""Guards at the start of ``fit`` / ``train_on_batch`` for a model that has DP updates.

Paths Keras offers that lie outside what the privacy ledger can count are
refused before any update, by :func:`check_training_is_private`:

* **Non-private updates after private ones.** A model whose ledger holds DP
  updates, trained with an optimizer that is not a DP optimizer
  (``compile(optimizer="adam")``, KerasHub's ``compile(sampler=...)``, which
  builds a fresh Adam, or DP weights loaded into a model compiled without DP),
  would train with neither clipping nor noise, and a later DP fit would report a
  finite epsilon for weights that had unnoised updates on private data. The
  check reads the ledger when training starts, so a ledger that arrives after
  ``compile`` (``load_weights``, ``load_model``, a backbone another task trained)
  counts. :func:`allow_non_private_fit` says the next fits use public data.
* **Callbacks that decide from private values.** Losses and metrics logged
  during a DP fit are computed on private examples without noise (a validation
  split carved from the fit's data is private too). A callback that stops
  training, changes the learning rate or picks a checkpoint from them makes the
  released weights depend on private data through a channel the accountant does
  not count.
* **An optimizer assigned without compile across the DP line**
  (:func:`check_optimizer_matches_step`): Keras keeps the step it traced.
"""

from __future__ import annotations

import keras

from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.training.weight_marks import any_dp_trained
from keras_dp_lm.training.model_ledgers import dp_history
from keras_dp_lm.training.weight_marks import is_dp_trained
from keras_dp_lm.training.model_ledgers import ledger_of
from keras_dp_lm.errors import PrivacyRefusalError

_NON_PRIVATE_REFUSED = (
    "keras_dp_lm refused to train: this model's privacy ledger holds {updates} DP "
    "updates, and it is now compiled with {optimizer}, which is not a keras_dp_lm DP "
    "optimizer. Its updates would be neither clipped nor noised, and the ledger (and "
    "any epsilon reported later) could not count them. To keep training privately, "
    "compile with a DP optimizer, e.g. model.compile(optimizer=keras_dp_lm.DPAdam(...), "
    "...); a KerasHub compile(sampler=...) builds a new non-DP Adam unless it is also "
    "given optimizer=. If the data of the next fits is public (none of the examples the "
    "guarantee protects), say so first: keras_dp_lm.training.allow_non_private_fit(model).")


_ALLOWED = "_keras_dp_lm_non_private_fit_allowed"


def _has_dp_updates(model):
    ledger = ledger_of(model, create=False)
    return ledger is not None and ledger.updates > 0


def allow_non_private_fit(model: keras.Model) -> None:
    """Let a model with DP updates train with its current non-DP optimizer.

    Call it only when the data of the next fits is public: updates from a
    non-DP optimizer are neither clipped nor noised, and the privacy ledger
    does not count them. Training on public data after DP training is
    post-processing and spends no privacy; training on private data this way
    has no guarantee at all. The permission lasts until the next ``compile``,
    or until the model's weights receive DP updates they did not have when it
    was given (a DP step training a variable it shares, or a file with other
    DP updates loaded into it), whichever comes first. Reloading the model's
    own checkpoint (``BackupAndRestore``) keeps it.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0,
        ...                                   noise_multiplier=1.0), loss="mse")
        >>> _ = model.fit(np.ones((4, 3)), np.zeros((4, 1)), batch_size=4, verbose=0)
        >>> model.compile(optimizer="sgd", loss="mse")  # now refuses to fit
        >>> kdp.training.allow_non_private_fit(model)  # the next data is public
        >>> _ = model.fit(np.ones((4, 3)), np.zeros((4, 1)), verbose=0)
        >>> kdp.ledger_of(model).updates  # the public updates are not DP updates
        1
    """
    model.__dict__[_ALLOWED] = dp_history(model)


def forget_permission(model):
    """Drop :func:`allow_non_private_fit`'s permission (the patched ``compile``)."""
    model.__dict__.pop(_ALLOWED, None)


# Callbacks that change training from a monitored value, and how to read it.
def _monitored(callback):
    if isinstance(callback, keras.callbacks.TerminateOnNaN):
        return "loss"
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return callback.monitor if callback.save_best_only else None
    if isinstance(callback, (keras.callbacks.EarlyStopping,
                             keras.callbacks.ReduceLROnPlateau)):
        return callback.monitor
    return None


_SHARED_REFUSED = (
    "keras_dp_lm refused to train: {what} DP training, and this model is compiled with "
    "{optimizer}, which is not a keras_dp_lm DP optimizer. Its updates to those "
    "weights would be neither clipped nor noised, and the DP model's ledger could not "
    "count them. Compile this model with a DP optimizer (it then has a ledger of its "
    "own), or, if the data of its next fits is public, say so first: "
    "keras_dp_lm.training.allow_non_private_fit(model).")


def _flat_callbacks(callbacks):
    """Every callback in ``callbacks`` as Keras will run them: nested lists,
    dicts and ``CallbackList``s flattened (Keras's own ``tree.flatten``)."""
    stack, flat = list(keras.tree.flatten(callbacks or [])), []
    while stack:
        callback = stack.pop()
        if isinstance(callback, keras.callbacks.CallbackList):
            stack.extend(keras.tree.flatten(callback.callbacks))
        else:
            flat.append(callback)
    return flat


_PERMISSION_OUTDATED = (
    "keras_dp_lm refused to train: allow_non_private_fit(model) was given for the DP "
    "updates this model's weights had then, and they have received others since (a DP "
    "step training a variable it shares, or a file with other DP updates loaded into "
    "it). If the data of the next fits is still public, call "
    "keras_dp_lm.training.allow_non_private_fit(model) again; otherwise compile with a "
    "DP optimizer.")


def _inner_models(model):
    stack = list(getattr(model, "layers", ()))
    while stack:
        layer = stack.pop()
        if isinstance(layer, keras.Model):
            yield layer
            stack.extend(getattr(layer, "layers", ()))


def _refuse_non_private(model, optimizer):
    if not any_dp_trained():
        return
    allowed = model.__dict__.get(_ALLOWED)
    if allowed is not None:
        if dp_history(model) == allowed:
            return
        raise RuntimeError(_PERMISSION_OUTDATED)
    name = type(optimizer).__name__
    if _has_dp_updates(model):
        raise RuntimeError(_NON_PRIVATE_REFUSED.format(
            updates=ledger_of(model).updates, optimizer=name))
    inner = next((m for m in _inner_models(model) if _has_dp_updates(m)), None)
    if inner is not None:
        raise RuntimeError(_SHARED_REFUSED.format(
            what=f"it contains the model '{inner.name}', whose ledger holds "
                 f"{ledger_of(inner).updates} DP updates from", optimizer=name))
    shared = [v for v in model.trainable_variables if is_dp_trained(v)]
    if shared:
        raise RuntimeError(_SHARED_REFUSED.format(
            what=f"{len(shared)} of its trainable variables (e.g. {shared[0].path}) hold "
                 "weights from DP training (a DP step trained them, in this model or "
                 "another, or they were loaded with a ledger holding DP updates), "
                 "that is,", optimizer=name))


_SWAPPED_OPTIMIZER = (
    "keras_dp_lm refused to train: model.optimizer is now {}, not a keras_dp_lm DP "
    "optimizer, but the model was compiled for DP training. Assigning model.optimizer "
    "does not recompile: compile with the optimizer you want, e.g. "
    "model.compile(optimizer=keras_dp_lm.DPAdam(...), ...).")

_ASSIGNED_DP_OPTIMIZER = (
    "keras_dp_lm refused to train: model.optimizer is a DP optimizer, but the model "
    "was compiled without one, so Keras's train function (traced, or traced at the "
    "next fit) runs the plain step: no clipping, no noise, nothing in the ledger. "
    "Assigning model.optimizer does not recompile: call "
    "model.compile(optimizer=<the DP optimizer>, ...).")


def check_optimizer_matches_step(model, compiled_for_dp):
    """Refuse an optimizer assigned without ``compile`` across the DP line: a
    non-DP one on a model compiled for DP (Keras's retrace would fail on a
    missing attribute), or a DP one on a model compiled without DP (Keras runs
    its traced plain step and plain optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if compiled_for_dp and not is_dp_optimizer(optimizer):
        raise RuntimeError(_SWAPPED_OPTIMIZER.format(type(optimizer).__name__))
    if is_dp_optimizer(optimizer) and not compiled_for_dp:
        raise RuntimeError(_ASSIGNED_DP_OPTIMIZER)


def check_training_is_private(model, compiled_for_dp, callbacks=None, validation_split=0.0,
                              validation_data=None):
    """Refuse, before any update, training that the ledger could not count.

    Called by the guards bound to a DP model, or to a model holding DP-trained
    weights: its ``fit``, ``train_on_batch``, train functions and
    ``train_step`` (:func:`keras_dp_lm.training.binding.guard`); ``compiled_for_dp``
    says whether the model's ``train_step`` is the DP step. Raises
    ``RuntimeError`` for an optimizer assigned across the DP line without
    ``compile`` (:func:`check_optimizer_matches_step`), or if a model would
    train with a non-DP optimizer weights
    that DP training has updated: its own (its ledger holds DP updates), an
    inner model's, or variables it shares with a model a DP fit trained. Raises
    ``ValueError`` if a DP fit's ``callbacks`` decide from a value computed on
    private examples: a training loss or metric, or a ``val_`` value when no
    held-out ``validation_data`` is given (none, or a ``validation_split``
    carved from the private data).
    """
    check_optimizer_matches_step(model, compiled_for_dp)
    ledger = ledger_of(model, create=False)
    if ledger is not None:
        ledger.rows()  # refuses if a load gave it updates it cannot count
    optimizer = getattr(model, "optimizer", None)
    if not is_dp_optimizer(optimizer):
        _refuse_non_private(model, optimizer)
        return
    for callback in _flat_callbacks(callbacks):
        monitor = _monitored(callback)
        if monitor is None:
            continue
        if not str(monitor).startswith("val_"):
            source = "private training examples"
        elif validation_split:
            source = f"the validation_split ({validation_split}) carved from the private data"
        elif validation_data is None:
            source = "private training examples (this fit has no validation_data)"
        else:
            continue
        raise PrivacyRefusalError(
            f"keras_dp_lm refused the DP fit: {type(callback).__name__} acts on "
            f"'{monitor}', a value computed on {source} without noise. What it "
            "decides (stopping, the learning rate, the checkpoint kept) would depend "
            "on private data outside the DP guarantee, and the accountant cannot "
            "count it. Remove it, or monitor a 'val_' value on held-out data you pass "
            "as validation_data, or stop by the privacy budget "
            "(keras_dp_lm.PrivacyAccountant). Non-finite examples are already dropped "
            "from the update and count as 0 in the logged loss.")
