"""Differentially private decoding for KerasHub causal language models.

The mechanism (issue 7): at every sampled position the model's next-token
distribution ``q`` (softmax of ``logits / temperature``) is mixed with the
uniform distribution ``u`` over the whole vocabulary ``V``::

    q' = lambda_ * q + (1 - lambda_) * u,        0 <= lambda_ < 1

and the token is drawn from ``q'``. Every token then has probability between
``(1 - lambda_) / |V|`` and ``lambda_ + (1 - lambda_) / |V|`` whatever the
model, its weights or its context, so one sampled token is ``eps_token``-DP
with respect to *any* change of what went into ``q``::

    eps_token = log((1 + (|V| - 1) * lambda_) / (1 - lambda_))

and a sequence of ``T`` sampled tokens is ``T * eps_token``-DP (basic
composition: each token's distribution is bounded given the tokens before
it). ``lambda_ = 0`` is uniform noise (``eps = 0``); larger ``lambda_`` is more
useful and less private. The temperature changes ``q`` only, not the bound.

What is charged: the number of *sampled positions*, i.e. the maximum number
of new tokens ``max_length - prompt_length``. Generation may stop earlier at
an end token, but where it stops is itself an output, so this package always
charges the maximum (conservative; the stop is not accounted exactly).

Usage::

    import keras_dp_lm as kdp
    causal_lm.compile(sampler=kdp.DPSampler(lambda_=0.7))
    causal_lm.generate(["The patient"], max_length=40)

    budget = kdp.DecodingBudget(total_epsilon=1000.0)
    budget.generate(causal_lm, ["The patient"], max_length=40)  # charges first

Example (a ``lambda_`` for a target epsilon per 32-token sequence):
    >>> import keras_dp_lm as kdp
    >>> lambda_ = kdp.lambda_for_epsilon(epsilon=20.0, vocabulary_size=50257, num_tokens=32)
    >>> sampler = kdp.DPSampler(lambda_=lambda_)
    >>> round(lambda_, 6), sampler.epsilon_per_sequence(50257, num_tokens=32) <= 20.0
    (1.7e-05, True)

How a token is drawn: per sequence, an exact integer coin picks the model
with probability ``lambda_`` (rounded *down* to a multiple of 2**-62), which
then draws from ``q`` like KerasHub's ``RandomSampler``; otherwise a token id
is drawn uniformly with 64-bit integers. The probability floor
``(1 - lambda_) / |V|`` that the guarantee rests on thus never depends on
floating-point accuracy of the categorical draw (a float32 Gumbel-max or
inverse-CDF sampler can put zero mass on very unlikely tokens; cf. Mironov
2012 on floating-point Laplace noise). Residual: the uniform draw is biased by
at most ``|V| / 2**64`` relative, negligible next to float64 epsilon.

The guarantee covers the sampled tokens only; ``generate`` also returns the
prompt verbatim.
"""

from keras_dp_lm.samplers.budget import BudgetExhaustedError
from keras_dp_lm.samplers.budget import DecodingBudget
from keras_dp_lm.samplers.dp_sampler import DPSampler
from keras_dp_lm.samplers.epsilon import epsilon_per_sequence
from keras_dp_lm.samplers.epsilon import epsilon_per_token
from keras_dp_lm.samplers.epsilon import lambda_for_epsilon
from keras_dp_lm.samplers.epsilon import num_sampled_tokens
from keras_dp_lm.samplers.epsilon import vocabulary_size_of
from keras_dp_lm.samplers.perplexity import mixture_perplexity

__all__ = [
    "BudgetExhaustedError",
    "DPSampler",
    "DecodingBudget",
    "epsilon_per_sequence",
    "epsilon_per_token",
    "lambda_for_epsilon",
    "mixture_perplexity",
    "num_sampled_tokens",
    "vocabulary_size_of",
]

from keras_dp_lm import _activate_if_pending  # noqa: E402

_activate_if_pending()
