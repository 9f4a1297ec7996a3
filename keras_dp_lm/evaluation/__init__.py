"""Empirical privacy evaluation of language models: canaries, extraction, auditing.

Three families of tests, each usable on any KerasHub ``CausalLM`` (or on a plain
function that scores texts):

* **Secret-sharer canaries** (Carlini et al., 2019, "The Secret Sharer"). Random
  secrets such as ``"my ssn is 381920"`` are inserted into the training data; after
  training, the canary's *exposure* measures how much more likely the model finds it
  than the other candidates of the same format::

      exposure = log2 |R| - log2 rank(canary)

  where ``R`` is the candidate space (all ``10**num_digits`` secrets) and the rank is
  the canary's position when ``R`` is sorted by log-perplexity (rank 1 = the most
  likely). When ``R`` is too big to score, the *extrapolated* exposure fits a
  skew-normal (or normal) distribution to the log-perplexities of random candidates
  and reports ``-log2 CDF(log-perplexity of the canary)``.
* **Extraction test**: prompt the model with the first tokens of training texts and
  greedily decode; report how often the true continuation comes out verbatim.
* **One-run privacy audit** (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with
  One (1) Training Run"): ``m`` canaries are each included in training with
  probability 1/2; after one training run the auditor guesses the ``k_plus`` highest
  scoring canaries as included and the ``k_minus`` lowest as excluded. If the training
  algorithm is (eps, delta)-DP, the number of correct guesses is unlikely to exceed a
  Binomial tail; inverting that test gives an epsilon *lower bound* at confidence
  ``1 - beta``. A bound above the epsilon an accountant claims is evidence of a bug.

Log-likelihoods are natural logs summed over a sequence's predicted tokens (the same
tokens the KerasHub preprocessor trains on: the text, its end token, not the start
token). Log-perplexity here is the negated log-likelihood; exposure does not depend
on the base of the logarithm of the perplexity.

Example:
    >>> from keras_dp_lm import evaluation as ev
    >>> canaries = ev.make_canaries(2, num_digits=4, seed=0)
    >>> train = ev.insert_canaries(["some text", "more text"], canaries,
    ...                            repetitions=3, seed=0)
    >>> len(train)
    8
    >>> ev.audit_lower_bound(num_guesses=10, num_correct=5)   # chance: no evidence
    0.0
"""

from keras_dp_lm.evaluation.audit import AuditResult
from keras_dp_lm.evaluation.audit import audit_lower_bound
from keras_dp_lm.evaluation.audit import audit_p_value
from keras_dp_lm.evaluation.audit import membership_scores
from keras_dp_lm.evaluation.audit import one_run_audit
from keras_dp_lm.evaluation.canaries import Canary
from keras_dp_lm.evaluation.canaries import CanarySpace
from keras_dp_lm.evaluation.canaries import insert_canaries
from keras_dp_lm.evaluation.canaries import make_canaries
from keras_dp_lm.evaluation.exposure import ExposureResult
from keras_dp_lm.evaluation.exposure import exposure
from keras_dp_lm.evaluation.exposure import exposure_from_log_perplexities
from keras_dp_lm.evaluation.extraction import ExtractionResult
from keras_dp_lm.evaluation.extraction import extraction_test
from keras_dp_lm.evaluation.scoring import as_log_likelihood_fn
from keras_dp_lm.evaluation.scoring import sequence_log_likelihood

__all__ = [
    "AuditResult",
    "Canary",
    "CanarySpace",
    "ExposureResult",
    "ExtractionResult",
    "as_log_likelihood_fn",
    "audit_lower_bound",
    "audit_p_value",
    "exposure",
    "exposure_from_log_perplexities",
    "extraction_test",
    "insert_canaries",
    "make_canaries",
    "membership_scores",
    "one_run_audit",
    "sequence_log_likelihood",
]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
