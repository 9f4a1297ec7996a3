"""Extraction test: prompt with training prefixes, count verbatim continuations."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras_hub


@dataclasses.dataclass
class ExtractionResult:
    """Greedy-decoding extraction of training continuations.

    Attributes:
        num_examples: training texts tested (long enough, at most ``max_examples``).
        prefix_tokens: prompt length in tokens.
        suffix_tokens: target length in tokens.
        exact_match_rate: fraction of examples whose whole suffix was reproduced
            (NaN with no example).
        token_accuracy: fraction of suffix tokens right, position by position.
        examples: up to ``num_shown`` dicts with ``prefix``, ``true_suffix`` and
            ``generated_suffix`` texts.
    """

    num_examples: int
    prefix_tokens: int
    suffix_tokens: int
    exact_match_rate: float
    token_accuracy: float
    examples: list

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _token_lists(tokenizer, texts):
    out = tokenizer(list(texts))
    if hasattr(out, "to_list"):  # tf.RaggedTensor
        out = out.to_list()
    elif hasattr(out, "numpy"):  # dense tf.Tensor
        out = out.numpy()
    return [[int(i) for i in np.asarray(row).reshape(-1)] for row in out]


def extraction_test(causal_lm: keras_hub.models.CausalLM, training_texts: Sequence[str],
                    prefix_tokens: int = 8, suffix_tokens: int = 8, max_examples: int | None = None,
                    batch_size: int = 32, seed: int | None = 0,
                    num_shown: int = 5) -> ExtractionResult:
    """Prompt with training prefixes and check whether greedy decoding reproduces them.

    Every training text with at least ``prefix_tokens + suffix_tokens`` tokens gives one
    example: its first ``prefix_tokens`` tokens (after the start token, when the
    preprocessor adds one) are the prompt, the next ``suffix_tokens`` the target.
    Decoding is greedy (argmax of the model's logits), independent of the sampler
    the model was compiled with.

    Args:
        causal_lm: a KerasHub CausalLM with a preprocessor (its tokenizer splits
            the texts).
        training_texts: the texts it was trained on.
        prefix_tokens: prompt length in tokens (>= 1).
        suffix_tokens: tokens to decode and compare (>= 1).
        max_examples: test at most this many eligible texts, a random subset
            drawn with ``seed`` (None: all).
        batch_size: prompts decoded together.
        seed: NumPy seed of that subset.
        num_shown: how many decoded examples the result keeps.

    Returns:
        :class:`ExtractionResult` with the exact-match rate (whole suffix right) and
        the token accuracy (fraction of suffix tokens right, position by position),
        plus a few decoded examples.
    """
    from keras import ops

    preprocessor = causal_lm.preprocessor
    tokenizer = preprocessor.tokenizer
    p, s = int(prefix_tokens), int(suffix_tokens)
    if p < 1 or s < 1:
        raise ValueError("prefix_tokens and suffix_tokens must be >= 1")
    ids = [t[: p + s] for t in _token_lists(tokenizer, training_texts) if len(t) >= p + s]
    if max_examples is not None and len(ids) > max_examples:
        rng = np.random.default_rng(seed)
        keep = np.sort(rng.choice(len(ids), size=max_examples, replace=False))
        ids = [ids[i] for i in keep]
    if not ids:
        return ExtractionResult(0, p, s, float("nan"), float("nan"), [])
    ids = np.asarray(ids, dtype=np.int32)
    start = []
    if getattr(preprocessor, "add_start_token", False) and getattr(
            tokenizer, "start_token_id", None) is not None:
        start = [int(tokenizer.start_token_id)]
    offset = len(start) + p
    generated = []
    for b in range(0, len(ids), batch_size):
        chunk = ids[b:b + batch_size]
        n = len(chunk)
        buf = np.zeros((n, offset + s), dtype=np.int32)
        if start:
            buf[:, 0] = start[0]
        buf[:, len(start):offset] = chunk[:, :p]
        mask = np.ones_like(buf, dtype=bool)  # causal attention: later slots unseen
        for t in range(s):
            logits = causal_lm({"token_ids": buf, "padding_mask": mask}, training=False)
            nxt = ops.convert_to_numpy(ops.argmax(logits[:, offset + t - 1, :], axis=-1))
            buf[:, offset + t] = nxt
        generated.append(buf[:, offset:].copy())
    generated = np.concatenate(generated)
    target = ids[:, p:p + s]
    correct = generated == target
    examples = []
    for i in range(min(num_shown, len(ids))):
        examples.append({
            "prefix": _detok(tokenizer, ids[i, :p]),
            "true_suffix": _detok(tokenizer, target[i]),
            "generated_suffix": _detok(tokenizer, generated[i]),
        })
    return ExtractionResult(
        num_examples=int(len(ids)), prefix_tokens=p, suffix_tokens=s,
        exact_match_rate=float(np.mean(np.all(correct, axis=1))),
        token_accuracy=float(np.mean(correct)), examples=examples)


def _detok(tokenizer, ids):
    out = tokenizer.detokenize(np.asarray(ids, dtype=np.int32))
    if hasattr(out, "numpy"):
        out = out.numpy()
    if isinstance(out, np.ndarray):
        out = out.item() if out.ndim == 0 else out.tolist()
    if isinstance(out, bytes):
        out = out.decode("utf-8", errors="replace")
    return str(out)
