"""Deprecated: moved to :mod:`keras_dp_lm.training.losses` (this path is removed in the next release)."""

import warnings

from keras_dp_lm.training.losses import *  # noqa: F401,F403
from keras_dp_lm.training.losses import __all__  # noqa: F401

warnings.warn("keras_dp_lm.losses moved to keras_dp_lm.training.losses; the old path will be removed in the next "
              "release.", DeprecationWarning, stacklevel=2)
