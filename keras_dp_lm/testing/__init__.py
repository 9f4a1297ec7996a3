"""Testing tools: check the DP step of your own model, and build tiny offline models.

- :func:`check_privacy` tests the DP step of a compiled model against a naive
  per-example loop, on neighbouring batches and on padding slots, before you
  train it (see :mod:`keras_dp_lm.testing.privacy_check`).
- The tiny-model builders (:func:`tiny_gpt2_causal_lm`,
  :func:`tiny_llama_causal_lm`, their preset savers and offline tokenizer
  trainers) build small KerasHub language models without touching a hub
  (see :mod:`keras_dp_lm.testing.tiny_models`).
"""

from keras_dp_lm.testing.privacy_check import PrivacyCheckReport
from keras_dp_lm.testing.privacy_check import check_privacy
from keras_dp_lm.testing.tiny_models import *  # noqa: F401,F403
from keras_dp_lm.testing.tiny_models import __all__ as _TINY_MODELS
from keras_dp_lm.testing.tiny_models import _find_shakespeare  # noqa: F401
from keras_dp_lm.testing.tiny_models import _scoped_seed  # noqa: F401

__all__ = ["check_privacy", "PrivacyCheckReport", *_TINY_MODELS]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
