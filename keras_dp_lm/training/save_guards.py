"""Refusing legacy HDF5 (``.h5``) files of DP-trained weights.

A model's privacy ledger is saved with its weights in ``.keras`` and
``.weights.h5`` files, never in Keras's legacy ``.h5`` / ``.hdf5`` model
format: a model loaded from such a file would count none of the DP updates
its weights received, and any epsilon reported after more training would be
too small. Saving DP-trained weights in that format is therefore refused:

* ``model.save("m.h5")`` (and ``ModelCheckpoint`` to a ``.h5`` path) of a model
  compiled with a DP optimizer (trained or not), or holding weights loaded
  with a ledger, is refused before the file is opened;
* any other legacy save (``keras.saving.save_model(model, "m.h5")``, a model
  built later on DP-trained layers) is refused while Keras reads the
  configuration of a DP-trained layer, after Keras has created the file: the
  file then holds no model and cannot be loaded.

Example:
    >>> import keras, numpy as np, keras_dp_lm as kdp
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0,
    ...                                   noise_multiplier=1.0), loss="mse")
    >>> _ = model.fit(np.ones((4, 3)), np.zeros((4, 1)), batch_size=4, verbose=0)
    >>> try:
    ...     model.save("/tmp/never_written.h5")
    ... except kdp.PrivacyRefusalError as error:
    ...     print("refused")
    refused
"""

import functools
import types

from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm import _keras_internals as keras_internals
from keras_dp_lm.training.weight_marks import is_dp_trained
from keras_dp_lm.training.weight_marks import on_marked
from keras_dp_lm.training.model_ledgers import ledger_of

LEGACY_SUFFIXES = (".h5", ".hdf5")
_GUARDED = "_keras_dp_lm_save_guard"


def holds_dp_updates(obj):
    """Whether a model or layer holds weights that received DP updates."""
    if any(is_dp_trained(v) for v in obj.weights):
        return True
    ledger = ledger_of(obj, create=False) if isinstance(obj, keras_internals.Trainer) else None
    return ledger is not None and ledger.updates > 0


def _refusal(name):
    return PrivacyRefusalError(
        f"'{name}' is compiled for or holds DP training, and Keras's legacy HDF5 (.h5) model "
        "format does not carry their privacy ledger: a model loaded from it would "
        "count none of their DP updates. Save with model.save('model.keras') or "
        "model.save_weights('model.weights.h5'); both keep the ledger.")


def check_save_path(model, filepath):
    """Refuse a legacy ``.h5`` path for a model compiled with a DP optimizer
    (whose wrapped optimizer Keras's HDF5 writer cannot save either) or
    holding DP updates."""
    if not str(filepath).lower().endswith(LEGACY_SUFFIXES):
        return
    if is_dp_optimizer(getattr(model, "optimizer", None)) or holds_dp_updates(model):
        raise _refusal(model.name)


def _guarded_save(self, filepath, *args, **kwargs):
    check_save_path(self, filepath)
    return type(self).save(self, filepath, *args, **kwargs)


def _guarded_get_config(self):
    if keras_internals.writing_legacy_h5() and holds_dp_updates(self):
        raise _refusal(self.name)
    return type(self).get_config(self)


def guard_model(model):
    """Bind the legacy-``.h5`` refusal to ``model.save`` and ``get_config``
    (instance attributes: the model's class is untouched). Idempotent."""
    if model.__dict__.get(_GUARDED):
        return
    model.__dict__[_GUARDED] = True
    model.save = types.MethodType(functools.wraps(type(model).save)(_guarded_save), model)
    model.get_config = types.MethodType(_guarded_get_config, model)


def guard_layers(layers):
    """Bind the refusal to ``get_config`` of each layer holding DP-trained
    weights, so a model built on them later cannot write them to ``.h5``."""
    for layer in layers:
        if layer.__dict__.get(_GUARDED) or not any(is_dp_trained(v) for v in layer.weights):
            continue
        layer.__dict__[_GUARDED] = True
        layer.get_config = types.MethodType(_guarded_get_config, layer)


def _guard_loaded(model):
    """A model loaded with DP updates (its weights were just marked): its
    ``save`` and the layers holding those weights refuse a legacy ``.h5``."""
    if model is not None:
        guard_model(model)
        guard_layers(keras_internals.flatten_layers(model, include_self=True))


on_marked("save_guards", _guard_loaded)
