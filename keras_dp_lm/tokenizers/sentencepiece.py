"""A SentencePiece model learned from a released DP word histogram."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keras_dp_lm.tokenizers._arguments import _check_int
from keras_dp_lm.tokenizers.histogram import _released_counts
from keras_dp_lm.tokenizers.histogram import _too_few_words_error

if TYPE_CHECKING:
    from keras_dp_lm.tokenizers.histogram import DPWordHistogram

SENTENCEPIECE_RESERVED_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")


def learn_sentencepiece_proto(histogram: DPWordHistogram | Mapping[str, float],
                              vocabulary_size: int, *, model_type: str = "unigram",
                              reserved_tokens: Sequence[str] = SENTENCEPIECE_RESERVED_TOKENS,
                              lowercase: bool = True, **trainer_kwargs: Any) -> bytes:
    """SentencePiece model proto (bytes) from released counts (``input_format="tsv"``).

    ``histogram``: a :class:`DPWordHistogram` or its ``{word: count}`` dict (counts
    rounded, at least 1); ``vocabulary_size``: the pieces to learn;
    ``model_type``: ``"unigram"`` (default) or ``"bpe"``; ``trainer_kwargs`` go to
    ``SentencePieceTrainer.train``. Each released word becomes one
    ``word<TAB>count`` row. ``reserved_tokens[:4]``
    are the pad, unk, bos and eos pieces (ids 0-3); further reserved tokens are
    user-defined symbols. ``lowercase=True`` stores the ``nmt_nfkc_cf``
    normalizer (NFKC + case folding at encoding time), else ``nmt_nfkc``.

    Example:
        >>> import sentencepiece as spm
        >>> counts = {"to": 100, "be": 90, "or": 50, "not": 50, "the": 40, "question": 30}
        >>> proto = learn_sentencepiece_proto(counts, vocabulary_size=16)
        >>> spm.SentencePieceProcessor(model_proto=proto).encode("To be", out_type=str)
        ['▁', 't', 'o', '▁', 'b', 'e']
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
