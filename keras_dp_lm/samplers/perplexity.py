"""Perplexity of held-out text under private decoders' distributions (a utility measure).

- :func:`mixture_perplexity`: ``DPSampler``'s uniform mixture ``lambda*q + (1-lambda)*u``.
- :func:`public_mixture_perplexity`: :class:`PublicMixtureSampler`'s distribution, the
  public model's next-token distribution with the private ones projected onto a Rényi ball.

Both are teacher-forced (each token scored given the true tokens before it: exactly
the distribution the sampler would draw that token from after that prefix). Given the
same ``packing`` they score the same tokens, so their numbers compare directly.
``packing="preprocessor"`` packs each text like training and ``generate`` do (start
token first); ``"windows"`` (``mixture_perplexity``'s default) feeds raw token windows
without a start token, which models trained with one find harder.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from keras import ops

from keras_dp_lm.samplers.epsilon import vocabulary_size_of

if TYPE_CHECKING:
    import keras_hub


PACKINGS = ("windows", "preprocessor")


def _scored_batches(causal_lm, texts, packing, sequence_length, batch_size, max_tokens,
                    name):
    """Yield ``(inputs, targets [b, t], weights [b, t] bool, drop_last)``: the model's
    logits at input positions ``[:, :t]`` (all but the last if ``drop_last``) predict
    ``targets``. Every batch has the same ``t``.

    ``"windows"``: each text tokenized whole (no start/end tokens), cut into windows of
    ``sequence_length`` (default: the preprocessor's); a window's first token is context.
    ``"preprocessor"``: each text packed by the model's preprocessor as in training
    (start token as context, end token predicted, truncated to ``sequence_length``).
    """
    if packing not in PACKINGS:
        raise ValueError(f"`packing` must be one of {PACKINGS}. Received: {packing!r}")
    preprocessor = getattr(causal_lm, "preprocessor", None)
    if preprocessor is None:
        raise ValueError(f"{name} needs a CausalLM with a preprocessor (its tokenizer "
                         "encodes the texts).")
    window = int(sequence_length or preprocessor.sequence_length)
    if window < 2:
        raise ValueError("sequence_length must be >= 2.")
    if isinstance(texts, str):
        texts = [texts]
    texts = [str(t) for t in texts]
    batch_size = int(batch_size)
    if packing == "preprocessor":
        import keras

        if max_tokens is not None:
            raise ValueError("`max_tokens` applies to packing='windows' only.")
        if not texts:
            raise ValueError("No texts to score.")
        for b in range(0, len(texts), batch_size):
            x, y, sw = keras.utils.unpack_x_y_sample_weight(
                preprocessor(texts[b:b + batch_size], sequence_length=window))
            inputs = {k: ops.convert_to_numpy(v) for k, v in x.items()}
            yield (inputs, np.asarray(ops.convert_to_numpy(y)).astype("int32"),
                   np.asarray(ops.convert_to_numpy(sw)) > 0, False)
        return
    tokenizer = preprocessor.tokenizer
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
    for b in range(0, len(windows), batch_size):
        batch = windows[b:b + batch_size]
        token_ids = np.zeros((len(batch), window), dtype="int32")
        padding_mask = np.zeros((len(batch), window), dtype=bool)
        for i, chunk in enumerate(batch):
            token_ids[i, :len(chunk)] = chunk
            padding_mask[i, :len(chunk)] = True
        yield ({"token_ids": token_ids, "padding_mask": padding_mask},
               token_ids[:, 1:], padding_mask[:, 1:], True)


def _logits(causal_lm, inputs, drop_last):
    """float64 next-token logits ``[b, t, V]``."""
    logits = np.asarray(ops.convert_to_numpy(causal_lm(inputs, training=False)),
                        dtype=np.float64)
    return logits[:, :-1, :] if drop_last else logits


def _flat_rows(logits, pad):
    """``[b, t, V]`` -> ``[b*t + pad, V]`` (zero rows appended: scored, then dropped)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return np.pad(flat, ((0, pad), (0, 0))) if pad else flat


def _mixture_scorer(sampler, with_lambda):
    """``(public [rows, V], private [N, rows, V], target [rows]) -> (log q(target), lam)``
    with the sampler's own :meth:`mixture_probabilities` / :meth:`projection_weights`,
    compiled with XLA on TensorFlow (float64 throughout, as in ``generate``)."""

    def score(public_logits, private_logits, target):
        q = sampler.mixture_probabilities(public_logits, private_logits)
        q_target = ops.take_along_axis(q, ops.cast(target, "int32")[:, None], axis=-1)
        lam = (sampler.projection_weights(public_logits, private_logits) if with_lambda
               else ops.zeros((1,), "float64"))
        return ops.log(ops.squeeze(q_target, -1)), lam

    import keras

    if keras.config.backend() == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(score, jit_compile=True, reduce_retracing=True,
                               autograph=False)
    else:
        compiled = score

    def run(public_logits, private_logits, target):
        log_q, lam = compiled(public_logits, private_logits, target)
        return ops.convert_to_numpy(log_q), ops.convert_to_numpy(lam)

    return run


def mixture_perplexity(causal_lm: keras_hub.models.CausalLM, texts: str | Sequence[str],
                       lambdas: Iterable[float], temperature: float = 1.0,
                       sequence_length: int | None = None, batch_size: int = 8,
                       max_tokens: int | None = None,
                       packing: str = "windows") -> dict[float, float]:
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
        sequence_length: window (or packed) length in tokens; default the
            preprocessor's.
        batch_size: windows per forward pass (memory only; 8 by default).
        max_tokens: optional cap on the number of tokens read (from the start).
        packing: ``"windows"`` (default, as above) or ``"preprocessor"``: each text
            packed by the model's preprocessor as in training and generation (start
            token as context, end token predicted, truncated to ``sequence_length``):
            the tokens :func:`keras_dp_lm.evaluation.sequence_log_likelihood` scores.

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
    vocabulary_size = vocabulary_size_of(causal_lm)
    log_uniform = -math.log(vocabulary_size)
    nll = {l: 0.0 for l in lambdas}
    count = 0
    for inputs, targets, weights, drop_last in _scored_batches(
            causal_lm, texts, packing, sequence_length, batch_size, max_tokens,
            "mixture_perplexity"):
        logits = _logits(causal_lm, inputs, drop_last) / float(temperature)
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


def public_mixture_perplexity(
        public_lm: keras_hub.models.CausalLM, private_lms: Sequence[keras_hub.models.CausalLM],
        texts: str | Sequence[str], balls: Iterable[tuple[float, float]],
        public_floor: float = 1e-3, temperature: float = 1.0, sequence_length: int | None = None,
        batch_size: int = 8, max_tokens: int | None = None, packing: str = "preprocessor",
        return_mean_lambda: bool = False,
) -> (dict[tuple[float, float], float]
      | tuple[dict[tuple[float, float], float], dict[tuple[float, float], float]]):
    """Held-out perplexity of ``texts`` under :class:`PublicMixtureSampler`'s distribution.

    For each ``(alpha, beta)`` in ``balls`` a ``PublicMixtureSampler(private_lms,
    beta=beta, alpha=alpha, public_model=public_lm, public_floor=..., temperature=...)``
    is built, and every token is scored under its
    :meth:`~PublicMixtureSampler.mixture_probabilities` given the true tokens before it
    (teacher forcing): exactly the distribution ``generate`` draws that token from
    after that prefix (integer weights, float64 projection, the same bisection).
    By default each text is packed by the public model's preprocessor as in training
    and ``generate`` (start token as context, end token predicted, truncated to
    ``sequence_length``); ``packing="windows"`` cuts long texts into windows as
    :func:`mixture_perplexity` does by default. With the same ``packing`` the two
    score the same tokens and compare directly:
    ``mixture_perplexity(public_lm, texts, [1.0], packing=...)`` is the public model
    alone. Logits are computed once; every ball reuses them.

    Args:
        public_lm: the public KerasHub ``CausalLM`` (its preprocessor tokenizes).
        private_lms: list of ``N >= 1`` private causal LMs sharing its vocabulary.
        texts: a string or a list of strings (held-out private-domain text).
        balls: iterable of ``(alpha, beta)`` pairs, e.g. from :func:`ball_for_epsilon`.
        public_floor, temperature: as in :class:`PublicMixtureSampler`.
        sequence_length, batch_size, max_tokens, packing: as in
            :func:`mixture_perplexity` (but ``packing`` defaults to ``"preprocessor"``).
        return_mean_lambda: also return ``{(alpha, beta): mean lam}``, the average
            weight the projection left on the private models (over tokens and models;
            0 is the public model alone, 1 the private ones unchanged).

    Returns:
        ``{(alpha, beta): perplexity}`` in the order given (and the mean-lambda dict).

    Example (tiny random GPT-2s stand in for the public and the private model):
        >>> from keras_dp_lm import testing
        >>> def tiny(seed):
        ...     return testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT],
        ...                                        vocabulary_size=270, seed=seed)
        >>> public, private = tiny(0), tiny(1)
        >>> text = "To be, or not to be, that is the question"
        >>> ppl, lam = public_mixture_perplexity(public, [private], text,
        ...                                      [(8.0, 1e-9), (8.0, 1e3)],
        ...                                      public_floor=0.0, return_mean_lambda=True)
        >>> alone = mixture_perplexity(public, text, [1.0], packing="preprocessor")[1.0]
        >>> private_alone = mixture_perplexity(private, text, [1.0],
        ...                                    packing="preprocessor")[1.0]
        >>> round(ppl[(8.0, 1e-9)], 2), round(alone, 2)     # a tiny ball: the public model
        (275.2, 275.2)
        >>> round(ppl[(8.0, 1e3)], 2), round(private_alone, 2), lam[(8.0, 1e3)]  # a huge one
        (272.47, 272.47, 1.0)
    """
    from keras_dp_lm.samplers.public_mixture import PublicMixtureSampler

    if isinstance(private_lms, (list, tuple)):
        private_lms = list(private_lms)
    else:
        raise ValueError("`private_lms` must be a list of causal LMs (one per shard). "
                         f"Received: {private_lms!r}")
    balls = [(float(a), float(b)) for a, b in balls]
    if not balls:
        raise ValueError("`balls` must hold at least one (alpha, beta) pair.")
    samplers = {ball: PublicMixtureSampler(private_lms, beta=ball[1], alpha=ball[0],
                                           public_model=public_lm,
                                           public_floor=public_floor,
                                           temperature=temperature, seed=0)
                for ball in balls}
    scorers = {ball: _mixture_scorer(sampler, return_mean_lambda)
               for ball, sampler in samplers.items()}
    nll = {ball: 0.0 for ball in balls}
    lam_sum = {ball: 0.0 for ball in balls}
    count = 0
    for inputs, targets, weights, drop_last in _scored_batches(
            public_lm, texts, packing, sequence_length, batch_size, max_tokens,
            "public_mixture_perplexity"):
        rows = int(batch_size) * targets.shape[1]   # one fixed shape: traced once per ball
        real = weights.reshape(-1)
        pad = rows - real.size
        z0 = _flat_rows(_logits(public_lm, inputs, drop_last), pad)            # (rows, V)
        z = np.stack([_flat_rows(_logits(m, inputs, drop_last), pad)
                      for m in private_lms])                                  # (N, rows, V)
        target = np.pad(targets.reshape(-1), (0, pad)).astype("int32")
        real = np.pad(real, (0, pad))
        count += int(real.sum())
        for ball, scorer in scorers.items():
            log_q, lam = scorer(z0, z, target)
            nll[ball] -= float(np.asarray(log_q)[real].sum())
            if return_mean_lambda:
                lam_sum[ball] += float(np.asarray(lam).mean(axis=0)[real].sum())
    perplexity = {ball: math.exp(nll[ball] / count) for ball in balls}
    if return_mean_lambda:
        return perplexity, {ball: lam_sum[ball] / count for ball in balls}
    return perplexity
