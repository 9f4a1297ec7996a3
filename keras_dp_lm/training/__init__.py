"""The DP train step, its binding to ``compile``, per-example losses and the ledger.

After ``model.compile(optimizer=<DP optimizer>)``, ``model.fit`` runs
:func:`dp_train_step`; :func:`make_private` returns it for custom loops.
Every touch of Keras's private API is in :mod:`keras_dp_lm._keras_internals`.
"""

from keras_dp_lm.training.fit_guards import allow_non_private_fit
from keras_dp_lm.training.ledger import PrivacyLedger
from keras_dp_lm.training.model_ledgers import ledger_of
from keras_dp_lm.training.losses import per_example_losses
from keras_dp_lm.training.losses import reduce_per_example
from keras_dp_lm.training.losses import regularization_loss
from keras_dp_lm.training.refusals import check_model
from keras_dp_lm.training.step import ClippedBatch
from keras_dp_lm.training.step import dp_clipped_gradient
from keras_dp_lm.training.step import dp_train_step
from keras_dp_lm.training.binding import install
from keras_dp_lm.training.binding import make_private

__all__ = ["ClippedBatch", "PrivacyLedger", "allow_non_private_fit", "check_model",
           "dp_clipped_gradient", "dp_train_step",
           "install", "ledger_of", "make_private", "per_example_losses",
           "reduce_per_example", "regularization_loss"]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
