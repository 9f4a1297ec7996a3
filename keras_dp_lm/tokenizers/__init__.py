"""Differentially private vocabularies: DP word histograms and the learners fed from them.

A tokenizer learned on private text leaks rare words through its vocabulary: a
word that occurs in one training example may become a vocabulary entry. This
package releases a *noised, thresholded* word histogram instead of the raw one,
and runs the ordinary WordPiece / SentencePiece learners on the surviving
words only. The learners never see raw counts, so the vocabulary they produce
is post-processing of a DP release and has the same (epsilon, delta).

The mechanism (one call of :func:`dp_word_histogram`)
======================================================

Privacy unit: one *example* (one element of the dataset: a line, a speech, a
document -- whatever the caller passes as one string). Neighbouring datasets
differ by adding or removing one example.

1. **Pre-tokenization.** Each example is split into words exactly as
   ``keras_hub.tokenizers.WordPieceTokenizer`` splits its input
   (``split=True``): on whitespace and control characters, with every
   punctuation character (ASCII non-alphanumerics and Unicode ``\\p{P}``)
   kept as a one-character word, and CJK ideographs split one per word
   (``split_on_cjk=True``). With ``lowercase=True`` words are case-folded
   (``tf_text.case_fold_utf8``, i.e. NFKC case folding); with
   ``strip_accents=True`` accents are removed (NFD, drop ``\\p{Mn}``). For the
   SentencePiece algorithms the text is also NFKC-normalized, which is what the
   ``nmt_nfkc`` / ``nmt_nfkc_cf`` normalizer stored in the learned model does at
   encoding time. The same function that the KerasHub tokenizer calls does the
   split, so the histogram's words are the tokenizer's words.
2. **Contribution bounding.** Each example contributes each *distinct* word at
   most once (``max_count=1``, the default) or at most ``max_count`` times
   (its in-example count capped at ``max_count``), and at most
   ``k = max_words_per_example`` distinct words. When an example has more than
   ``k`` distinct words, ``k`` of them are chosen uniformly at random (seeded
   generator), not the first ones. Adding one example therefore changes the
   histogram by a vector with L-infinity norm ``<= max_count`` and L2 norm
   ``<= max_count * sqrt(k)`` (the *L2 sensitivity*).
3. **Gaussian noise.** Every word with a positive bounded count gets
   independent noise ``N(0, s^2)`` with ``s = noise_multiplier * L2
   sensitivity``. Words that no example contributed (count 0) are never
   candidates, so they can never be released.
4. **Thresholding.** Only words whose noised count is ``>= T`` are released,
   with::

       T = max_count + s * Q^{-1}(delta_threshold / k)
       Q(z) = P(N(0,1) >= z) = scipy.stats.norm.sf(z) = erfc(z / sqrt(2)) / 2

   (``Q^{-1}`` is ``scipy.stats.norm.isf``. Papers written with ``erf``
   carry the factor ``sqrt(2)``: ``Q(z) = (1 - erf(z / sqrt(2))) / 2``.) A word
   that occurs only in the added example has count ``<= max_count``, so it is
   released with probability ``<= Q((T - max_count) / s) = delta_threshold / k``;
   by a union bound over the ``<= k`` words the example contributes, the
   probability that *any* of its unique words is released is
   ``<= delta_threshold``.

Privacy accounting
==================

``delta = delta_gaussian + delta_threshold`` with
``delta_threshold = threshold_delta_fraction * delta`` (default half each).

Let ``D' = D + {x}``. On the words that ``D`` already has (the common support)
the release is the Gaussian mechanism with L2 sensitivity ``max_count*sqrt(k)``
followed by thresholding (post-processing), hence ``(eps_g, delta_gaussian)``-DP
where ``eps_g`` is the *exact* Gaussian-mechanism epsilon for noise multiplier
``noise_multiplier`` at ``delta_gaussian`` (Balle & Wang 2018, computed by
``dp_accounting.get_epsilon_gaussian``; it agrees with ``dp_accounting.pld`` on a
``GaussianDpEvent(noise_multiplier)``). The words only ``x`` has are
released with probability ``<= delta_threshold``, independently of the rest.
So for every set ``S`` of outputs:

* ``P[M(D') in S] <= e^eps_g P[M(D) in S] + delta_gaussian + delta_threshold``;
* ``P[M(D) in S] <= e^eps_g / (1 - delta_threshold) * P[M(D') in S] + delta_gaussian``
  (outputs of ``M(D)`` never hold ``x``'s own words, and ``M(D')`` avoids them
  with probability ``>= 1 - delta_threshold`` independently of the rest).

The reported guarantee, valid in both directions, is therefore::

    epsilon = eps_g + log(1 / (1 - delta_threshold))      (the 2nd term ~ delta_threshold)
    delta   = delta_gaussian + delta_threshold

For comparison, the classical bound ``sigma >= sqrt(2 ln(1.25/delta)) / eps``
(Dwork & Roth, Thm A.1) is reported too; it is only valid for ``eps < 1`` and is
looser than the exact value.

Composition with training
=========================

:meth:`HistogramMechanism.dp_event` returns a :class:`VocabularyDpEvent`, a
``dp_accounting.ComposedDpEvent`` of ``GaussianDpEvent(noise_multiplier)`` and
``keras_dp_lm.accounting.EpsilonDeltaDpEvent(0, threshold_delta)``. It is an
ordinary ``DpEvent``: pass it to ``keras_dp_lm.PrivacyAccountant(extra_events=[...])``
or :func:`keras_dp_lm.accounting.compose_epsilon`, whose PLD accountant composes
it with training (``dp_accounting``'s RDP accountant cannot: the threshold part
has no RDP curve).

Why ``(0, threshold_delta)``: for ``D' = D + {x}`` write the release as a
function of two parts, ``G`` (noised, thresholded counts of the words ``D``
has) and ``U`` (the same for the words only ``x`` has). Given ``x``'s chosen
words the two use independent noise. ``G`` is the Gaussian mechanism with L2
sensitivity ``max_count * sqrt(k)``, post-processed; ``U(D)`` is always empty
and ``U(D')`` is non-empty with probability ``<= threshold_delta``, so ``U``
is within total variation ``threshold_delta``: ``(0, threshold_delta)``-DP in
both directions. Each is dominated by the PLD of its event, and a mixture over
``x``'s word choice is dominated too (hockey-stick divergences are jointly
convex), so the composition is valid under adaptive composition with any other
event. This is slightly tighter than the reported :attr:`epsilon` above, which
keeps the ``log(1/(1 - delta_threshold))`` term of the coupling argument.

A :class:`DPVocabularyAdapter` counts every ``adapt`` call as one more release:
its ``dp_event()`` composes all of them.

Errors and what they reveal
===========================

"Vocabulary larger than the survivors support" depends only on the release
(post-processing) and says how many words survived (also when the examples
hold no words at all: zero survive). Input validation looks at the raw input
and is outside the guarantee: "`data` is empty" reveals whether there was any
example at all, and "an element of `data` is ..., not text" / "`examples` holds
a ... where a str word was expected" reveal that one record has the wrong type
(kept because such input is almost always a bug). These messages name the type
only, never the record's position or content. Rounding noised counts to
integers before the learners is post-processing. The noise comes from NumPy's
PCG64 Gaussian sampler in float64 (not a cryptographic or
floating-point-hardened sampler).

Example (:class:`DPVocabularyAdapter` does both steps in one Keras layer):
    >>> from keras_dp_lm import tokenizers
    >>> speeches = ["HAMLET. To be, or not to be."] * 300 + ["OPHELIA. My secret."]
    >>> histogram = tokenizers.dp_word_histogram(
    ...     speeches, target_epsilon=4.0, delta=1e-6, max_words_per_example=16, seed=0)
    >>> histogram                     # OPHELIA's one speech left no word behind
    DPWordHistogram(7 words, epsilon=4, delta=1e-06, threshold=27.53)
    >>> len(tokenizers.learn_wordpiece_vocabulary(histogram, vocabulary_size=20))
    20
"""

from keras_dp_lm.tokenizers.adapter import ALGORITHMS
from keras_dp_lm.tokenizers.adapter import DPVocabularyAdapter
from keras_dp_lm.tokenizers.epsilon import classical_noise_multiplier
from keras_dp_lm.tokenizers.epsilon import epsilon_for
from keras_dp_lm.tokenizers.epsilon import gaussian_epsilon
from keras_dp_lm.tokenizers.epsilon import noise_stddev_for
from keras_dp_lm.tokenizers.epsilon import threshold_for
from keras_dp_lm.tokenizers.events import HistogramMechanism
from keras_dp_lm.tokenizers.events import VocabularyDpEvent
from keras_dp_lm.tokenizers.histogram import DEFAULT_BATCH_SIZE
from keras_dp_lm.tokenizers.histogram import DPWordHistogram
from keras_dp_lm.tokenizers.histogram import dp_word_histogram
from keras_dp_lm.tokenizers.histogram import dp_word_histogram_from_words
from keras_dp_lm.tokenizers.pretokenize import split_examples
from keras_dp_lm.tokenizers.sentencepiece import SENTENCEPIECE_RESERVED_TOKENS
from keras_dp_lm.tokenizers.sentencepiece import learn_sentencepiece_proto
from keras_dp_lm.tokenizers.wordpiece import WORDPIECE_RESERVED_TOKENS
from keras_dp_lm.tokenizers.wordpiece import learn_wordpiece_vocabulary

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BATCH_SIZE",
    "DPVocabularyAdapter",
    "DPWordHistogram",
    "HistogramMechanism",
    "SENTENCEPIECE_RESERVED_TOKENS",
    "VocabularyDpEvent",
    "WORDPIECE_RESERVED_TOKENS",
    "classical_noise_multiplier",
    "dp_word_histogram",
    "dp_word_histogram_from_words",
    "epsilon_for",
    "gaussian_epsilon",
    "learn_sentencepiece_proto",
    "learn_wordpiece_vocabulary",
    "noise_stddev_for",
    "split_examples",
    "threshold_for",
]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
