"""Batches for DP-SGD: Poisson sampling (of examples, or of users for
user-level DP), padding with a real-slot mask the DP step owns;
``DPFeatureNormalization``, frozen features centred on a DP mean; and
``DPClassPriors``, a DP label histogram for ``LogitAdjustedSparseCategoricalCrossentropy``;
``DPClassMeans``, a head made of DP class means (one release, no training)."""

from keras_dp_lm.data.class_means import DPClassMeans
from keras_dp_lm.data.class_priors import DPClassPriors
from keras_dp_lm.data.class_priors import LogitAdjustedSparseCategoricalCrossentropy
from keras_dp_lm.data.draws import OVERFLOW_MODES
from keras_dp_lm.data.draws import PADDING_MODES
from keras_dp_lm.data.draws import PoissonOverflowError
from keras_dp_lm.data.draws import padding_buckets
from keras_dp_lm.data.feature_normalization import DPFeatureNormalization
from keras_dp_lm.data.poisson import iter_poisson_batches
from keras_dp_lm.data.poisson import overflow_probability
from keras_dp_lm.data.poisson import poisson_batches
from keras_dp_lm.data.poisson import suggest_max_batch_size
from keras_dp_lm.data.real_slots import attach_real_slots
from keras_dp_lm.data.real_slots import split_real_slots
from keras_dp_lm.data.users import poisson_user_batches
from keras_dp_lm.data.users import records_per_user

__all__ = ["DPClassMeans", "DPClassPriors", "DPFeatureNormalization",
           "LogitAdjustedSparseCategoricalCrossentropy", "OVERFLOW_MODES", "PADDING_MODES",
           "padding_buckets",
           "PoissonOverflowError", "attach_real_slots", "iter_poisson_batches",
           "overflow_probability", "poisson_batches", "poisson_user_batches",
           "records_per_user", "split_real_slots", "suggest_max_batch_size"]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
