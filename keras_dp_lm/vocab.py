"""Differentially private vocabularies: DP word histograms and the learners fed from them.

A tokenizer learned on private text leaks rare words through its vocabulary: a
word that occurs in one training example may become a vocabulary entry. This
module releases a *noised, thresholded* word histogram instead of the raw one,
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
hold no words at all: zero survive). Only "`data` is empty" looks at the raw
input: it is input validation that reveals whether there was any example at
all, kept because an empty input is almost always a bug. Rounding noised counts to
integers before the learners is post-processing. The noise comes from NumPy's
PCG64 Gaussian sampler in float64 (not a cryptographic or
floating-point-hardened sampler).

Example:
    >>> from keras_dp_lm import vocab
    >>> adapter = vocab.DPVocabularyAdapter(                   # doctest: +SKIP
    ...     vocabulary_size=2000, target_epsilon=4.0, delta=1e-6,
    ...     max_words_per_example=16, seed=0)
    >>> adapter.adapt(speeches)                                # doctest: +SKIP
    >>> adapter(["To be, or not to be"])                       # doctest: +SKIP
"""

import dataclasses
import io
import json
import math
import os
import re
import warnings
from pathlib import Path

import dp_accounting
import keras
import numpy as np
import tensorflow as tf
from scipy import stats

from keras_dp_lm.accounting import EpsilonDeltaDpEvent
from keras_dp_lm.accounting import compose_epsilon

__all__ = [
    "ALGORITHMS",
    "DPVocabularyAdapter",
    "DPWordHistogram",
    "HistogramMechanism",
    "VocabularyDpEvent",
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

ALGORITHMS = ("wordpiece", "sentencepiece_unigram", "sentencepiece_bpe")
WORDPIECE_RESERVED_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
SENTENCEPIECE_RESERVED_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
DEFAULT_BATCH_SIZE = 4096

_VOCAB_ASSET = "vocabulary.txt"
_PROTO_ASSET = "sentencepiece.model"
_META_ASSET = "dp_vocabulary.json"


# --------------------------------------------------------------------------
# Argument checks (ValueError naming the argument)
# --------------------------------------------------------------------------

def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    return int(value)


def _check_positive(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`{name}` must be a positive number. Received: {name}={value!r}") from None
    if not value > 0 or math.isnan(value) or math.isinf(value):
        raise ValueError(f"`{name}` must be a positive, finite number. Received: {name}={value!r}")
    return value


def _check_open_unit(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`{name}` must be a number in (0, 1). Received: {name}={value!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"`{name}` must be in the open interval (0, 1). Received: {name}={value!r}")
    return value


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be None or a non-negative integer. Received: seed={seed!r}")
    return int(seed)


# --------------------------------------------------------------------------
# Calculators
# --------------------------------------------------------------------------

def _split_delta(delta, threshold_delta_fraction):
    delta = _check_open_unit("delta", delta)
    fraction = _check_open_unit("threshold_delta_fraction", threshold_delta_fraction)
    threshold_delta = fraction * delta
    return delta - threshold_delta, threshold_delta


def threshold_for(noise_stddev, delta, max_words_per_example, max_count=1,
                  threshold_delta_fraction=0.5):
    """Count threshold ``T`` so one example's unique words survive w.p. ``<= delta_threshold``.

    ``T = max_count + noise_stddev * scipy.stats.norm.isf(delta_threshold / k)``
    with ``delta_threshold = threshold_delta_fraction * delta`` and
    ``k = max_words_per_example``: a word whose whole count ``<= max_count``
    comes from one example passes ``count + N(0, noise_stddev^2) >= T`` with
    probability ``<= delta_threshold / k``, and the ``<= k`` words of that example
    together with probability ``<= delta_threshold``.

    Args:
        noise_stddev: standard deviation ``s`` of the Gaussian noise on each count.
        delta: total delta of the vocabulary mechanism (Gaussian + threshold parts).
        max_words_per_example: ``k``, distinct words one example may contribute.
        max_count: per-word cap on one example's contribution.
        threshold_delta_fraction: share of ``delta`` spent on thresholding.
    """
    noise_stddev = _check_positive("noise_stddev", noise_stddev)
    k = _check_int("max_words_per_example", max_words_per_example)
    max_count = _check_int("max_count", max_count)
    _, threshold_delta = _split_delta(delta, threshold_delta_fraction)
    return float(max_count + noise_stddev * stats.norm.isf(threshold_delta / k))


def gaussian_epsilon(noise_multiplier, delta):
    """Exact epsilon of one Gaussian mechanism (sensitivity 1, std ``noise_multiplier``).

    Uses ``dp_accounting.get_epsilon_gaussian`` (the analytic Gaussian mechanism
    of Balle & Wang 2018), which is exact for any epsilon; it matches
    ``dp_accounting.pld.PLDAccountant`` on ``GaussianDpEvent(noise_multiplier)``.
    A relative safety margin of 1e-9 covers the root finder's tolerance.
    """
    noise_multiplier = _check_positive("noise_multiplier", noise_multiplier)
    delta = _check_open_unit("delta", delta)
    eps = float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta))
    return eps * (1 + 1e-9) + 1e-12


def classical_noise_multiplier(epsilon, delta):
    """``sqrt(2 ln(1.25/delta)) / epsilon``: Dwork-Roth sufficient noise (valid for eps < 1)."""
    epsilon = _check_positive("epsilon", epsilon)
    delta = _check_open_unit("delta", delta)
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _threshold_epsilon_term(threshold_delta):
    return -math.log1p(-threshold_delta)


def epsilon_for(noise_stddev, delta, max_words_per_example, max_count=1,
                threshold_delta_fraction=0.5):
    """Epsilon of the DP histogram release (see the module docstring for the proof).

    ``epsilon = eps_gaussian(noise_multiplier, delta_gaussian) + log(1/(1 - delta_threshold))``
    with ``noise_multiplier = noise_stddev / (max_count * sqrt(max_words_per_example))``,
    ``delta_threshold = threshold_delta_fraction * delta`` and
    ``delta_gaussian = delta - delta_threshold``.
    """
    noise_stddev = _check_positive("noise_stddev", noise_stddev)
    k = _check_int("max_words_per_example", max_words_per_example)
    max_count = _check_int("max_count", max_count)
    gaussian_delta, threshold_delta = _split_delta(delta, threshold_delta_fraction)
    noise_multiplier = noise_stddev / (max_count * math.sqrt(k))
    return (gaussian_epsilon(noise_multiplier, gaussian_delta)
            + _threshold_epsilon_term(threshold_delta))


def noise_stddev_for(target_epsilon, delta, max_words_per_example, max_count=1,
                     threshold_delta_fraction=0.5):
    """Smallest noise std whose :func:`epsilon_for` is ``<= target_epsilon`` (calibration)."""
    target_epsilon = _check_positive("target_epsilon", target_epsilon)
    k = _check_int("max_words_per_example", max_words_per_example)
    max_count = _check_int("max_count", max_count)
    gaussian_delta, threshold_delta = _split_delta(delta, threshold_delta_fraction)
    eps_g = target_epsilon - _threshold_epsilon_term(threshold_delta)
    if eps_g <= 0:
        raise ValueError(f"`target_epsilon`={target_epsilon} is too small for delta={delta}.")
    sensitivity = max_count * math.sqrt(k)
    noise_multiplier = float(dp_accounting.get_sigma_gaussian(eps_g, gaussian_delta))
    # Never return a noise level whose reported epsilon exceeds the target.
    while epsilon_for(noise_multiplier * sensitivity, delta, k, max_count,
                      threshold_delta_fraction) > target_epsilon:
        noise_multiplier *= 1 + 1e-9
    return noise_multiplier * sensitivity


class VocabularyDpEvent(dp_accounting.ComposedDpEvent):
    """The ``DpEvent`` of one or more DP vocabulary releases.

    A ``dp_accounting.ComposedDpEvent`` whose events are, per release,
    ``GaussianDpEvent(noise_multiplier)`` and
    ``keras_dp_lm.accounting.EpsilonDeltaDpEvent(0, threshold_delta)`` (see the
    module doc for why). Pass it like any ``DpEvent`` to
    ``keras_dp_lm.PrivacyAccountant(extra_events=[...])`` or
    :func:`keras_dp_lm.accounting.compose_epsilon` (PLD accountant).
    """

    @classmethod
    def of_release(cls, noise_multiplier, threshold_delta):
        """The event of one histogram release."""
        return cls([dp_accounting.GaussianDpEvent(float(noise_multiplier)),
                    EpsilonDeltaDpEvent(0.0, float(threshold_delta))])

    @classmethod
    def compose(cls, events):
        """One event for several releases (their events, in order)."""
        children = []
        for event in events:
            if not isinstance(event, VocabularyDpEvent):
                raise ValueError(f"Expected VocabularyDpEvent objects, got {event!r}.")
            children.extend(event.events)
        return cls(children)

    @property
    def gaussian_events(self):
        return [e for e in self.events if isinstance(e, dp_accounting.GaussianDpEvent)]

    @property
    def num_releases(self):
        return len(self.gaussian_events)

    @property
    def threshold_delta(self):
        """Total threshold delta of the releases (inside the PLD as mass at infinity)."""
        return math.fsum(float(e.delta) for e in self.events
                         if isinstance(e, EpsilonDeltaDpEvent))

    @property
    def event(self):
        """The Gaussian part alone (one ``GaussianDpEvent``, or their composition)."""
        gaussians = self.gaussian_events
        return gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)

    def __iter__(self):
        # The 0.1 API returned an (event, threshold_delta) tuple; unpacking still
        # works (compose ``event``, add ``threshold_delta`` to the delta), but the
        # event itself is what to pass to an accountant.
        warnings.warn(
            "Unpacking `dp_event()` into (event, threshold_delta) is deprecated: pass "
            "the VocabularyDpEvent itself to PrivacyAccountant(extra_events=[...]) or "
            "keras_dp_lm.accounting.compose_epsilon.", DeprecationWarning, stacklevel=2)
        return iter((self.event, self.threshold_delta))

    def composed_epsilon(self, delta, *other_events):
        """Epsilon at total ``delta`` of these releases composed with ``other_events``.

        One call of :func:`keras_dp_lm.accounting.compose_epsilon` (PLD) on
        ``[self, *other_events]``.
        """
        delta = _check_open_unit("delta", delta)
        if delta <= self.threshold_delta:
            raise ValueError(f"`delta`={delta} must exceed the vocabulary's threshold_delta="
                             f"{self.threshold_delta}.")
        return compose_epsilon([self, *other_events], delta, "pld")


@dataclasses.dataclass(frozen=True)
class HistogramMechanism:
    """The data-independent parameters of one DP histogram release."""

    noise_multiplier: float
    delta: float
    max_words_per_example: int
    max_count: int = 1
    threshold_delta_fraction: float = 0.5

    def __post_init__(self):
        _check_positive("noise_multiplier", self.noise_multiplier)
        _check_open_unit("delta", self.delta)
        _check_int("max_words_per_example", self.max_words_per_example)
        _check_int("max_count", self.max_count)
        _check_open_unit("threshold_delta_fraction", self.threshold_delta_fraction)

    @classmethod
    def create(cls, *, delta, max_words_per_example, noise_multiplier=None,
               target_epsilon=None, max_count=1, threshold_delta_fraction=0.5):
        """Build from either ``noise_multiplier`` or ``target_epsilon`` (calibrated)."""
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                "Pass exactly one of `noise_multiplier` and `target_epsilon`. Received: "
                f"noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}")
        k = _check_int("max_words_per_example", max_words_per_example)
        max_count = _check_int("max_count", max_count)
        if target_epsilon is not None:
            stddev = noise_stddev_for(target_epsilon, delta, k, max_count,
                                      threshold_delta_fraction)
            noise_multiplier = stddev / (max_count * math.sqrt(k))
        return cls(float(_check_positive("noise_multiplier", noise_multiplier)), float(delta),
                   k, max_count, float(threshold_delta_fraction))

    @property
    def l2_sensitivity(self):
        return self.max_count * math.sqrt(self.max_words_per_example)

    @property
    def linf_sensitivity(self):
        return float(self.max_count)

    @property
    def noise_stddev(self):
        return self.noise_multiplier * self.l2_sensitivity

    @property
    def threshold_delta(self):
        return self.threshold_delta_fraction * self.delta

    @property
    def gaussian_delta(self):
        return self.delta - self.threshold_delta

    @property
    def threshold(self):
        return threshold_for(self.noise_stddev, self.delta, self.max_words_per_example,
                             self.max_count, self.threshold_delta_fraction)

    @property
    def gaussian_epsilon(self):
        return gaussian_epsilon(self.noise_multiplier, self.gaussian_delta)

    @property
    def epsilon(self):
        return epsilon_for(self.noise_stddev, self.delta, self.max_words_per_example,
                           self.max_count, self.threshold_delta_fraction)

    def dp_event(self):
        return VocabularyDpEvent.of_release(self.noise_multiplier, self.threshold_delta)

    def report(self):
        """A JSON-able dict of the guarantee and its parts."""
        classical = math.sqrt(2.0 * math.log(1.25 / self.gaussian_delta)) / self.noise_multiplier
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "gaussian_epsilon": self.gaussian_epsilon,
            "gaussian_delta": self.gaussian_delta,
            "threshold_delta": self.threshold_delta,
            "noise_multiplier": self.noise_multiplier,
            "noise_stddev": self.noise_stddev,
            "l2_sensitivity": self.l2_sensitivity,
            "linf_sensitivity": self.linf_sensitivity,
            "threshold": self.threshold,
            "max_words_per_example": self.max_words_per_example,
            "max_count": self.max_count,
            # Dwork-Roth: eps = sqrt(2 ln(1.25/delta)) / sigma, valid only when < 1.
            "classical_gaussian_epsilon": classical,
            "classical_bound_valid": classical < 1.0,
        }


# --------------------------------------------------------------------------
# Pre-tokenization
# --------------------------------------------------------------------------

def split_examples(text, unit="paragraph"):
    """Split a text into privacy units: ``"paragraph"`` (blank-line separated) or ``"line"``.

    In the Shakespeare texts a paragraph is one speech (speaker tag + lines).
    Empty units are dropped.
    """
    if unit == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    elif unit == "line":
        parts = text.splitlines()
    else:
        raise ValueError(f"`unit` must be 'paragraph' or 'line'. Received: unit={unit!r}")
    return [p.strip() for p in parts if p.strip()]


def _pretokenize_batch(strings, lowercase, strip_accents, nfkc):
    """Split a batch of strings the way ``WordPieceTokenizer(split=True)`` does.

    Returns ``(flat_words: np.ndarray[bytes], row_lengths: np.ndarray[int])``.
    """
    import tensorflow_text as tf_text  # noqa: PLC0415
    # The exact function KerasHub's WordPieceTokenizer calls on its input, so the
    # histogram's words are the words the tokenizer will see (private API of the
    # pinned keras-hub; the public tokenizer offers no word-level output).
    from keras_hub.src.tokenizers.word_piece_tokenizer import pretokenize  # noqa: PLC0415

    text = tf.convert_to_tensor(strings, dtype=tf.string)
    if nfkc and not lowercase:  # case_fold_utf8 already applies NFKC
        text = tf_text.normalize_utf8(text, "NFKC")
    words = pretokenize(text, lowercase=lowercase, strip_accents=strip_accents,
                        split=True, split_on_cjk=True)
    return words.flat_values.numpy(), words.row_lengths().numpy()


def _string_batches(data, batch_size):
    """Yield lists/tensors of example strings from any supported ``data``."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise ValueError(
                "`data` is a single string, which is read as a file path, but no file "
                f"{str(data)[:80]!r} exists. Pass a list of strings (one per example), a "
                "tf.data.Dataset of strings, or pathlib.Path file paths.")
        data = [path]
    if isinstance(data, (bytes, bytearray)):
        raise ValueError("`data` must be a dataset or an iterable of strings; received bytes.")
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        if not isinstance(spec, tf.TensorSpec) or spec.dtype != tf.string:
            raise ValueError(
                "The elements of `data` must be strings (tf.string tensors); received "
                f"element_spec={spec}. Map the dataset to its text field first.")
        if spec.shape.rank == 0:
            data = data.batch(batch_size)
        elif spec.shape.rank != 1:
            data = data.map(lambda x: tf.reshape(x, [-1]))
        for batch in data:
            yield batch
        return
    if isinstance(data, tf.Tensor):
        if data.dtype != tf.string:
            raise ValueError(f"`data` must hold strings; received a tensor of dtype {data.dtype}.")
        data = data.numpy().reshape(-1).tolist()
    try:
        iterator = iter(data)
    except TypeError:
        raise ValueError(
            "`data` must be a tf.data.Dataset of strings, an iterable of strings, or file "
            f"paths; received {type(data).__name__}.") from None
    batch = []
    for index, element in enumerate(iterator):
        if isinstance(element, os.PathLike):
            with open(element, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        batch.append(line.rstrip("\n"))
                        if len(batch) >= batch_size:
                            yield batch
                            batch = []
            continue
        if isinstance(element, bytes):
            element = element.decode("utf-8", errors="replace")
        if not isinstance(element, str):
            raise ValueError(
                f"Element {index} of `data` is {type(element).__name__} ({element!r:.60}), not "
                "text. Pass strings (one per example) or pathlib.Path file paths.")
        batch.append(element)
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------
# The DP histogram
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, repr=False)
class DPWordHistogram:
    """A released DP word histogram: only noised counts that passed the threshold.

    ``counts`` maps word -> noised count (a float ``>= mechanism.threshold``);
    raw counts are never part of it.
    """

    counts: dict
    mechanism: HistogramMechanism

    @property
    def epsilon(self):
        return self.mechanism.epsilon

    @property
    def delta(self):
        return self.mechanism.delta

    @property
    def threshold(self):
        return self.mechanism.threshold

    def dp_event(self):
        return self.mechanism.dp_event()

    def __len__(self):
        return len(self.counts)

    def __repr__(self):
        return (f"DPWordHistogram({len(self.counts)} words, epsilon={self.epsilon:.4g}, "
                f"delta={self.delta:.3g}, threshold={self.threshold:.4g})")


class _BoundedCounter:
    """Accumulates contribution-bounded counts batch by batch (raw state: local only)."""

    def __init__(self, max_words_per_example, max_count, rng):
        self.k = max_words_per_example
        self.max_count = max_count
        self.rng = rng
        self.word_ids = {}
        self.counts = np.zeros(0, dtype=np.int64)
        self.num_examples = 0

    def add(self, flat_words, row_lengths, word_type=None):
        row_lengths = np.asarray(row_lengths, dtype=np.int64)
        self.num_examples += len(row_lengths)
        if len(flat_words) == 0:
            return
        table = self.word_ids
        new_words = [w for w in dict.fromkeys(flat_words) if w not in table]
        if word_type is not None:
            for word in new_words:
                if not isinstance(word, word_type):
                    raise ValueError(f"`examples` holds a {type(word).__name__} ({word!r:.40}) "
                                     "where a str word was expected.")
        table.update(zip(new_words, range(len(table), len(table) + len(new_words))))
        ids = np.fromiter(map(table.__getitem__, flat_words), dtype=np.int64,
                          count=len(flat_words))
        vocab = len(table)
        example = np.repeat(np.arange(len(row_lengths), dtype=np.int64), row_lengths)
        pairs, per_example_count = np.unique(example * vocab + ids, return_counts=True)
        pair_example, pair_word = pairs // vocab, pairs % vocab
        # Keep a uniformly random subset of at most k distinct words per example:
        # sort each example's words by a random key and keep the first k.
        order = np.lexsort((self.rng.random(len(pairs)), pair_example))
        sorted_example = pair_example[order]
        starts = np.flatnonzero(np.r_[True, sorted_example[1:] != sorted_example[:-1]])
        sizes = np.diff(np.r_[starts, len(order)])
        rank = np.arange(len(order)) - np.repeat(starts, sizes)
        kept = order[rank < self.k]
        contribution = np.minimum(per_example_count[kept], self.max_count)
        added = np.bincount(pair_word[kept], weights=contribution, minlength=vocab)
        if len(self.counts) < vocab:
            grow = np.zeros(vocab - len(self.counts), np.int64)
            self.counts = np.concatenate([self.counts, grow])
        self.counts += np.rint(added).astype(np.int64)


def _noise_and_threshold(counts, noise_stddev, threshold, rng):
    """The release step: noise every candidate (count > 0), keep noised counts >= threshold.

    Returns ``(indices, noised_values)`` of the survivors.
    """
    counts = np.asarray(counts, dtype=np.float64)
    candidates = np.flatnonzero(counts > 0)
    noised = counts[candidates] + rng.normal(0.0, noise_stddev, size=len(candidates))
    keep = noised >= threshold
    return candidates[keep], noised[keep]


def _release(counter, mechanism, rng):
    if counter.num_examples == 0:
        raise ValueError("`data` is empty: the corpus has no examples to learn a vocabulary from.")
    indices, values = _noise_and_threshold(counter.counts, mechanism.noise_stddev,
                                           mechanism.threshold, rng)
    words = np.empty(len(counter.word_ids), dtype=object)
    words[list(counter.word_ids.values())] = list(counter.word_ids.keys())
    released = {}
    for word, value in zip(words[indices], values):
        if isinstance(word, bytes):
            word = word.decode("utf-8", errors="replace")
        released[word] = float(value)
    # Drop every raw structure before returning.
    counter.counts = None
    counter.word_ids = None
    return DPWordHistogram(released, mechanism)


def dp_word_histogram(data, *, delta, max_words_per_example, noise_multiplier=None,
                      target_epsilon=None, max_count=1, threshold_delta_fraction=0.5,
                      seed=None, lowercase=True, strip_accents=False, nfkc=False,
                      batch_size=DEFAULT_BATCH_SIZE):
    """Release a DP word histogram of ``data`` (see the module docstring).

    Args:
        data: a ``tf.data.Dataset`` of strings (scalar or batched), an iterable of
            strings, or file paths (``pathlib.Path`` objects, or a single path
            string). Each string is one example (the privacy unit); in files each
            non-empty line is one example.
        delta: total delta (Gaussian part + threshold part).
        max_words_per_example: ``k``, distinct words kept per example (a seeded
            uniformly random choice when an example has more).
        noise_multiplier: noise std divided by the L2 sensitivity. Exclusive with
            ``target_epsilon``.
        target_epsilon: calibrate the noise so the release has this epsilon.
        max_count: per-word cap on one example's contribution.
        threshold_delta_fraction: share of ``delta`` given to thresholding.
        seed: seeds both the word choice and the noise; ``None`` uses OS entropy
            (use ``None`` for real releases: a known seed lets anyone remove the noise).
        lowercase, strip_accents: pre-tokenizer options, as in
            ``keras_hub.tokenizers.WordPieceTokenizer``.
        nfkc: NFKC-normalize the text first (what SentencePiece's normalizer does).
        batch_size: examples pre-tokenized together.

    Returns:
        A :class:`DPWordHistogram`.
    """
    mechanism = HistogramMechanism.create(
        delta=delta, max_words_per_example=max_words_per_example,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
        max_count=max_count, threshold_delta_fraction=threshold_delta_fraction)
    batch_size = _check_int("batch_size", batch_size)
    rng = np.random.default_rng(_check_seed(seed))
    counter = _BoundedCounter(mechanism.max_words_per_example, mechanism.max_count, rng)
    for batch in _string_batches(data, batch_size):
        counter.add(*_pretokenize_batch(batch, lowercase, strip_accents, nfkc))
    return _release(counter, mechanism, rng)


def dp_word_histogram_from_words(examples, *, delta, max_words_per_example,
                                 noise_multiplier=None, target_epsilon=None, max_count=1,
                                 threshold_delta_fraction=0.5, seed=None,
                                 batch_size=DEFAULT_BATCH_SIZE):
    """Like :func:`dp_word_histogram` for examples already split into words.

    ``examples`` is an iterable of word sequences (one sequence per example);
    words are used as given (no lowercasing or splitting).
    """
    mechanism = HistogramMechanism.create(
        delta=delta, max_words_per_example=max_words_per_example,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
        max_count=max_count, threshold_delta_fraction=threshold_delta_fraction)
    batch_size = _check_int("batch_size", batch_size)
    rng = np.random.default_rng(_check_seed(seed))
    counter = _BoundedCounter(mechanism.max_words_per_example, mechanism.max_count, rng)
    flat, lengths = [], []
    for index, words in enumerate(examples):
        if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
            raise ValueError(
                f"Element {index} of `examples` is {type(words).__name__}, not a sequence of "
                "words. Use dp_word_histogram() for raw text.")
        before = len(flat)
        flat.extend(words)
        lengths.append(len(flat) - before)
        if len(lengths) >= batch_size:
            counter.add(flat, lengths, word_type=str)
            flat, lengths = [], []
    if lengths:
        counter.add(flat, lengths, word_type=str)
    return _release(counter, mechanism, rng)


# --------------------------------------------------------------------------
# Learners fed from released counts
# --------------------------------------------------------------------------

def _released_counts(histogram):
    """Integer counts for the learners (rounding is post-processing)."""
    counts = histogram.counts if isinstance(histogram, DPWordHistogram) else histogram
    if not isinstance(counts, dict):
        raise ValueError("`histogram` must be a DPWordHistogram or a {word: count} dict. "
                         f"Received: {type(histogram).__name__}")
    return {str(w): max(1, int(round(float(c)))) for w, c in counts.items()}


def _too_few_words_error(vocabulary_size, learned, survivors, histogram):
    extra = ""
    if isinstance(histogram, DPWordHistogram):
        extra = (f" under the DP threshold {histogram.threshold:.1f} (epsilon="
                 f"{histogram.epsilon:.3g})")
    return ValueError(
        f"`vocabulary_size`={vocabulary_size} is larger than the {survivors} words that "
        f"survived{extra} can support (the learner reached {learned} tokens). Lower "
        "`vocabulary_size`, use more examples, allow a larger epsilon (smaller "
        "`noise_multiplier`), or lower `max_words_per_example`.")


def learn_wordpiece_vocabulary(histogram, vocabulary_size, *,
                               reserved_tokens=WORDPIECE_RESERVED_TOKENS,
                               suffix_indicator="##", slack_ratio=0.05, **learner_kwargs):
    """WordPiece vocabulary from released counts via tensorflow_text's learner.

    Same learner and settings as ``keras_hub.tokenizers.compute_word_piece_vocabulary``
    (``include_joiner_token=True``; result truncated to ``vocabulary_size``), but fed
    from a :class:`DPWordHistogram`. Raises ``ValueError`` if the survivors cannot
    support ``(1 - slack_ratio) * vocabulary_size`` tokens.
    """
    from tensorflow_text.tools.wordpiece_vocab import (  # noqa: PLC0415
        wordpiece_tokenizer_learner_lib as learner)

    vocabulary_size = _check_int("vocabulary_size", vocabulary_size)
    reserved_tokens = list(reserved_tokens)
    counts = _released_counts(histogram)
    if not counts:
        raise _too_few_words_error(vocabulary_size, len(reserved_tokens), 0, histogram)
    vocab = learner.learn(counts, vocab_size=vocabulary_size, reserved_tokens=reserved_tokens,
                          include_joiner_token=True, joiner=suffix_indicator,
                          slack_ratio=slack_ratio, **learner_kwargs)
    vocab = list(vocab[:vocabulary_size])
    if len(vocab) < (1.0 - slack_ratio) * vocabulary_size:
        raise _too_few_words_error(vocabulary_size, len(vocab), len(counts), histogram)
    return vocab


def learn_sentencepiece_proto(histogram, vocabulary_size, *, model_type="unigram",
                              reserved_tokens=SENTENCEPIECE_RESERVED_TOKENS, lowercase=True,
                              **trainer_kwargs):
    """SentencePiece model proto (bytes) from released counts (``input_format="tsv"``).

    Each released word becomes one ``word<TAB>count`` row. ``reserved_tokens[:4]``
    are the pad, unk, bos and eos pieces (ids 0-3); further reserved tokens are
    user-defined symbols. ``lowercase=True`` stores the ``nmt_nfkc_cf``
    normalizer (NFKC + case folding at encoding time), else ``nmt_nfkc``.
    """
    import sentencepiece as spm  # noqa: PLC0415

    vocabulary_size = _check_int("vocabulary_size", vocabulary_size)
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"`model_type` must be 'unigram' or 'bpe'. Received: {model_type!r}")
    reserved_tokens = list(reserved_tokens)
    if len(reserved_tokens) < 4:
        raise ValueError("`reserved_tokens` for SentencePiece needs at least 4 tokens: pad, "
                         f"unk, bos, eos. Received: reserved_tokens={reserved_tokens!r}")
    counts = _released_counts(histogram)
    if not counts:
        raise _too_few_words_error(vocabulary_size, 0, 0, histogram)
    rows = [f"{w}\t{c}" for w, c in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
            if "\t" not in w and "\n" not in w]
    options = dict(
        model_type=model_type, vocab_size=vocabulary_size, input_format="tsv",
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        pad_piece=reserved_tokens[0], unk_piece=reserved_tokens[1],
        bos_piece=reserved_tokens[2], eos_piece=reserved_tokens[3],
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
        character_coverage=1.0, minloglevel=2, num_threads=1)
    if len(reserved_tokens) > 4:
        options["user_defined_symbols"] = reserved_tokens[4:]
    options.update(trainer_kwargs)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(rows), model_writer=model,
                                       **options)
    except RuntimeError as err:
        match = re.search(r"Vocabulary size too high \((\d+)\).*<= (\d+)", str(err))
        if match:
            raise _too_few_words_error(vocabulary_size, int(match.group(2)), len(counts),
                                       histogram) from None
        raise
    return model.getvalue()


# --------------------------------------------------------------------------
# The Keras layer
# --------------------------------------------------------------------------

class _TokenizerHolder:
    """Holds the layer's KerasHub tokenizer out of sight of Keras tracking/saving."""

    tokenizer = None


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPVocabularyAdapter(keras.layers.Layer):
    """A DP vocabulary learner and tokenizer, in the style of ``TextVectorization``.

    ``adapt(data)`` releases a DP word histogram of ``data`` (see
    :mod:`keras_dp_lm.vocab`) and learns a WordPiece or SentencePiece
    vocabulary from the surviving words only; ``call(strings)`` tokenizes to
    ids with the matching KerasHub tokenizer. The learned vocabulary / model
    proto is saved as a layer asset inside ``.keras`` files. Raw counts are
    never stored: adapt keeps only the learned vocabulary.

    Privacy unit: one element of ``data`` (one string). One release's guarantee
    depends only on the constructor arguments (``mechanism``), so it is known
    before ``adapt``.

    Every ``adapt`` call releases one more noised histogram, and every release
    is counted: ``num_releases`` counts them, ``epsilon`` and ``delta`` are the
    totals over all of them (basic composition: the sums), and ``dp_event()``
    composes all of them (compose it with training for a tighter total).
    Before the first ``adapt`` they describe the one release it will make, so
    the budget can be planned. A release counts as soon as the noised histogram
    exists, also if the learner then fails (its error reports how many words
    survived). The releases are saved with the layer (config and ``.keras``
    assets): a reloaded or cloned layer that adapts again keeps counting. With a
    fixed ``seed``, release ``i`` draws its noise from the stream
    ``(seed, i)``, so no two releases ever reuse the same noise. (Re-adapting
    is allowed, as for Keras's ``TextVectorization``, rather than refused: it
    is an honest, counted second release.)
    ``max_words_per_example`` should be near the number of distinct words of a
    typical example (e.g. 8 for verse lines, 16-32 for speeches): the noise
    grows with its square root, while words beyond it are dropped from long
    examples.

    Example:

    ```python
    adapter = keras_dp_lm.vocab.DPVocabularyAdapter(
        vocabulary_size=2000, target_epsilon=4.0, delta=1e-6,
        max_words_per_example=8, sequence_length=64)
    adapter.adapt(lines)                    # list / tf.data.Dataset of strings
    adapter.epsilon, adapter.dp_event()     # (<= 4.0), for the training accountant
    keras_dp_lm.PrivacyAccountant(delta=1e-6, dataset_size=len(lines),
                                  extra_events=[adapter.dp_event()])
    ids = adapter(["To be, or not to be"])  # [1, 64] int32
    tokenizer = adapter.tokenizer()         # keras_hub WordPieceTokenizer
    ```

    Args:
        vocabulary_size: target vocabulary size (including reserved tokens).
        algorithm: ``"wordpiece"``, ``"sentencepiece_unigram"`` or
            ``"sentencepiece_bpe"``.
        noise_multiplier: noise std / L2 sensitivity; exclusive with
            ``target_epsilon``.
        target_epsilon: calibrate the noise to this epsilon.
        delta: total delta of the vocabulary release (required).
        max_words_per_example: distinct words one example may contribute.
        max_count: per-word cap on one example's contribution.
        threshold_delta_fraction: share of ``delta`` spent on thresholding.
        seed: seeds word choice and noise; ``None`` (the default, and the right
            choice for a real release) draws from OS entropy. A fixed seed is for
            reproducible tests: anyone who knows it can subtract the noise.
        reserved_tokens: WordPiece: tokens placed first (default ``[PAD]``,
            ``[CLS]``, ``[SEP]``, ``[UNK]``, ``[MASK]``, BERT-compatible).
            SentencePiece: pad, unk, bos, eos pieces, then user symbols.
        oov_token: WordPiece unknown token (must be reserved).
        lowercase: case-fold before counting and tokenizing.
        strip_accents: WordPiece only: strip accents.
        sequence_length: pad/truncate outputs to this length (dense output).
    """

    def __init__(self, vocabulary_size, algorithm="wordpiece", *, noise_multiplier=None,
                 target_epsilon=None, delta=None, max_words_per_example=16, max_count=1,
                 threshold_delta_fraction=0.5, seed=None, reserved_tokens=None,
                 oov_token=None, lowercase=True, strip_accents=False,
                 sequence_length=None, **kwargs):
        kwargs.setdefault("dtype", "int32")
        super().__init__(**kwargs)
        # Like KerasHub preprocessing layers: accept Python strings and keep tf tensors.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self.target_vocabulary_size = _check_int("vocabulary_size", vocabulary_size)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"`algorithm` must be one of {ALGORITHMS}. "
                             f"Received: algorithm={algorithm!r}")
        self.algorithm = algorithm
        if delta is None:
            raise ValueError("`delta` is required, e.g. delta=1e-6 (well below 1 / number "
                             "of examples).")
        self._mechanism = HistogramMechanism.create(
            delta=delta, max_words_per_example=max_words_per_example,
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            max_count=max_count, threshold_delta_fraction=threshold_delta_fraction)
        self._noise_multiplier_arg = noise_multiplier
        self.target_epsilon = target_epsilon
        self.seed = _check_seed(seed)
        if reserved_tokens is None:
            reserved_tokens = (WORDPIECE_RESERVED_TOKENS if algorithm == "wordpiece"
                               else SENTENCEPIECE_RESERVED_TOKENS)
        if isinstance(reserved_tokens, str) or not all(
                isinstance(t, str) for t in reserved_tokens):
            raise ValueError("`reserved_tokens` must be a list of strings. Received: "
                             f"reserved_tokens={reserved_tokens!r}")
        self.reserved_tokens = list(reserved_tokens)
        if algorithm == "wordpiece":
            self.oov_token = "[UNK]" if oov_token is None else oov_token
            if self.oov_token not in self.reserved_tokens:
                raise ValueError(f"`oov_token`={self.oov_token!r} must be one of "
                                 f"`reserved_tokens`={self.reserved_tokens!r}.")
        else:
            if len(self.reserved_tokens) < 4:
                raise ValueError("`reserved_tokens` for SentencePiece needs pad, unk, bos "
                                 f"and eos pieces. Received: {self.reserved_tokens!r}")
            if oov_token not in (None, self.reserved_tokens[1]):
                raise ValueError(f"`oov_token` for SentencePiece is reserved_tokens[1]="
                                 f"{self.reserved_tokens[1]!r}. Received: {oov_token!r}")
            self.oov_token = self.reserved_tokens[1]
        if len(self.reserved_tokens) >= self.target_vocabulary_size:
            raise ValueError(f"`vocabulary_size`={vocabulary_size} must exceed the "
                             f"{len(self.reserved_tokens)} reserved tokens.")
        self.lowercase = bool(lowercase)
        self.strip_accents = bool(strip_accents)
        self.sequence_length = (None if sequence_length is None
                                else _check_int("sequence_length", sequence_length))
        self._vocabulary = None
        self._proto = None
        self._num_surviving_words = None
        self._releases = []   # the HistogramMechanism of every release made
        # The KerasHub tokenizer sits in a plain holder: Keras neither tracks it nor
        # saves it a second time (this layer saves the vocabulary as its own asset).
        self._holder = _TokenizerHolder()
        self.built = True

    # --- privacy ----------------------------------------------------------
    @property
    def mechanism(self):
        return self._mechanism

    @property
    def num_releases(self):
        """How many noised histograms this layer has released (``adapt`` calls)."""
        return len(self._releases)

    def _accounted_releases(self):
        # Before the first adapt: the release it will make (planning).
        return list(self._releases) or [self._mechanism]

    @property
    def epsilon(self):
        """Total epsilon of every release (sum; one release before the first adapt)."""
        return math.fsum(m.epsilon for m in self._accounted_releases())

    @property
    def delta(self):
        """Total delta of every release (sum; one release before the first adapt)."""
        return math.fsum(m.delta for m in self._accounted_releases())

    @property
    def noise_multiplier(self):
        return self._mechanism.noise_multiplier

    @property
    def threshold(self):
        return self._mechanism.threshold

    def dp_event(self):
        """A :class:`VocabularyDpEvent` composing every release (the planned one
        before the first ``adapt``): a ``dp_accounting.DpEvent`` for
        ``PrivacyAccountant(extra_events=[...])`` / ``compose_epsilon``."""
        return VocabularyDpEvent.compose(m.dp_event() for m in self._accounted_releases())

    def privacy_report(self):
        """One release's parameters, plus ``num_releases`` and the totals
        (``epsilon``, ``delta``) over all releases."""
        report = self._mechanism.report()
        report["release_epsilon"] = report["epsilon"]
        report["release_delta"] = report["delta"]
        report["epsilon"] = self.epsilon
        report["delta"] = self.delta
        report["num_releases"] = self.num_releases
        report["releases"] = [dataclasses.asdict(m) for m in self._releases]
        report["num_surviving_words"] = self._num_surviving_words
        return report

    def _release_seed(self, index):
        """The seed of release ``index``: ``seed`` itself for the first, then a
        separate stream per release (never the same noise twice)."""
        if self.seed is None or index == 0:
            return self.seed
        state = np.random.SeedSequence(self.seed, spawn_key=(index,)).generate_state(
            1, np.uint64)
        return int(state[0])

    def _restore_releases(self, releases):
        releases = [m if isinstance(m, HistogramMechanism) else HistogramMechanism(**m)
                    for m in releases]
        if len(releases) > len(self._releases):
            self._releases = releases

    # --- learning ---------------------------------------------------------
    @property
    def is_adapted(self):
        return self._vocabulary is not None

    def adapt(self, data, batch_size=None):
        """Learn the DP vocabulary from ``data``; each string is one example.

        ``data``: a ``tf.data.Dataset`` of strings (scalar or batched), an iterable
        of strings, or ``pathlib.Path`` file paths (one example per non-empty
        line). ``batch_size`` only sets how many examples are pre-tokenized at once.
        Calling ``adapt`` again makes (and counts) another release: ``epsilon``,
        ``delta`` and ``dp_event()`` then cover all of them.
        """
        batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        seed = self._release_seed(len(self._releases))
        histogram = dp_word_histogram(
            data, delta=self._mechanism.delta,
            max_words_per_example=self._mechanism.max_words_per_example,
            noise_multiplier=self._mechanism.noise_multiplier,
            max_count=self._mechanism.max_count,
            threshold_delta_fraction=self._mechanism.threshold_delta_fraction,
            seed=seed, lowercase=self.lowercase,
            strip_accents=self.strip_accents and self.algorithm == "wordpiece",
            nfkc=self.algorithm != "wordpiece", batch_size=batch_size)
        # Counted the moment it exists: the learner's errors reveal the survivors.
        self._releases.append(histogram.mechanism)
        if histogram.mechanism != self._mechanism:  # pragma: no cover - defensive
            raise RuntimeError("DP histogram mechanism mismatch")
        if self.algorithm == "wordpiece":
            vocabulary = learn_wordpiece_vocabulary(
                histogram, self.target_vocabulary_size, reserved_tokens=self.reserved_tokens)
            self._set_learned(vocabulary=vocabulary, survivors=len(histogram))
        else:
            proto = learn_sentencepiece_proto(
                histogram, self.target_vocabulary_size,
                model_type=self.algorithm.split("_", 1)[1],
                reserved_tokens=self.reserved_tokens, lowercase=self.lowercase)
            self._set_learned(proto=proto, survivors=len(histogram))
        del histogram

    def _set_learned(self, vocabulary=None, proto=None, survivors=None):
        import keras_hub  # noqa: PLC0415
        if self.algorithm == "wordpiece":
            tokenizer = keras_hub.tokenizers.WordPieceTokenizer(
                vocabulary=list(vocabulary), sequence_length=self.sequence_length,
                lowercase=self.lowercase, strip_accents=self.strip_accents,
                oov_token=self.oov_token)
            self._vocabulary = list(vocabulary)
            self._proto = None
        else:
            tokenizer = keras_hub.tokenizers.SentencePieceTokenizer(
                proto=bytes(proto), sequence_length=self.sequence_length)
            self._proto = bytes(proto)
            self._vocabulary = list(tokenizer.get_vocabulary())
        self._num_surviving_words = survivors
        self._holder.tokenizer = tokenizer

    # --- outputs ----------------------------------------------------------
    def _check_adapted(self):
        if not self.is_adapted:
            raise ValueError(f"{self.name} has no vocabulary yet: call `adapt(data)` first.")

    def get_vocabulary(self):
        """The learned tokens, id order (reserved tokens first)."""
        self._check_adapted()
        return list(self._vocabulary)

    def vocabulary_size(self):
        """Learned vocabulary length (WordPiece may be up to 5% under the target)."""
        self._check_adapted()
        return len(self._vocabulary)

    def get_proto(self):
        """SentencePiece model proto bytes (SentencePiece algorithms only)."""
        self._check_adapted()
        if self._proto is None:
            raise ValueError("`get_proto()` is only defined for the SentencePiece algorithms.")
        return self._proto

    def save_vocabulary(self, path):
        """Write ``vocabulary.txt`` (one token a line) or the ``.model`` proto to ``path``."""
        self._check_adapted()
        if self._proto is not None:
            Path(path).write_bytes(self._proto)
        else:
            Path(path).write_text("".join(t + "\n" for t in self._vocabulary),
                                  encoding="utf-8")
        return path

    def tokenizer(self):
        """The KerasHub tokenizer for the learned vocabulary."""
        self._check_adapted()
        return self._holder.tokenizer

    def call(self, inputs):
        self._check_adapted()
        return self._holder.tokenizer(inputs)

    def compute_output_spec(self, inputs):
        # Known without a vocabulary, so models rebuild before assets are loaded.
        shape = tuple(inputs.shape) + (self.sequence_length,)
        return keras.KerasTensor(shape, dtype="int32",
                                 ragged=self.sequence_length is None and len(shape) > 1)

    # --- serialization ----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update({
            "vocabulary_size": self.target_vocabulary_size,
            "algorithm": self.algorithm,
            "noise_multiplier": self._noise_multiplier_arg,
            "target_epsilon": self.target_epsilon,
            "delta": self._mechanism.delta,
            "max_words_per_example": self._mechanism.max_words_per_example,
            "max_count": self._mechanism.max_count,
            "threshold_delta_fraction": self._mechanism.threshold_delta_fraction,
            "seed": self.seed,
            "reserved_tokens": list(self.reserved_tokens),
            "oov_token": self.oov_token if self.algorithm == "wordpiece" else None,
            "lowercase": self.lowercase,
            "strip_accents": self.strip_accents,
            "sequence_length": self.sequence_length,
            # Releases already made: a layer rebuilt from this config keeps counting.
            "dp_releases": [dataclasses.asdict(m) for m in self._releases],
        })
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        releases = config.pop("dp_releases", [])
        layer = cls(**config)
        layer._restore_releases(releases)
        return layer

    def save_assets(self, dir_path):
        if not self.is_adapted:
            return
        if self._proto is not None:
            Path(dir_path, _PROTO_ASSET).write_bytes(self._proto)
        else:
            Path(dir_path, _VOCAB_ASSET).write_text(
                "".join(t + "\n" for t in self._vocabulary), encoding="utf-8")
        Path(dir_path, _META_ASSET).write_text(json.dumps(self.privacy_report(), indent=1))

    def load_assets(self, dir_path):
        meta = Path(dir_path, _META_ASSET)
        survivors = None
        if meta.exists():
            report = json.loads(meta.read_text())
            survivors = report.get("num_surviving_words")
            self._restore_releases(report.get("releases", []))
        if Path(dir_path, _PROTO_ASSET).exists():
            self._set_learned(proto=Path(dir_path, _PROTO_ASSET).read_bytes(),
                              survivors=survivors)
        elif Path(dir_path, _VOCAB_ASSET).exists():
            text = Path(dir_path, _VOCAB_ASSET).read_text(encoding="utf-8")
            self._set_learned(vocabulary=text.split("\n")[:-1], survivors=survivors)
        if self.is_adapted:
            # A learned vocabulary is at least one release (files from before
            # releases were recorded).
            self._restore_releases([self._mechanism])
