"""Hyperparameter search on private data, its whole privacy cost accounted.

* :func:`private_search`: DP trials of a Keras model, a random number of them,
  scored with noise on a held-out private split; the best is released and the
  whole search is charged to one budget (private selection, Papernot &
  Steinke 2022).
* :func:`public_search`: every candidate on public proxy data under the private
  run's noise, batch and steps: no privacy spent; it transfers when the proxy
  resembles the private task.

How :func:`private_search` works:

1. The private records are split at random into training and validation parts
   (each record held out independently with probability ``validation_fraction``).
2. The number of trials ``K`` is drawn, independently of the data, from a
   truncated negative binomial distribution of mean ``mean_trials``.
3. Each trial draws a candidate (learning rate, what to train) uniformly at
   random, trains a fresh model with DP-Adam on Poisson batches, and scores it
   on the validation part: the number of correct predictions (or of a per-example
   score in [0, 1]) plus Gaussian noise of std ``score_noise_multiplier``
   (sensitivity 1).
4. The trial with the best noisy score is released: its model, candidate and
   noisy score. Nothing else (how many trials ran, the other scores) is, since
   the bound covers the best alone: every trial's objects get the same Keras
   auto-names, and the released model carries neither its optimizer's noise
   seed nor its training loss (history, metrics). The run time and any
   ``verbose`` output do reveal the number of trials: keep them to yourself.

The number of records N is public, as everywhere in this package; the parts'
real sizes are not used (the plan and the score use ``validation_fraction * N``).

Every trial uses the same noise multiplier, sampling rate and steps, calibrated
so the whole search meets ``target_epsilon`` at ``delta``; after each trial the
model's ledger is checked against them, so what is reported is what was applied.

Example:
    >>> import keras, numpy as np
    >>> from keras_dp_lm import tuning
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(600, 4)).astype("float32")
    >>> y = (x[:, 0] > 0).astype("int32")
    >>> def build(candidate):
    ...     return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> result = tuning.private_search(
    ...     build, x, y, target_epsilon=8.0, delta=1e-5, epochs=10.0, min_steps=20,
    ...     candidates=[tuning.Candidate(0.03), tuning.Candidate(0.1)], mean_trials=2,
    ...     seed=0)
    >>> result.epsilon <= 8.0, result.score > 0.7
    (True, True)
"""

from keras_dp_lm.tuning.search import Candidate
from keras_dp_lm.tuning.search import PublicSearchResult
from keras_dp_lm.tuning.search import SearchResult
from keras_dp_lm.tuning.search import private_search
from keras_dp_lm.tuning.search import public_search

__all__ = ["Candidate", "PublicSearchResult", "SearchResult", "private_search",
           "public_search"]
