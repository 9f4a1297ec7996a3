"""Deprecated: moved to :mod:`keras_dp_lm.data` (this path is removed in the next release)."""

import warnings

from keras_dp_lm.data import *  # noqa: F401,F403
from keras_dp_lm.data import __all__  # noqa: F401

warnings.warn("keras_dp_lm.sampling moved to keras_dp_lm.data; the old path will be removed in the next "
              "release.", DeprecationWarning, stacklevel=2)
