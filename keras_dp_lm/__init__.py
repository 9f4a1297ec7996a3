"""keras_dp_lm: differentially private vocabularies, training and decoding for Keras 3.

Once Keras is imported (before or after this package), ``keras.Model.compile``
is the one binding point: compiling with a DP optimizer binds the DP train step
to that model (``model.fit`` then trains privately), and a ``dp_ledger``
property lets every model's file carry its privacy ledger; nothing else in
Keras's classes changes (:mod:`keras_dp_lm.training.binding`). DP optimizers,
samplers and layers are registered for ``keras.models.load_model``. Names are imported on first use,
so ``import keras_dp_lm.accounting`` (pure arithmetic) never loads TensorFlow.

Example:
    >>> import keras, numpy as np, keras_dp_lm as kdp
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
    ...               loss="mse")
    >>> _ = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=4, verbose=0)
    >>> kdp.ledger_of(model).updates
    2
"""

import importlib

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending
from keras_dp_lm._activation import install_activation as _install_activation

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "PrivacyAccountant": "keras_dp_lm.callbacks",
    "PrivacyBudgetExhaustedError": "keras_dp_lm.accounting",
    "PrivacyRefusalError": "keras_dp_lm.errors",
    "calibrate_noise_multiplier": "keras_dp_lm.accounting",
    "compute_epsilon": "keras_dp_lm.accounting",
    "max_steps": "keras_dp_lm.accounting",
    "PrivacyLedger": "keras_dp_lm.training.ledger",
    "ledger_of": "keras_dp_lm.training.model_ledgers",
    "BudgetExhaustedError": "keras_dp_lm.samplers",
    "DecodingBudget": "keras_dp_lm.samplers",
    "DPSampler": "keras_dp_lm.samplers",
    "PublicMixtureSampler": "keras_dp_lm.samplers",
    "ball_for_epsilon": "keras_dp_lm.samplers",
    "beta_for_epsilon": "keras_dp_lm.samplers",
    "epsilon_per_sequence": "keras_dp_lm.samplers",
    "epsilon_per_token": "keras_dp_lm.samplers",
    "lambda_for_epsilon": "keras_dp_lm.samplers",
    "per_example_losses": "keras_dp_lm.training.losses",
    "DPAdam": "keras_dp_lm.optimizers",
    "DPAdamBC": "keras_dp_lm.optimizers",
    "DPAdamW": "keras_dp_lm.optimizers",
    "DPOptimizer": "keras_dp_lm.optimizers",
    "DPSGD": "keras_dp_lm.optimizers",
    "is_dp_optimizer": "keras_dp_lm.optimizers",
    "make_dp_optimizer": "keras_dp_lm.optimizers",
    "attach_real_slots": "keras_dp_lm.data",
    "DPClassMeans": "keras_dp_lm.data",
    "DPFeatureNormalization": "keras_dp_lm.data",
    "poisson_batches": "keras_dp_lm.data",
    "poisson_user_batches": "keras_dp_lm.data",
    "suggest_max_batch_size": "keras_dp_lm.data",
    "make_private": "keras_dp_lm.training",
    "DPVocabularyAdapter": "keras_dp_lm.tokenizers",
}
_SUBMODULES = ("accounting", "callbacks", "data", "evaluation", "optimizers", "samplers",
               "testing", "tokenizers", "training", "tuning")

__all__ = sorted(list(_EXPORTS) + list(_SUBMODULES))


def __getattr__(name):
    _activate_if_pending()
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"keras_dp_lm.{name}")
    else:
        raise AttributeError(f"module 'keras_dp_lm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


_install_activation()
