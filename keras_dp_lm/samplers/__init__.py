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

Public/private mixtures (issue 17): :class:`PublicMixtureSampler` decodes with
a public causal LM and ``N`` private ones fine-tuned on disjoint shards of the
private data (PMixED-style). Each private next-token distribution is pulled
towards the public one onto a Rényi ball of radius ``beta`` (order ``alpha``),
the results are averaged and a token is drawn with integer arithmetic only.
Its guarantee is ``(epsilon, delta)``: a data-independent per-token RDP curve
(:meth:`PublicMixtureSampler.rdp`, proof in
:mod:`keras_dp_lm.samplers.public_mixture`), summed over tokens and converted
with dp_accounting; :func:`ball_for_epsilon` / :func:`beta_for_epsilon` pick
``beta`` (and ``alpha``) for a target epsilon per sequence, and ``DecodingBudget(total_epsilon, delta=...)`` keeps an RDP
ledger that charges it (and ``DPSampler``) before generating::

    from keras_dp_lm.samplers import (DecodingBudget, PublicMixtureSampler,
                                      ball_for_epsilon)
    alpha, beta = ball_for_epsilon(8.0, delta=1e-6, num_tokens=64,
                                   num_models=len(private_lms))
    public_lm.compile(sampler=PublicMixtureSampler(private_lms, beta=beta, alpha=alpha))
    budget = DecodingBudget(total_epsilon=16.0, delta=1e-6)
    budget.generate(public_lm, ["The patient"], max_length=70)  # charges 64 tokens
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
from keras_dp_lm.samplers.perplexity import public_mixture_perplexity
from keras_dp_lm.samplers.public_mixture import PublicMixtureSampler
from keras_dp_lm.samplers.renyi import ball_for_epsilon
from keras_dp_lm.samplers.renyi import beta_for_epsilon
from keras_dp_lm.samplers.renyi import epsilon_for_rdp
from keras_dp_lm.samplers.renyi import per_token_rdp
from keras_dp_lm.samplers.renyi import renyi_divergence
from keras_dp_lm.samplers.renyi import sequence_epsilon

__all__ = [
    "BudgetExhaustedError",
    "DPSampler",
    "DecodingBudget",
    "PublicMixtureSampler",
    "ball_for_epsilon",
    "beta_for_epsilon",
    "epsilon_for_rdp",
    "epsilon_per_sequence",
    "epsilon_per_token",
    "lambda_for_epsilon",
    "mixture_perplexity",
    "num_sampled_tokens",
    "per_token_rdp",
    "public_mixture_perplexity",
    "renyi_divergence",
    "sequence_epsilon",
    "vocabulary_size_of",
]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
