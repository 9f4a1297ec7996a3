"""A WordPiece vocabulary learned from a released DP word histogram."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers.histogram import _released_counts
from keras_dp_lm.tokenizers.histogram import _too_few_words_error

if TYPE_CHECKING:
    from keras_dp_lm.tokenizers.histogram import DPWordHistogram

WORDPIECE_RESERVED_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")


def learn_wordpiece_vocabulary(histogram: DPWordHistogram | Mapping[str, float],
                               vocabulary_size: int, *,
                               reserved_tokens: Sequence[str] = WORDPIECE_RESERVED_TOKENS,
                               suffix_indicator: str = "##", slack_ratio: float = 0.05,
                               **learner_kwargs: Any) -> list[str]:
    """WordPiece vocabulary from released counts via tensorflow_text's learner.

    Same learner and settings as ``keras_hub.tokenizers.compute_word_piece_vocabulary``
    (``include_joiner_token=True``; result truncated to ``vocabulary_size``), but fed
    from ``histogram``, a :class:`DPWordHistogram` or its ``{word: count}`` dict.
    ``reserved_tokens`` come first; ``suffix_indicator`` marks word-continuing
    pieces (``"##"``); ``learner_kwargs`` go to the learner. Raises ``ValueError``
    if the survivors cannot support ``(1 - slack_ratio) * vocabulary_size`` tokens.

    Example:
        >>> counts = {"to": 100, "be": 90, "or": 50, "not": 50}  # e.g. DPWordHistogram.counts
        >>> learn_wordpiece_vocabulary(counts, vocabulary_size=14)[5:]
        ['b', 'e', 'n', 'o', 'r', 't', 'to', '##b', '##e']
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
