"""Perplexity of held-out text under the DP sampler's mixture (a utility measure)."""

import math

import numpy as np
from keras import ops

from keras_dp_lm.samplers.epsilon import vocabulary_size_of


def mixture_perplexity(causal_lm, texts, lambdas, temperature=1.0, sequence_length=None,
                       batch_size=8, max_tokens=None):
    """Perplexity of held-out ``texts`` under ``q' = lambda_*q + (1-lambda_)*u``.

    Each text is tokenized whole (no start/end tokens), cut into windows of
    ``sequence_length`` tokens (default: the preprocessor's), and every token
    after the first of a window is scored given the tokens before it in that
    window. Logits are computed once; every ``lambda_`` reuses them.

    Args:
        causal_lm: a KerasHub ``CausalLM`` with a preprocessor.
        texts: a string or a list of strings.
        lambdas: iterable of mixture weights in ``[0, 1]`` (1 = the model alone).
        temperature: divides the logits before the softmax, as in DPSampler.
        max_tokens: optional cap on the number of tokens read (from the start).

    Returns:
        ``{lambda_: perplexity}`` (floats), in the order given. ``lambda_ = 0``
        gives exactly ``|V|``.

    Example:
        >>> from keras_dp_lm import testing
        >>> causal_lm = testing.tiny_gpt2_causal_lm(["To be, or not to be."],
        ...                                         vocabulary_size=300)
        >>> perplexity = mixture_perplexity(causal_lm, "To be, or not to be", [0.0, 0.5])
        >>> round(perplexity[0.0])  # the uniform distribution: |V|
        267
    """
    lambdas = [float(l) for l in lambdas]
    for l in lambdas:
        if not (0.0 <= l <= 1.0):
            raise ValueError(f"lambdas must be in [0, 1]. Received: {l!r}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"`temperature` must be a finite number > 0. Received: {temperature!r}")
    preprocessor = causal_lm.preprocessor
    if preprocessor is None:
        raise ValueError("mixture_perplexity needs a CausalLM with a preprocessor.")
    tokenizer = preprocessor.tokenizer
    window = int(sequence_length or preprocessor.sequence_length)
    if window < 2:
        raise ValueError("sequence_length must be >= 2.")
    if isinstance(texts, str):
        texts = [texts]
    windows = []
    used = 0
    for text in texts:
        ids = np.asarray(ops.convert_to_numpy(tokenizer(text))).astype(np.int64).ravel()
        if max_tokens is not None:
            ids = ids[: max(int(max_tokens) - used, 0)]
        used += len(ids)
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) >= 2:
                windows.append(chunk)
    if not windows:
        raise ValueError("The texts hold fewer than 2 tokens: nothing to score.")

    vocabulary_size = vocabulary_size_of(causal_lm)
    log_uniform = -math.log(vocabulary_size)
    nll = {l: 0.0 for l in lambdas}
    count = 0
    for b in range(0, len(windows), int(batch_size)):
        batch = windows[b:b + int(batch_size)]
        token_ids = np.zeros((len(batch), window), dtype="int32")
        padding_mask = np.zeros((len(batch), window), dtype=bool)
        for i, chunk in enumerate(batch):
            token_ids[i, :len(chunk)] = chunk
            padding_mask[i, :len(chunk)] = True
        logits = causal_lm({"token_ids": token_ids, "padding_mask": padding_mask},
                           training=False)
        logits = np.asarray(ops.convert_to_numpy(logits), dtype=np.float64)
        logits = logits[:, :-1, :] / float(temperature)
        targets = token_ids[:, 1:]
        weights = padding_mask[:, 1:]
        # log q(target) = logit[target] - logsumexp(logits)
        top = logits.max(axis=-1, keepdims=True)
        log_z = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
        log_q = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
        log_q = log_q[weights]
        count += int(weights.sum())
        for l in lambdas:
            if l == 0.0:
                log_mix = np.full_like(log_q, log_uniform)
            elif l == 1.0:
                log_mix = log_q
            else:
                log_mix = np.logaddexp(math.log(l) + log_q, math.log1p(-l) + log_uniform)
            nll[l] -= float(log_mix.sum())
    return {l: math.exp(nll[l] / count) for l in lambdas}
