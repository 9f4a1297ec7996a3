"""Deprecated: moved to :mod:`keras_dp_lm.clipping` (this path is removed in the next release)."""

import warnings

from keras_dp_lm.clipping import *  # noqa: F401,F403
from keras_dp_lm.clipping import __all__  # noqa: F401

warnings.warn("keras_dp_lm.fast_clipping moved to keras_dp_lm.clipping; the old path will be "
              "removed in the next release.", DeprecationWarning, stacklevel=2)
