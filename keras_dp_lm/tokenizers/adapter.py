"""``DPVocabularyAdapter``: a Keras layer that learns a DP vocabulary and tokenizes with it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers._arguments import _check_seed
from keras_dp_lm.tokenizers.events import HistogramMechanism
from keras_dp_lm.tokenizers.events import VocabularyDpEvent
from keras_dp_lm.tokenizers.histogram import DEFAULT_BATCH_SIZE
from keras_dp_lm.tokenizers.histogram import dp_word_histogram
from keras_dp_lm.tokenizers.sentencepiece import SENTENCEPIECE_RESERVED_TOKENS
from keras_dp_lm.tokenizers.sentencepiece import learn_sentencepiece_proto
from keras_dp_lm.tokenizers.wordpiece import WORDPIECE_RESERVED_TOKENS
from keras_dp_lm.tokenizers.wordpiece import learn_wordpiece_vocabulary

if TYPE_CHECKING:
    import os

    import keras_hub
    import tensorflow as tf

ALGORITHMS = ("wordpiece", "sentencepiece_unigram", "sentencepiece_bpe")


_VOCAB_ASSET = "vocabulary.txt"
_PROTO_ASSET = "sentencepiece.model"
_META_ASSET = "dp_vocabulary.json"


class _TokenizerHolder:
    """Holds the layer's KerasHub tokenizer out of sight of Keras tracking/saving."""

    tokenizer = None


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPVocabularyAdapter(keras.layers.Layer):
    """A DP vocabulary learner and tokenizer, in the style of ``TextVectorization``.

    ``adapt(data)`` releases a DP word histogram of ``data`` (see
    :mod:`keras_dp_lm.tokenizers`) and learns a WordPiece or SentencePiece
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
        >>> import keras_dp_lm
        >>> lines = ["To be, or not to be.", "That is the question."] * 200
        >>> adapter = keras_dp_lm.tokenizers.DPVocabularyAdapter(
        ...     vocabulary_size=32, target_epsilon=4.0, delta=1e-6,
        ...     max_words_per_example=8, sequence_length=6, seed=0)
        >>> adapter.adapt(lines)                  # list / tf.data.Dataset of strings
        >>> adapter.epsilon <= 4.0, adapter.num_releases
        (True, 1)
        >>> accountant = keras_dp_lm.PrivacyAccountant(  # composed with training
        ...     delta=1e-5, dataset_size=len(lines), extra_events=[adapter.dp_event()])
        >>> tuple(adapter(["To be, or not"]).shape)  # [1, sequence_length] int32
        (1, 6)
        >>> type(adapter.tokenizer()).__name__
        'WordPieceTokenizer'

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

    def __init__(self, vocabulary_size: int, algorithm: str = "wordpiece", *,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 delta: float | None = None, max_words_per_example: int = 16, max_count: int = 1,
                 threshold_delta_fraction: float = 0.5, seed: int | None = None,
                 reserved_tokens: Sequence[str] | None = None, oov_token: str | None = None,
                 lowercase: bool = True, strip_accents: bool = False,
                 sequence_length: int | None = None, **kwargs: Any) -> None:
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
    def mechanism(self) -> HistogramMechanism:
        return self._mechanism

    @property
    def num_releases(self) -> int:
        """How many noised histograms this layer has released (``adapt`` calls)."""
        return len(self._releases)

    def _accounted_releases(self):
        # Before the first adapt: the release it will make (planning).
        return list(self._releases) or [self._mechanism]

    @property
    def epsilon(self) -> float:
        """Total epsilon of every release (sum; one release before the first adapt)."""
        return math.fsum(m.epsilon for m in self._accounted_releases())

    @property
    def delta(self) -> float:
        """Total delta of every release (sum; one release before the first adapt)."""
        return math.fsum(m.delta for m in self._accounted_releases())

    @property
    def noise_multiplier(self) -> float:
        return self._mechanism.noise_multiplier

    @property
    def threshold(self) -> float:
        return self._mechanism.threshold

    def dp_event(self) -> VocabularyDpEvent:
        """A :class:`VocabularyDpEvent` composing every release (the planned one
        before the first ``adapt``): a ``dp_accounting.DpEvent`` for
        ``PrivacyAccountant(extra_events=[...])`` / ``compose_epsilon``."""
        return VocabularyDpEvent.compose(m.dp_event() for m in self._accounted_releases())

    def privacy_report(self) -> dict[str, Any]:
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
    def is_adapted(self) -> bool:
        return self._vocabulary is not None

    def adapt(self, data: tf.data.Dataset | Iterable[str | Path],
              batch_size: int | None = None) -> None:
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

    def get_vocabulary(self) -> list[str]:
        """The learned tokens, id order (reserved tokens first)."""
        self._check_adapted()
        return list(self._vocabulary)

    def vocabulary_size(self) -> int:
        """Learned vocabulary length (WordPiece may be up to 5% under the target)."""
        self._check_adapted()
        return len(self._vocabulary)

    def get_proto(self) -> bytes:
        """SentencePiece model proto bytes (SentencePiece algorithms only)."""
        self._check_adapted()
        if self._proto is None:
            raise ValueError("`get_proto()` is only defined for the SentencePiece algorithms.")
        return self._proto

    def save_vocabulary(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """Write ``vocabulary.txt`` (one token a line) or the ``.model`` proto to ``path``."""
        self._check_adapted()
        if self._proto is not None:
            Path(path).write_bytes(self._proto)
        else:
            Path(path).write_text("".join(t + "\n" for t in self._vocabulary),
                                  encoding="utf-8")
        return path

    def tokenizer(self) -> keras_hub.tokenizers.Tokenizer:
        """The KerasHub tokenizer for the learned vocabulary."""
        self._check_adapted()
        return self._holder.tokenizer

    def call(self, inputs: str | Sequence[str] | tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
        self._check_adapted()
        return self._holder.tokenizer(inputs)

    def compute_output_spec(self, inputs: keras.KerasTensor) -> keras.KerasTensor:
        # Known without a vocabulary, so models rebuild before assets are loaded.
        shape = tuple(inputs.shape) + (self.sequence_length,)
        return keras.KerasTensor(shape, dtype="int32",
                                 ragged=self.sequence_length is None and len(shape) > 1)

    # --- serialization ----------------------------------------------------
    def get_config(self) -> dict[str, Any]:
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
    def from_config(cls, config: dict[str, Any]) -> DPVocabularyAdapter:
        config = dict(config)
        releases = config.pop("dp_releases", [])
        layer = cls(**config)
        layer._restore_releases(releases)
        return layer

    def save_assets(self, dir_path: str) -> None:
        if not self.is_adapted:
            return
        if self._proto is not None:
            Path(dir_path, _PROTO_ASSET).write_bytes(self._proto)
        else:
            Path(dir_path, _VOCAB_ASSET).write_text(
                "".join(t + "\n" for t in self._vocabulary), encoding="utf-8")
        Path(dir_path, _META_ASSET).write_text(json.dumps(self.privacy_report(), indent=1))

    def load_assets(self, dir_path: str) -> None:
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
