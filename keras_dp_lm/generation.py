"""Deprecated: moved to :mod:`keras_dp_lm.samplers` (this path is removed in the next release)."""

import warnings

from keras_dp_lm.samplers import *  # noqa: F401,F403
from keras_dp_lm.samplers import __all__  # noqa: F401

warnings.warn("keras_dp_lm.generation moved to keras_dp_lm.samplers; the old path will be removed "
              "in the next release.", DeprecationWarning, stacklevel=2)
