"""Epsilon of DP decoding: per token, per sequence, and the ``lambda_`` for a target.

Plain arithmetic (no TensorFlow): see :mod:`keras_dp_lm.samplers` for the mechanism.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import keras_hub


def _check_lambda(lambda_):
    if isinstance(lambda_, bool) or not isinstance(lambda_, (int, float, np.floating,
                                                               np.integer)):
        raise ValueError(f"`lambda_` must be a number in [0, 1). Received: lambda_={lambda_!r}")
    lambda_ = float(lambda_)
    if not (0.0 <= lambda_ < 1.0):
        raise ValueError(
            f"`lambda_` must be in [0, 1): lambda_=1 samples from the model "
            f"alone and has no privacy guarantee (infinite epsilon). "
            f"Received: lambda_={lambda_!r}")
    return lambda_


def _check_vocabulary_size(vocabulary_size):
    if isinstance(vocabulary_size, bool) or int(vocabulary_size) != vocabulary_size \
            or int(vocabulary_size) < 2:
        raise ValueError(
            f"`vocabulary_size` must be an integer >= 2. Received: {vocabulary_size!r}")
    return int(vocabulary_size)


def _check_num_tokens(num_tokens):
    if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or int(num_tokens) < 0:
        raise ValueError(
            f"`num_tokens` must be an integer >= 0. Received: {num_tokens!r}")
    return int(num_tokens)


def epsilon_per_token(lambda_: float, vocabulary_size: int) -> float:
    """Pure-DP epsilon of one token sampled from ``lambda_*q + (1-lambda_)*u``.

    ``log((1 + (|V|-1)*lambda_) / (1 - lambda_))``, computed with ``log1p``
    so it stays accurate for ``lambda_`` near 0 and near 1. ``lambda_``: the
    model's weight in the mixture, in [0, 1); ``vocabulary_size``: |V|.

    Example:
        >>> round(epsilon_per_token(lambda_=0.5, vocabulary_size=8), 4)  # log(4.5 / 0.5)
        2.1972
    """
    lambda_ = _check_lambda(lambda_)
    v = _check_vocabulary_size(vocabulary_size)
    return math.log1p((v - 1) * lambda_) - math.log1p(-lambda_)


def epsilon_per_sequence(lambda_: float, vocabulary_size: int, num_tokens: int) -> float:
    """Epsilon of ``num_tokens`` sampled tokens: ``num_tokens * epsilon_per_token``.

    ``num_tokens`` is the number of sampled positions; for ``generate`` use
    :func:`num_sampled_tokens` (``max_length - prompt_length``, the maximum,
    since an early stop is not accounted exactly). ``lambda_`` and
    ``vocabulary_size`` (|V|) as for :func:`epsilon_per_token`.

    Example:
        >>> round(epsilon_per_sequence(lambda_=0.5, vocabulary_size=8, num_tokens=10), 3)
        21.972
    """
    return _check_num_tokens(num_tokens) * epsilon_per_token(lambda_, vocabulary_size)


def lambda_for_epsilon(epsilon: float, vocabulary_size: int, num_tokens: int) -> float:
    """The largest ``lambda_`` whose ``num_tokens``-token sequences are ``epsilon``-DP.

    Solves ``num_tokens * eps_token(lambda_) = epsilon``:
    ``lambda_ = (e^{eps/T} - 1) / (e^{eps/T} - 1 + |V|)``. The result is then
    nudged down by floating-point steps until
    ``epsilon_per_sequence(lambda_, ...) <= epsilon`` holds exactly as computed
    here, so it never overspends, and it is always ``< 1``. ``vocabulary_size``:
    |V|, the model's output dimension (:func:`vocabulary_size_of`).

    Example:
        >>> lambda_ = lambda_for_epsilon(epsilon=10.0, vocabulary_size=8, num_tokens=10)
        >>> round(lambda_, 4), epsilon_per_sequence(lambda_, 8, 10) <= 10.0
        (0.1768, True)
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating,
                                                               np.integer)) \
            or not (float(epsilon) >= 0.0) or math.isinf(float(epsilon)):
        raise ValueError(f"`epsilon` must be a finite number >= 0. Received: {epsilon!r}")
    v = _check_vocabulary_size(vocabulary_size)
    t = _check_num_tokens(num_tokens)
    if t == 0:
        raise ValueError("`num_tokens` must be >= 1 to solve for lambda_.")
    eps_token = float(epsilon) / t
    if eps_token == 0.0:
        return 0.0
    # 1 / (1 + |V| / (e^x - 1)), written with e^{-x} so it cannot overflow.
    ratio = v * math.exp(-eps_token) / -math.expm1(-eps_token)
    lambda_ = 1.0 / (1.0 + ratio)
    lambda_ = min(lambda_, math.nextafter(1.0, 0.0))
    while lambda_ > 0.0 and epsilon_per_sequence(lambda_, v, t) > float(epsilon):
        lambda_ = math.nextafter(lambda_, 0.0)
    return lambda_


def vocabulary_size_of(causal_lm: keras_hub.models.CausalLM) -> int:
    """|V| for the mechanism: the size of the model's output (logits) dimension,
    read from ``causal_lm.backbone.vocabulary_size`` (a KerasHub CausalLM).

    Example:
        >>> from keras_dp_lm import testing
        >>> causal_lm = testing.tiny_gpt2_causal_lm(["To be, or not to be."],
        ...                                         vocabulary_size=300)
        >>> vocabulary_size_of(causal_lm)  # 256 bytes, 10 merges, <|endoftext|>
        267
    """
    backbone = getattr(causal_lm, "backbone", None)
    size = getattr(backbone, "vocabulary_size", None)
    if size is None:
        raise ValueError(
            "Cannot find the vocabulary size of this model: expected a KerasHub "
            "CausalLM with `backbone.vocabulary_size`.")
    size = _check_vocabulary_size(size)
    # The mechanism's |V| is the logits' size (the sampler draws uniformly over
    # it): a backbone attribute that disagrees with the model's output would
    # charge for a different |V| than is applied.
    try:
        outputs = causal_lm.outputs
    except (AttributeError, ValueError):
        outputs = None
    if outputs:
        logits_size = outputs[0].shape[-1]
        if logits_size is not None and int(logits_size) != size:
            raise ValueError(
                f"backbone.vocabulary_size={size} but the model's logits have size "
                f"{int(logits_size)}: the sampler draws over the logits, so epsilon "
                f"cannot be charged for {size} tokens.")
    return size


def num_sampled_tokens(max_length: int, prompt_length: int) -> int:
    """Positions ``generate`` samples for a prompt: ``max(max_length - prompt_length, 0)``.

    ``prompt_length`` counts every token the preprocessor puts before
    generation starts (including a start token).

    Example:
        >>> num_sampled_tokens(max_length=40, prompt_length=3)
        37
    """
    return max(int(max_length) - int(prompt_length), 0)
