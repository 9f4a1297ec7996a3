"""Hyperparameter search on private data, its whole privacy cost accounted.

* :func:`private_search`: DP trials of a Keras model, a random number of them,
  scored with noise on a held-out private split; the best is released and the
  whole search is charged to one budget (private selection, Papernot &
  Steinke 2022; the arithmetic is :mod:`keras_dp_lm.accounting.selection`).
* :func:`public_search`: every candidate on public proxy data under the private
  run's noise, batch and steps: no privacy spent; it transfers when the proxy
  resembles the private task.

See :mod:`keras_dp_lm.tuning.search` for a runnable example.
"""

from keras_dp_lm.tuning.search import Candidate
from keras_dp_lm.tuning.search import PublicSearchResult
from keras_dp_lm.tuning.search import SearchResult
from keras_dp_lm.tuning.search import private_search
from keras_dp_lm.tuning.search import public_search

__all__ = ["Candidate", "PublicSearchResult", "SearchResult", "private_search",
           "public_search"]
