"""Log-likelihoods of texts under a KerasHub causal LM, the score every test uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import keras_hub


def sequence_log_likelihood(
        causal_lm: keras_hub.models.CausalLM, texts: str | Sequence[str], batch_size: int = 64,
        sequence_length: int | None = None,
        return_token_counts: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Log-likelihood (natural log, summed over tokens) of each text under a CausalLM.

    The model's own preprocessor tokenizes and packs the texts exactly as in training
    (start token as context, end token predicted), so the score is the negated
    training loss of the text times its number of predicted tokens. Texts longer than
    ``sequence_length`` (default: the preprocessor's) are truncated.
    ``causal_lm``: a KerasHub CausalLM with a preprocessor; ``batch_size``: texts per
    forward pass.

    Returns a float64 array (and the per-text number of scored tokens if
    ``return_token_counts``).
    """
    import keras
    from keras import ops

    preprocessor = getattr(causal_lm, "preprocessor", None)
    if preprocessor is None:
        raise ValueError("causal_lm has no preprocessor; pass a function that scores "
                         "texts instead")
    texts = [str(t) for t in texts]
    lls, counts = [], []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        x, y, sw = keras.utils.unpack_x_y_sample_weight(
            preprocessor(chunk, sequence_length=sequence_length))
        logits = causal_lm(x, training=False)
        logp = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        tok = ops.take_along_axis(logp, ops.expand_dims(ops.cast(y, "int32"), -1), axis=-1)
        tok = ops.squeeze(tok, -1)
        sw = ops.cast(sw, "float32")
        lls.append(ops.convert_to_numpy(ops.sum(tok * sw, axis=-1)).astype(np.float64))
        counts.append(ops.convert_to_numpy(ops.sum(sw, axis=-1)).astype(np.int64))
    ll = np.concatenate(lls) if lls else np.zeros([0])
    cnt = np.concatenate(counts) if counts else np.zeros([0], np.int64)
    return (ll, cnt) if return_token_counts else ll


def as_log_likelihood_fn(
        causal_lm_or_fn: keras_hub.models.CausalLM | Callable[[list[str]], np.ndarray],
        batch_size: int = 64,
        sequence_length: int | None = None) -> Callable[[list[str]], np.ndarray]:
    """A function ``texts -> np.ndarray of log-likelihoods``.

    ``causal_lm_or_fn``: a KerasHub CausalLM (scored with
    :func:`sequence_log_likelihood` in batches of ``batch_size`` texts, packed to
    ``sequence_length`` tokens, default the preprocessor's) or any callable already
    mapping a list of texts to log-likelihoods (natural log; the two numbers are
    then unused).
    """
    if getattr(causal_lm_or_fn, "preprocessor", None) is not None and hasattr(
            causal_lm_or_fn, "backbone"):
        lm = causal_lm_or_fn
        return lambda texts: sequence_log_likelihood(lm, texts, batch_size=batch_size,
                                                     sequence_length=sequence_length)
    if callable(causal_lm_or_fn):
        fn = causal_lm_or_fn
        return lambda texts: np.asarray(fn(list(texts)), dtype=np.float64).reshape(-1)
    raise TypeError("expected a KerasHub CausalLM or a function texts -> log-likelihoods")
