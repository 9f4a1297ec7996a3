"""The DP word histogram: contribution-bounded counts, Gaussian noise, thresholding.

See :mod:`keras_dp_lm.tokenizers` for the mechanism and its guarantee.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers._arguments import _check_seed
from keras_dp_lm.tokenizers.events import HistogramMechanism
from keras_dp_lm.tokenizers.pretokenize import _pretokenize_batch
from keras_dp_lm.tokenizers.pretokenize import _string_batches

if TYPE_CHECKING:
    import tensorflow as tf

    from keras_dp_lm.tokenizers.events import VocabularyDpEvent

DEFAULT_BATCH_SIZE = 4096


@dataclasses.dataclass(frozen=True, repr=False)
class DPWordHistogram:
    """A released DP word histogram: only noised counts that passed the threshold.

    ``counts`` maps word -> noised count (a float ``>= mechanism.threshold``);
    raw counts are never part of it.

    Example:
        >>> mechanism = HistogramMechanism(noise_multiplier=1.0, delta=1e-6,
        ...                                max_words_per_example=2)
        >>> DPWordHistogram({"to": 99.2, "be": 87.5}, mechanism)
        DPWordHistogram(2 words, epsilon=5.03, delta=1e-06, threshold=8.108)
    """

    counts: dict[str, float]
    mechanism: HistogramMechanism

    @property
    def epsilon(self) -> float:
        return self.mechanism.epsilon

    @property
    def delta(self) -> float:
        return self.mechanism.delta

    @property
    def threshold(self) -> float:
        return self.mechanism.threshold

    def dp_event(self) -> VocabularyDpEvent:
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
                    raise ValueError(f"`examples` holds a {type(word).__name__} where a str "
                                     "word was expected (its content is not shown: the "
                                     "data are private).")
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
    # Sorted: an order of first appearance in the private data would itself
    # be released (the review told neighbouring corpora apart by it).
    released = dict(sorted(released.items()))
    # Drop every raw structure before returning.
    counter.counts = None
    counter.word_ids = None
    return DPWordHistogram(released, mechanism)


def _start_release(*, delta, max_words_per_example, noise_multiplier, target_epsilon,
                   max_count, threshold_delta_fraction, seed, batch_size):
    """The mechanism, checked batch size, generator and empty counter of one release."""
    mechanism = HistogramMechanism.create(
        delta=delta, max_words_per_example=max_words_per_example,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
        max_count=max_count, threshold_delta_fraction=threshold_delta_fraction)
    batch_size = _check_int("batch_size", batch_size)
    rng = np.random.default_rng(_check_seed(seed))
    counter = _BoundedCounter(mechanism.max_words_per_example, mechanism.max_count, rng)
    return mechanism, batch_size, rng, counter


def dp_word_histogram(data: tf.data.Dataset | str | Path | Iterable[str | Path], *, delta: float,
                      max_words_per_example: int, noise_multiplier: float | None = None,
                      target_epsilon: float | None = None, max_count: int = 1,
                      threshold_delta_fraction: float = 0.5, seed: int | None = None,
                      lowercase: bool = True, strip_accents: bool = False, nfkc: bool = False,
                      batch_size: int = DEFAULT_BATCH_SIZE) -> DPWordHistogram:
    """Release a DP word histogram of ``data`` (see :mod:`keras_dp_lm.tokenizers`).

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

    Example:
        >>> lines = ["To be, or not to be."] * 100 + ["A secret only I wrote."]
        >>> histogram = dp_word_histogram(lines, noise_multiplier=1.0, delta=1e-6,
        ...                               max_words_per_example=8, seed=0)
        >>> sorted(histogram.counts)  # the one-off line's words did not survive
        [',', '.', 'be', 'not', 'or', 'to']
    """
    mechanism, batch_size, rng, counter = _start_release(
        delta=delta, max_words_per_example=max_words_per_example,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, max_count=max_count,
        threshold_delta_fraction=threshold_delta_fraction, seed=seed, batch_size=batch_size)
    for batch in _string_batches(data, batch_size):
        counter.add(*_pretokenize_batch(batch, lowercase, strip_accents, nfkc))
    return _release(counter, mechanism, rng)


def dp_word_histogram_from_words(examples: Iterable[Sequence[str]], *, delta: float,
                                 max_words_per_example: int, noise_multiplier: float | None = None,
                                 target_epsilon: float | None = None, max_count: int = 1,
                                 threshold_delta_fraction: float = 0.5, seed: int | None = None,
                                 batch_size: int = DEFAULT_BATCH_SIZE) -> DPWordHistogram:
    """Like :func:`dp_word_histogram` for examples already split into words.

    ``examples`` is an iterable of word sequences (one sequence per example);
    words are used as given (no lowercasing or splitting). The other arguments
    are :func:`dp_word_histogram`'s: ``delta``, ``max_words_per_example``, one of
    ``noise_multiplier`` and ``target_epsilon``, ``max_count``,
    ``threshold_delta_fraction``, ``seed`` (None: OS entropy, for real releases)
    and ``batch_size`` (examples counted together; memory only).

    Example:
        >>> examples = [["to", "be"]] * 100 + [["rare"]]
        >>> histogram = dp_word_histogram_from_words(
        ...     examples, noise_multiplier=1.0, delta=1e-6, max_words_per_example=2, seed=0)
        >>> sorted(histogram.counts), round(histogram.threshold, 2)
        (['be', 'to'], 8.11)
    """
    mechanism, batch_size, rng, counter = _start_release(
        delta=delta, max_words_per_example=max_words_per_example,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, max_count=max_count,
        threshold_delta_fraction=threshold_delta_fraction, seed=seed, batch_size=batch_size)
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
# What the learners read
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
