"""Offline builders for tiny KerasHub language models (tests, examples, demos).

Nothing here touches a model hub: tokenizers are trained on the spot from text (by default a little
public-domain Shakespeare, or a built-in paragraph when the corpus has not been fetched), and
models are randomly initialised.

- :func:`train_byte_level_bpe` learns a GPT-2 style byte-level BPE vocabulary
  and merge list that ``keras_hub.models.GPT2Tokenizer`` accepts.
- :func:`tiny_gpt2_causal_lm` / :func:`save_tiny_gpt2_preset` build (and save
  as a KerasHub preset) a tiny ``GPT2CausalLM``.
- :func:`train_sentencepiece` / :func:`tiny_llama_causal_lm` /
  :func:`save_tiny_llama_preset` do the same for a tiny ``LlamaCausalLM``.

Example:
    >>> import tempfile, keras_hub
    >>> from keras_dp_lm import testing
    >>> preset = tempfile.mkdtemp()
    >>> saved = testing.save_tiny_gpt2_preset(preset, vocabulary_size=300)
    >>> lm = keras_hub.models.GPT2CausalLM.from_preset(preset)
    >>> lm.backbone.vocabulary_size == saved.backbone.vocabulary_size
    True

Seeding: weights are initialised from ``seed`` inside a scope that saves and restores Python's
``random`` state and Keras's global seed generator, so building a tiny model never makes later
unseeded randomness (for example DP noise drawn with ``seed=None``) predictable.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import io
import random as _python_random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import regex

if TYPE_CHECKING:
    import keras
    import keras_hub

__all__ = [
    "DEFAULT_TEXT",
    "bytes_to_unicode",
    "default_texts",
    "train_byte_level_bpe",
    "train_sentencepiece",
    "gpt2_tokenizer",
    "llama_tokenizer",
    "tiny_gpt2_causal_lm",
    "tiny_llama_causal_lm",
    "save_tiny_gpt2_preset",
    "save_tiny_llama_preset",
    "text_passages",
    "fit_briefly",
]

# Built-in fallback text (public domain: Shakespeare, Sonnet 18 and Hamlet III.1).
DEFAULT_TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life.
"""

# GPT-2's pre-tokenisation pattern (openai/gpt-2 encoder.py).
_GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

_DEFAULT_PLAYS = ("hamlet", "macbeth", "romeo_and_juliet", "tempest")
_DEFAULT_CHARS = 400_000


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Returns a dict ``{byte_value (int): one-character str}``.
    """
    printable = (list(range(ord("!"), ord("~") + 1))
                 + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes)))


def _find_shakespeare():
    """Shakespeare texts from ./data or the repository's data folder, or None."""
    from keras_dp_lm import corpora

    candidates = [None, Path(__file__).resolve().parents[1] / "data"]
    for data_dir in candidates:
        try:
            return corpora.load_shakespeare_plays(data_dir)
        except (FileNotFoundError, OSError):
            continue
    return None


def default_texts(max_chars: int = _DEFAULT_CHARS) -> list[str]:
    """A list of public-domain texts for tiny models, found offline.

    A few Shakespeare plays (the first ``max_chars`` characters in all) when the
    corpus has been fetched (``make data``), else ``[DEFAULT_TEXT]``.
    """
    plays = _find_shakespeare()
    if not plays:
        return [DEFAULT_TEXT]
    names = [n for n in _DEFAULT_PLAYS if n in plays] or sorted(plays)
    texts, used = [], 0
    for name in names:
        if used >= max_chars:
            break
        text = plays[name][: max_chars - used]
        texts.append(text)
        used += len(text)
    return texts


def _as_texts(texts):
    if texts is None:
        return default_texts()
    if isinstance(texts, str):
        return [texts]
    texts = [str(t) for t in texts]
    if not texts or not any(texts):
        raise ValueError("`texts` must contain some non-empty text.")
    return texts


def train_byte_level_bpe(
        texts: str | Sequence[str], vocabulary_size: int,
        special_tokens: Sequence[str] = ("<|endoftext|>",)) -> tuple[dict[str, int], list[str]]:
    """Learn a GPT-2 style byte-level BPE tokenizer from ``texts``.

    Text is split with GPT-2's pre-tokenisation regex, each piece is encoded
    as UTF-8 and mapped to characters with GPT-2's byte-to-unicode table, and
    the most frequent adjacent pair is merged repeatedly (ties broken by the
    lexicographically smallest pair, so the result is deterministic).

    Args:
        texts: a string or an iterable of strings.
        vocabulary_size: total size wanted, including the 256 byte symbols and
            ``special_tokens``. Fewer entries are returned if the text runs out
            of pairs to merge.
        special_tokens: tokens appended at the end of the vocabulary (GPT-2
            puts ``<|endoftext|>`` last).

    Returns:
        ``(vocabulary, merges)``: a dict ``token -> id`` (ids ``0..n-1``: the
        256 byte symbols, then merged tokens in merge order, then the special
        tokens) and a list of ``"a b"`` merge rules, both accepted by
        ``keras_hub.models.GPT2Tokenizer(vocabulary=..., merges=...)``.
    """
    texts = _as_texts(texts)
    special_tokens = list(special_tokens or ())
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"Duplicate special tokens: {special_tokens}")
    base = 256 + len(special_tokens)
    if int(vocabulary_size) < base:
        raise ValueError(
            f"vocabulary_size={vocabulary_size} is too small: a byte-level BPE "
            f"vocabulary holds the 256 byte symbols and {len(special_tokens)} "
            f"special token(s), so it needs at least {base}.")
    num_merges = int(vocabulary_size) - base
    byte_map = bytes_to_unicode()

    word_counts = collections.Counter()
    for text in texts:
        word_counts.update(_GPT2_SPLIT.findall(text))
    words = []   # list of [symbols (list), count]
    for word, count in word_counts.items():
        symbols = [byte_map[b] for b in word.encode("utf-8")]
        words.append([symbols, count])

    pair_counts = collections.defaultdict(int)
    pair_words = collections.defaultdict(set)
    for index, (symbols, count) in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += count
            pair_words[pair].add(index)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    vocab_tokens = [byte_map[b] for b in range(256)]
    known = set(vocab_tokens) | set(special_tokens)
    merges = []
    while len(merges) < num_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count <= 0:
            continue
        if -neg_count != count:          # stale entry: re-push the true count
            heapq.heappush(heap, (-count, pair))
            continue
        first, second = pair
        merged = first + second
        merges.append(f"{first} {second}")
        if merged not in known:
            known.add(merged)
            vocab_tokens.append(merged)
        changed = collections.defaultdict(int)
        for index in pair_words.pop(pair, ()):
            symbols, wcount = words[index]
            # Remove this word's old pairs, rewrite it, add its new pairs.
            for p in zip(symbols, symbols[1:]):
                changed[p] -= wcount
            out, i = [], 0
            while i < len(symbols):
                if (i + 1 < len(symbols) and symbols[i] == first
                        and symbols[i + 1] == second):
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            words[index][0] = out
            for p in zip(out, out[1:]):
                changed[p] += wcount
                pair_words[p].add(index)
        pair_counts.pop(pair, None)
        for p, delta in changed.items():
            if p == pair or delta == 0:
                continue
            pair_counts[p] += delta
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                pair_counts.pop(p, None)

    for token in special_tokens:
        if token not in vocab_tokens:
            vocab_tokens.append(token)
    vocabulary = {token: i for i, token in enumerate(vocab_tokens)}
    return vocabulary, merges


def train_sentencepiece(texts: str | Sequence[str], vocabulary_size: int,
                        model_type: str = "unigram", seed: int = 0) -> bytes:
    """Train a SentencePiece model in memory; returns the serialized proto bytes.

    Ids 0/1/2 are ``<unk>``/``<s>``/``</s>`` (what ``LlamaTokenizer`` expects). Byte fallback is on
    and normalisation is off (``identity``, whitespace kept), so any text not starting with a space
    round-trips exactly. Lines of ``texts`` are the training sentences. ``vocabulary_size`` must be
    attainable from the text (SentencePiece raises otherwise; ``hard_vocab_limit=False`` lets it
    return fewer pieces). ``model_type``: SentencePiece's, ``"unigram"`` (default) or ``"bpe"``;
    ``seed`` seeds its random generator (if the library has one).
    """
    import sentencepiece as spm

    texts = _as_texts(texts)
    sentences = [line.strip() for text in texts for line in text.splitlines()]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise ValueError("`texts` must contain some non-empty lines.")
    if int(vocabulary_size) < 300:
        raise ValueError(
            f"vocabulary_size={vocabulary_size} is too small: with byte fallback "
            "a SentencePiece vocabulary holds 3 control pieces and 256 byte "
            "pieces, so ask for at least 300.")
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(int(seed))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=int(vocabulary_size),
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def gpt2_tokenizer(texts: str | Sequence[str] | None = None, vocabulary_size: int = 512,
                   sequence_length: int | None = None) -> keras_hub.models.GPT2Tokenizer:
    """A ``keras_hub.models.GPT2Tokenizer`` trained with :func:`train_byte_level_bpe`
    on ``texts`` (default :func:`default_texts`), at most ``vocabulary_size``
    tokens; ``sequence_length`` pads/trims its output (None: ragged)."""
    import keras_hub

    vocabulary, merges = train_byte_level_bpe(_as_texts(texts), vocabulary_size)
    return keras_hub.models.GPT2Tokenizer(
        vocabulary=vocabulary, merges=merges, sequence_length=sequence_length)


def llama_tokenizer(texts: str | Sequence[str] | None = None, vocabulary_size: int = 512,
                    seed: int = 0) -> keras_hub.models.LlamaTokenizer:
    """A ``keras_hub.models.LlamaTokenizer`` trained with :func:`train_sentencepiece`
    (unigram, ``seed``) on ``texts`` (default :func:`default_texts`), at most
    ``vocabulary_size`` pieces (>= 300)."""
    import keras_hub

    proto = train_sentencepiece(_as_texts(texts), vocabulary_size, seed=seed)
    return keras_hub.models.LlamaTokenizer(proto=proto)


@contextlib.contextmanager
def _scoped_seed(seed):
    """Make Keras weight initialisation depend on ``seed`` only, then restore.

    Keras initialisers created without a seed draw one from Python's
    ``random``; layers without one use Keras's global ``SeedGenerator``.
    Both are restored on exit so callers' unseeded randomness is untouched.
    """
    import keras
    from keras_dp_lm import _keras_internals as keras_internals

    state = _python_random.getstate()
    previous = keras_internals.global_seed_generator()
    _python_random.seed(int(seed))
    keras_internals.set_global_seed_generator(keras.random.SeedGenerator(int(seed)))
    try:
        yield
    finally:
        _python_random.setstate(state)
        keras_internals.set_global_seed_generator(previous)


def tiny_gpt2_causal_lm(texts: str | Sequence[str] | None = None, vocabulary_size: int = 512,
                        num_layers: int = 2, hidden_dim: int = 32, num_heads: int = 2,
                        intermediate_dim: int = 64, sequence_length: int = 32,
                        max_sequence_length: int | None = None, dropout: float = 0.0,
                        seed: int = 0) -> keras_hub.models.GPT2CausalLM:
    """A randomly initialised tiny ``keras_hub.models.GPT2CausalLM``, built offline.

    The tokenizer is a byte-level BPE trained on ``texts`` (default: :func:`default_texts`); the
    backbone's vocabulary size is the tokenizer's (at most ``vocabulary_size``).
    ``sequence_length`` is the preprocessor's; ``max_sequence_length`` (default
    ``max(sequence_length, 128)``) bounds the position embedding, so ``generate(max_length=...)``
    may go up to it. ``num_layers`` blocks of width ``hidden_dim``, ``num_heads`` attention heads,
    feed-forward width ``intermediate_dim``, ``dropout`` rate (0: deterministic). Weights depend
    only on ``seed``. The model is not compiled.
    """
    import keras_hub

    tokenizer = gpt2_tokenizer(texts, vocabulary_size)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=sequence_length)
    if max_sequence_length is None:
        max_sequence_length = max(int(sequence_length), 128)
    with _scoped_seed(seed):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=tokenizer.vocabulary_size(),
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            dropout=dropout,
            max_sequence_length=max_sequence_length,
        )
        causal_lm = keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=preprocessor)
    return causal_lm


def tiny_llama_causal_lm(texts: str | Sequence[str] | None = None, vocabulary_size: int = 512,
                         num_layers: int = 2, hidden_dim: int = 32, num_query_heads: int = 2,
                         num_key_value_heads: int = 1, intermediate_dim: int = 64,
                         sequence_length: int = 32, dropout: float = 0.0,
                         seed: int = 0) -> keras_hub.models.LlamaCausalLM:
    """A randomly initialised tiny ``keras_hub.models.LlamaCausalLM``, built offline.

    The tokenizer is a SentencePiece unigram model (byte fallback on) trained in memory on
    ``texts`` (default: :func:`default_texts`). Llama uses rotary position embeddings, so
    ``generate(max_length=...)`` has no fixed cap. At most ``vocabulary_size`` pieces (>= 300);
    ``sequence_length`` is the preprocessor's; ``num_layers`` blocks of width ``hidden_dim``,
    ``num_query_heads`` query and ``num_key_value_heads`` key/value heads, feed-forward width
    ``intermediate_dim``, ``dropout`` rate (0: deterministic). Weights depend only on ``seed``. The
    model is not compiled.
    """
    import keras_hub

    tokenizer = llama_tokenizer(texts, vocabulary_size, seed=seed)
    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=sequence_length)
    with _scoped_seed(seed):
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(),
            num_layers=num_layers,
            num_query_heads=num_query_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            num_key_value_heads=num_key_value_heads,
            dropout=dropout,
        )
        causal_lm = keras_hub.models.LlamaCausalLM(
            backbone=backbone, preprocessor=preprocessor)
    return causal_lm


def save_tiny_gpt2_preset(directory: str | Path, **kwargs: Any) -> keras_hub.models.GPT2CausalLM:
    """Build :func:`tiny_gpt2_causal_lm` (``**kwargs``) and save it as a preset.

    ``keras_hub.models.GPT2CausalLM.from_preset(directory)`` reloads it offline. Returns the model
    that was saved.
    """
    causal_lm = tiny_gpt2_causal_lm(**kwargs)
    causal_lm.save_to_preset(str(directory))
    return causal_lm


def save_tiny_llama_preset(directory: str | Path, **kwargs: Any) -> keras_hub.models.LlamaCausalLM:
    """Build :func:`tiny_llama_causal_lm` (``**kwargs``) and save it as a preset.

    ``keras_hub.models.LlamaCausalLM.from_preset(directory)`` reloads it offline. Returns the model
    that was saved.
    """
    causal_lm = tiny_llama_causal_lm(**kwargs)
    causal_lm.save_to_preset(str(directory))
    return causal_lm


def text_passages(texts: str | Sequence[str], passage_chars: int = 256) -> list[str]:
    """Cut texts into consecutive passages of about ``passage_chars`` characters
    (at line boundaries where possible); empty passages are dropped."""
    passages = []
    for text in _as_texts(texts):
        current = ""
        for line in text.splitlines(keepends=True):
            if current and len(current) + len(line) > passage_chars:
                passages.append(current)
                current = ""
            current += line
            while len(current) > passage_chars:
                passages.append(current[:passage_chars])
                current = current[passage_chars:]
        if current.strip():
            passages.append(current)
    return [p for p in passages if p.strip()]


def fit_briefly(causal_lm: keras_hub.models.CausalLM, texts: str | Sequence[str] | None = None,
                steps: int = 200, batch_size: int = 16, learning_rate: float = 1e-3,
                passage_chars: int | None = None, seed: int = 0,
                verbose: int = 0) -> keras.callbacks.History:
    """Train ``causal_lm`` (non-privately) for ``steps`` steps on passages of ``texts``.

    For tests, examples and demos that need a model that is better than
    random. Compiles the model with Adam (``jit_compile=True``); recompile
    afterwards to install a sampler or a DP optimizer. Returns the Keras
    ``History``. ``texts`` default: :func:`default_texts`; passages of
    ``passage_chars`` characters (default 4 x the preprocessor's sequence length),
    shuffled with ``seed``, ``batch_size`` per step; Adam's ``learning_rate``;
    ``verbose`` as ``fit``'s.
    """
    import keras
    import tensorflow as tf

    if passage_chars is None:
        passage_chars = 4 * int(causal_lm.preprocessor.sequence_length)
    passages = text_passages(texts, passage_chars)
    ds = (tf.data.Dataset.from_tensor_slices(passages)
          .shuffle(len(passages), seed=seed, reshuffle_each_iteration=True)
          .repeat()
          .batch(batch_size, drop_remainder=True))
    causal_lm.compile(optimizer=keras.optimizers.Adam(learning_rate), jit_compile=True)
    return causal_lm.fit(ds, steps_per_epoch=int(steps), epochs=1, verbose=verbose)
