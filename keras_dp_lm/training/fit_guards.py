"""Guards around Keras's training loop for a model that has DP updates.

Two paths Keras offers lie outside what the privacy ledger can count:

* **Non-private updates after private ones.** A model whose ledger holds DP
  updates, compiled again with an optimizer that is not a DP optimizer
  (``compile(optimizer="adam")``, or KerasHub's ``compile(sampler=...)``, which
  builds a fresh Adam), would train with neither clipping nor noise; a later
  DP fit would then report a finite epsilon for weights that had unnoised
  updates on private data. Such a model refuses to train
  (:func:`refuse_non_private_training`) until
  :func:`allow_non_private_fit` says that its next fits use public data only.
* **Callbacks that act on private training values.** Losses and metrics logged
  during a DP fit are computed on private examples without noise. A callback
  that stops training, changes the learning rate or picks a checkpoint from
  them makes the released weights depend on private data through a channel the
  accountant does not count. :func:`warn_on_decisions_from_private_logs` warns.
"""

import types
import warnings

import keras

from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.training.ledger import ledger_of

_NON_PRIVATE_REFUSED = (
    "keras_dp_lm refused to train: this model's privacy ledger holds {updates} DP "
    "updates, and it is now compiled with {optimizer}, which is not a keras_dp_lm DP "
    "optimizer. Its updates would be neither clipped nor noised, and the ledger (and "
    "any epsilon reported later) could not count them. To keep training privately, "
    "compile with a DP optimizer, e.g. model.compile(optimizer=keras_dp_lm.DPAdam(...), "
    "...); a KerasHub compile(sampler=...) builds a new non-DP Adam unless it is also "
    "given optimizer=. If the data of the next fits is public (none of the examples the "
    "guarantee protects), say so first: keras_dp_lm.training.allow_non_private_fit(model).")


def _has_dp_updates(model):
    ledger = ledger_of(model, create=False)
    return ledger is not None and ledger.updates > 0


def _refused_step(model, data):
    del data
    raise RuntimeError(model.__dict__["_keras_dp_lm_refusal"])


_refused_step._keras_dp_lm_refuses = True


def refuse_non_private_training(model):
    """Bind a train step that refuses, if ``model`` (compiled with a non-DP
    optimizer) already has DP updates. Called by the patched ``compile``."""
    if is_dp_optimizer(getattr(model, "optimizer", None)) or not _has_dp_updates(model):
        return
    # The message is read now: the step raises while Keras traces it.
    model.__dict__["_keras_dp_lm_refusal"] = _NON_PRIVATE_REFUSED.format(
        updates=ledger_of(model).updates, optimizer=type(model.optimizer).__name__)
    model.train_step = types.MethodType(_refused_step, model)
    model.train_function = None


def allow_non_private_fit(model):
    """Let a model with DP updates train with its current non-DP optimizer.

    Call it only when the data of the next fits is public: updates from a
    non-DP optimizer are neither clipped nor noised, and the privacy ledger
    does not count them. Training on public data after DP training is
    post-processing and spends no privacy; training on private data this way
    has no guarantee at all. The permission lasts until the next ``compile``.

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
    bound = model.__dict__.get("train_step")
    if getattr(getattr(bound, "__func__", None), "_keras_dp_lm_refuses", False):
        del model.__dict__["train_step"]
        model.train_function = None


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


def warn_on_decisions_from_private_logs(model, callbacks):
    """Warn if a DP fit's ``callbacks`` act on a training loss or metric.

    Those values are computed on private training examples without noise:
    stopping, changing the learning rate or keeping a checkpoint because of
    them is a release the accountant does not count. Values on validation data
    (``val_`` names) are about examples the model does not train on.
    """
    if not is_dp_optimizer(getattr(model, "optimizer", None)) or not callbacks:
        return
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks:
        monitor = _monitored(callback)
        if monitor is not None and not str(monitor).startswith("val_"):
            warnings.warn(
                f"{type(callback).__name__} acts on '{monitor}', a value computed on "
                "private training examples without noise: what it decides (stopping, "
                "the learning rate, the checkpoint kept) depends on private data "
                "outside the DP guarantee, and the accountant does not count it. "
                "Monitor a value on held-out data (a 'val_' metric) or on public data, "
                "or stop by the privacy budget (keras_dp_lm.PrivacyAccountant).",
                UserWarning, stacklevel=3)
