"""DP optimizers: :class:`DPOptimizer` around any Keras optimizer, and conveniences.

Example:
    >>> import keras, numpy as np, keras_dp_lm as kdp
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer=kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=1.0,
    ...                                    noise_multiplier=1.1, seed=0),
    ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> history = model.fit(np.ones((8, 4)), np.zeros((8,)), batch_size=4, verbose=0)
    >>> kdp.ledger_of(model).updates
    2
"""


from keras_dp_lm.optimizers.conveniences import DPAdam
from keras_dp_lm.optimizers.conveniences import DPAdamBC
from keras_dp_lm.optimizers.conveniences import DPAdamW
from keras_dp_lm.optimizers.conveniences import DPSGD
from keras_dp_lm.optimizers.dp_optimizer import CLIPPING_METHODS
from keras_dp_lm.optimizers.dp_optimizer import DPOptimizer
from keras_dp_lm.optimizers.dp_optimizer import is_dp_optimizer
from keras_dp_lm.optimizers.dp_optimizer import make_dp_optimizer
from keras_dp_lm.optimizers.noise_corrected_adam import NoiseCorrectedAdam
from keras_dp_lm.optimizers.privacy_parameters import PrivacyParameters

__all__ = ["CLIPPING_METHODS", "DPAdam", "DPAdamBC", "DPAdamW", "DPOptimizer", "DPSGD",
           "NoiseCorrectedAdam", "PrivacyParameters", "is_dp_optimizer", "make_dp_optimizer"]


from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
