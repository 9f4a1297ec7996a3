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
an end token, but where it stops is itself an output, so this module always
charges the maximum (conservative; the stop is not accounted exactly).

Usage::

    import keras_dp_lm as kdp
    causal_lm.compile(sampler=kdp.DPSampler(lambda_=0.7))
    causal_lm.generate(["The patient"], max_length=40)

    budget = kdp.DecodingBudget(total_epsilon=1000.0)
    budget.generate(causal_lm, ["The patient"], max_length=40)  # charges first

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

import fractions
import math
import os

import keras
import numpy as np
from keras import ops
from keras_hub.samplers import Sampler

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


# --------------------------------------------------------------------------
# Epsilon formulas
# --------------------------------------------------------------------------

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


def epsilon_per_token(lambda_, vocabulary_size):
    """Pure-DP epsilon of one token sampled from ``lambda_*q + (1-lambda_)*u``.

    ``log((1 + (|V|-1)*lambda_) / (1 - lambda_))``, computed with ``log1p``
    so it stays accurate for ``lambda_`` near 0 and near 1.
    """
    lambda_ = _check_lambda(lambda_)
    v = _check_vocabulary_size(vocabulary_size)
    return math.log1p((v - 1) * lambda_) - math.log1p(-lambda_)


def epsilon_per_sequence(lambda_, vocabulary_size, num_tokens):
    """Epsilon of ``num_tokens`` sampled tokens: ``num_tokens * epsilon_per_token``.

    ``num_tokens`` is the number of sampled positions; for ``generate`` use
    :func:`num_sampled_tokens` (``max_length - prompt_length``, the maximum,
    since an early stop is not accounted exactly).
    """
    return _check_num_tokens(num_tokens) * epsilon_per_token(lambda_, vocabulary_size)


def lambda_for_epsilon(epsilon, vocabulary_size, num_tokens):
    """The largest ``lambda_`` whose ``num_tokens``-token sequences are ``epsilon``-DP.

    Solves ``num_tokens * eps_token(lambda_) = epsilon``:
    ``lambda_ = (e^{eps/T} - 1) / (e^{eps/T} - 1 + |V|)``. The result is then
    nudged down by floating-point steps until
    ``epsilon_per_sequence(lambda_, ...) <= epsilon`` holds exactly as computed
    here, so it never overspends, and it is always ``< 1``.
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


def vocabulary_size_of(causal_lm):
    """|V| for the mechanism: the size of the model's output (logits) dimension."""
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


def num_sampled_tokens(max_length, prompt_length):
    """Positions ``generate`` samples for a prompt: ``max(max_length - prompt_length, 0)``.

    ``prompt_length`` counts every token the preprocessor puts before
    generation starts (including a start token).
    """
    return max(int(max_length) - int(prompt_length), 0)


# --------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------

_COIN_RANGE = 2 ** 62


# Keras (TF backend) reduces each of the two seed words modulo 2**31 - 2.
_SEED_WORD_RANGE = 2 ** 31 - 2


def _coin_threshold_of(lambda_):
    """Exact ``floor(lambda_ * 2**62)`` with ``lambda_``'s exact binary value."""
    return math.floor(fractions.Fraction(lambda_) * _COIN_RANGE)


def _entropy_seed():
    """A seed word from OS entropy (never Python's global ``random``)."""
    return int.from_bytes(os.urandom(8), "little") % _SEED_WORD_RANGE


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPSampler(Sampler):
    """KerasHub sampler drawing each token from ``lambda_*q + (1-lambda_)*u``.

    Install it with ``causal_lm.compile(sampler=DPSampler(lambda_=...))``;
    ``causal_lm.generate()`` then samples every new token from the mixture
    over the full vocabulary (works under ``tf.function(jit_compile=True)``).
    ``compute_probabilities`` is KerasHub's (``q``); the mixing happens in
    :meth:`get_next_token` with an exact integer coin (see the module notes),
    and :meth:`mixture_probabilities` gives ``q'`` for inspection.

    Args:
        lambda_: weight of the model's distribution, in ``[0, 1)``. 0 is
            uniform noise (epsilon 0); see :func:`lambda_for_epsilon` to pick
            it from a target epsilon.
        temperature: positive, finite; divides the logits before the softmax
            (before mixing). Does not change epsilon.
        seed: int or ``None``. Seeds the sampler's ``SeedGenerator`` (each
            call to ``generate`` draws fresh randomness from it). ``None``
            fills both words of its state from OS entropy (``os.urandom``,
            about 62 bits; never Python's ``random`` module). A fixed seed
            makes the noise reproducible by anyone who knows it: use one
            for tests only. (The backend's Philox generator is not a
            cryptographic RNG.)

    Privacy: each sampled token is ``epsilon_per_token(|V|)``-DP; a sequence
    of ``T`` sampled tokens is ``T * epsilon_per_token(|V|)``-DP, where ``T``
    is the number of sampled positions (``max_length - prompt_length``, the
    maximum: early stopping is not accounted, which is conservative).

    What is charged is what is applied: ``lambda_`` may be changed at any
    time (``sampler.lambda_ = 0.5``); the traced ``generate`` reads the coin
    threshold from a variable on every call, so the next call samples at the
    new value and :meth:`epsilon_per_token` / :class:`DecodingBudget` charge
    at it (they read the variable back and refuse if it was assigned
    directly). ``|V|`` is the size of the logits, checked at trace time
    against the ``backbone.vocabulary_size`` that charges use. The
    temperature does not enter epsilon.
    """

    def __init__(self, lambda_, temperature=1.0, seed=None, **kwargs):
        lambda_ = _check_lambda(lambda_)
        if isinstance(temperature, bool) or not isinstance(
                temperature, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(temperature)) or float(temperature) <= 0:
            raise ValueError(
                f"`temperature` must be a finite number > 0. Received: {temperature!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(
                seed, (int, np.integer))):
            raise ValueError(f"`seed` must be an int or None. Received: {seed!r}")
        super().__init__(temperature=float(temperature), **kwargs)
        # The traced sampler reads the coin threshold from this variable at run
        # time, so changing ``lambda_`` after ``generate`` was traced changes what
        # is applied and what is charged together (invariant 9).
        self._coin_threshold_variable = keras.Variable(
            np.int64(_coin_threshold_of(lambda_)), dtype="int64", trainable=False,
            name="dp_sampler_coin_threshold")
        self.lambda_ = lambda_
        self.seed = None if seed is None else int(seed)
        initial = self.seed if self.seed is not None else _entropy_seed()
        self.seed_generator = keras.random.SeedGenerator(initial)
        if self.seed is None:
            # Both words of the generator's state from OS entropy (~62 bits):
            # a guessable seed would let an observer replay the coins.
            self.seed_generator.state.assign(
                np.array([initial, _entropy_seed()], dtype="int64"))

    @property
    def lambda_(self):
        """The mixing weight; may be changed at any time (see the class notes).

        Setting it validates the value and assigns the coin threshold variable
        the traced ``generate`` reads on every call, so the next call samples
        with the new value and every charge (:meth:`epsilon_per_token`,
        :class:`DecodingBudget`) is computed at it.
        """
        return self._lambda

    @lambda_.setter
    def lambda_(self, value):
        value = _check_lambda(value)
        threshold = _coin_threshold_of(value)
        self._coin_threshold_variable.assign(np.int64(threshold))
        self._lambda = value
        self._coin_threshold = threshold

    @property
    def variables(self):
        # KerasHub threads ``sampler.variables`` through stateless backends (JAX):
        # the coin threshold must be state there too, never a traced constant.
        return super().variables + [self._coin_threshold_variable]

    def applied_lambda(self):
        """The ``lambda_`` the sampler applies now, read back from its variable.

        Raises ``RuntimeError`` if the variable the traced code reads does not
        hold ``floor(lambda_ * 2**62)`` (it was assigned directly instead of
        through ``lambda_``): then no epsilon can be stated for it.
        """
        applied = int(np.asarray(ops.convert_to_numpy(self._coin_threshold_variable)))
        if applied != _coin_threshold_of(self._lambda) or applied != self._coin_threshold:
            raise RuntimeError(
                f"DPSampler's coin threshold variable holds {applied}, not "
                f"floor(lambda_ * 2**62) = {_coin_threshold_of(self._lambda)} for "
                f"lambda_={self._lambda!r}: it was modified directly. Set "
                f"`sampler.lambda_ = ...` (or build a new DPSampler) instead.")
        return self._lambda

    # -- privacy -----------------------------------------------------------
    def epsilon_per_token(self, vocabulary_size):
        """Epsilon of one sampled token over a vocabulary of this size, at the
        ``lambda_`` the (traced) sampler applies now."""
        return epsilon_per_token(self.applied_lambda(), vocabulary_size)

    def epsilon_per_sequence(self, vocabulary_size, num_tokens):
        """Epsilon of ``num_tokens`` sampled tokens (charge the maximum new tokens),
        at the ``lambda_`` the (traced) sampler applies now."""
        return epsilon_per_sequence(self.applied_lambda(), vocabulary_size, num_tokens)

    # -- sampling ----------------------------------------------------------
    @property
    def effective_lambda(self):
        """The mixing weight actually used: ``floor(lambda_ * 2**62) / 2**62 <= lambda_``.

        The model-or-uniform coin is an exact integer comparison, so the
        realised weight never exceeds ``lambda_`` (and is at most 2**-62
        below it): the epsilon reported for ``lambda_`` is an upper bound.
        """
        return self._coin_threshold / _COIN_RANGE

    def mixture_probabilities(self, logits):
        """``q' = lambda_ * softmax(logits / temperature) + (1 - lambda_) / |V|``
        (float32): the distribution :meth:`get_next_token` samples from, for
        inspection and tests."""
        q = self.compute_probabilities(logits)
        vocabulary_size = ops.cast(ops.shape(q)[-1], "float32")
        return self.lambda_ * q + (1.0 - self.lambda_) / vocabulary_size

    # ``compute_probabilities`` is the base class's: q = softmax(logits / T).

    def get_next_token(self, probabilities):
        """Draw each row's token from ``lambda_ * q + (1 - lambda_) * uniform``.

        Per row: an integer coin picks the model branch with probability
        ``effective_lambda``; the model branch draws from ``probabilities``
        (``q``, like KerasHub's RandomSampler), the other branch draws a token
        id uniformly from ``[0, |V|)`` with 64-bit integers. The floor
        ``(1 - lambda_) / |V|`` on every token's probability -- which is
        what the privacy guarantee rests on -- therefore comes from integer
        arithmetic only: it holds whatever ``probabilities`` contains, even
        if float rounding in the categorical draw puts zero mass on a token.
        (Bias of the uniform draw: at most ``|V| / 2**64`` relative.)
        """
        shape = ops.shape(probabilities)
        batch_size, vocabulary_size = shape[0], shape[-1]
        model_token = keras.random.categorical(
            ops.log(probabilities), 1, seed=self.seed_generator, dtype="int32")
        # A categorical draw from NaN (or all -inf) log-probabilities returns the
        # out-of-range id |V|: an output the uniform branch never produces, with
        # unbounded privacy loss. Clamp it into [0, |V|).
        model_token = ops.clip(ops.squeeze(model_token, axis=-1), 0,
                               ops.cast(vocabulary_size, "int32") - 1)
        coin = keras.random.randint((batch_size,), 0, _COIN_RANGE, dtype="int64",
                                    seed=self.seed_generator)
        uniform_token = keras.random.randint((batch_size,), 0, vocabulary_size,
                                             dtype="int64", seed=self.seed_generator)
        uniform_token = ops.cast(uniform_token, "int32")
        # Read at run time (never a constant baked in at trace time): threshold 0
        # (lambda_ = 0) never picks the model, since coin >= 0.
        threshold = ops.convert_to_tensor(self._coin_threshold_variable)
        return ops.where(coin < threshold, model_token, uniform_token)

    def __call__(self, next, prompt, *args, **kwargs):
        """KerasHub's sampling loop, refusing (at trace time, before any token is
        drawn) logits whose size is not the vocabulary size a charge would use."""
        model = kwargs.get("model")
        expected = None
        if getattr(getattr(model, "backbone", None), "vocabulary_size", None) is not None:
            expected = vocabulary_size_of(model)     # what DecodingBudget charges

        def checked_next(*next_args, **next_kwargs):
            outputs = next(*next_args, **next_kwargs)
            size = outputs[0].shape[-1]
            if expected is not None and (size is None or int(size) != expected):
                raise ValueError(
                    f"DPSampler: the model's logits have size {size} but its "
                    f"vocabulary size is {expected}; epsilon is charged for "
                    f"{expected} tokens and would not describe this sampler.")
            return outputs

        return super().__call__(checked_next, prompt, *args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update({"lambda_": self.lambda_, "seed": self.seed})
        return config

    def __repr__(self):
        return (f"DPSampler(lambda_={self.lambda_!r}, temperature={self.temperature!r}, "
                f"seed={self.seed!r})")


# --------------------------------------------------------------------------
# Query budget
# --------------------------------------------------------------------------

class BudgetExhaustedError(RuntimeError):
    """A decoding request would take a :class:`DecodingBudget` past its total."""


class DecodingBudget:
    """A total epsilon for DP decoding, charged before each generation.

    Semantics (kept simple on purpose):

    - By default (``composition="sequential"``) a call on a batch of prompts
      is charged the *sum* of its per-sequence epsilons: safe whenever one
      protected record can influence every sequence of the call, which is the
      case when the record is in the model's training data.
    - ``composition="parallel"`` charges only the largest per-sequence epsilon
      of the call. It is valid only when each prompt of a call concerns a
      different protected record (each prompt carries one user's private
      context) and the model itself does not depend on those records; the
      budget then counts, for one record, per-sequence epsilon times calls.
    - A charge that would exceed the total raises :class:`BudgetExhaustedError`
      and charges nothing; ``generate`` charges before it generates, so no
      tokens are ever produced beyond the budget. A charge is kept even if
      generation then fails (conservative).

    Totals are compared with ``math.fsum`` of all charges, with a relative
    slack of 1e-12 for floating-point rounding.
    """

    _RELATIVE_SLACK = 1e-12

    def __init__(self, total_epsilon):
        if isinstance(total_epsilon, bool) or not isinstance(
                total_epsilon, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(total_epsilon)) or float(total_epsilon) < 0:
            raise ValueError(
                f"`total_epsilon` must be a finite number >= 0. Received: {total_epsilon!r}")
        self.total_epsilon = float(total_epsilon)
        self._charges = []

    @property
    def spent(self):
        """Epsilon charged so far."""
        return math.fsum(self._charges)

    @property
    def remaining(self):
        """Epsilon left (never negative)."""
        return max(self.total_epsilon - self.spent, 0.0)

    @property
    def num_charges(self):
        return len(self._charges)

    def can_afford(self, epsilon):
        """Whether :meth:`charge` of ``epsilon`` would succeed."""
        epsilon = self._check_epsilon(epsilon)
        new_total = math.fsum(self._charges + [epsilon])
        return new_total <= self.total_epsilon * (1.0 + self._RELATIVE_SLACK)

    def charge(self, epsilon):
        """Record ``epsilon`` spent; raise :class:`BudgetExhaustedError` (charging
        nothing) if it would take the total past ``total_epsilon``. Returns the
        remaining epsilon."""
        epsilon = self._check_epsilon(epsilon)
        if not self.can_afford(epsilon):
            raise BudgetExhaustedError(
                f"Decoding budget exhausted: this request costs epsilon={epsilon:.6g} "
                f"but only {self.remaining:.6g} of total_epsilon={self.total_epsilon:.6g} "
                f"remains (spent {self.spent:.6g} in {len(self._charges)} charge(s)). "
                f"Nothing was generated. Use fewer new tokens (smaller max_length), a "
                f"smaller lambda_, or a new budget for a different protected record.")
        self._charges.append(epsilon)
        return self.remaining

    @staticmethod
    def _check_epsilon(epsilon):
        if isinstance(epsilon, bool) or not isinstance(
                epsilon, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(epsilon)) or float(epsilon) < 0:
            raise ValueError(f"`epsilon` must be a finite number >= 0. Received: {epsilon!r}")
        return float(epsilon)

    def epsilon_for(self, causal_lm, prompts, max_length=None, composition="sequential"):
        """What :meth:`generate` would charge for these arguments (charges nothing)."""
        sampler = getattr(causal_lm, "sampler", None)
        if not isinstance(sampler, DPSampler):
            raise ValueError(
                "DecodingBudget.generate needs a model compiled with a DPSampler, "
                f"got sampler={sampler!r}. Call "
                "`causal_lm.compile(sampler=keras_dp_lm.DPSampler(lambda_=...))` first.")
        if composition not in ("parallel", "sequential"):
            raise ValueError(
                f"`composition` must be 'parallel' or 'sequential'. Received: {composition!r}")
        max_length, prompt_lengths = _prompt_lengths(causal_lm, prompts, max_length)
        vocabulary_size = vocabulary_size_of(causal_lm)
        per_sequence = [sampler.epsilon_per_sequence(
            vocabulary_size, num_sampled_tokens(max_length, n)) for n in prompt_lengths]
        if not per_sequence:
            return 0.0
        return math.fsum(per_sequence) if composition == "sequential" else max(per_sequence)

    def generate(self, causal_lm, prompts, max_length=None, composition="sequential",
                 **generate_kwargs):
        """Charge this call's epsilon, then ``causal_lm.generate(prompts, max_length, ...)``.

        ``prompts``: a string, a list of strings, or (for a model without
        preprocessor) a dict with ``token_ids`` and ``padding_mask``.
        ``max_length`` defaults to the preprocessor's ``sequence_length``.
        Raises :class:`BudgetExhaustedError` before generating anything if
        the charge does not fit. Extra keyword arguments go to ``generate``.
        """
        epsilon = self.epsilon_for(causal_lm, prompts, max_length, composition)
        self.charge(epsilon)
        return causal_lm.generate(prompts, max_length=max_length, **generate_kwargs)

    def get_config(self):
        return {"total_epsilon": self.total_epsilon, "charges": list(self._charges)}

    @classmethod
    def from_config(cls, config):
        budget = cls(config["total_epsilon"])
        for epsilon in config.get("charges", []):
            budget._charges.append(cls._check_epsilon(epsilon))
        return budget

    def __repr__(self):
        return (f"DecodingBudget(total_epsilon={self.total_epsilon!r}, "
                f"spent={self.spent!r})")


def _prompt_lengths(causal_lm, prompts, max_length):
    """(max_length, [tokens before sampling starts, per prompt]) as ``generate`` sees them."""
    preprocessor = getattr(causal_lm, "preprocessor", None)
    if isinstance(prompts, dict):
        if preprocessor is not None and not _is_token_dict(prompts):
            raise TypeError("Pass prompts as strings when the model has a preprocessor.")
        mask = np.asarray(ops.convert_to_numpy(prompts["padding_mask"])).astype(bool)
        token_shape = np.shape(np.asarray(ops.convert_to_numpy(prompts["token_ids"])))
        if token_shape != mask.shape or mask.ndim not in (1, 2):
            # generate samples up to the width of token_ids: a narrower mask would
            # charge fewer positions than are sampled.
            raise ValueError(
                f"`token_ids` (shape {token_shape}) and `padding_mask` (shape "
                f"{mask.shape}) must have the same 1-D or 2-D shape.")
        if mask.ndim == 1:
            mask = mask[None]
        return mask.shape[-1], [int(n) for n in mask.sum(axis=-1)]
    if preprocessor is None:
        raise TypeError(
            "A model without preprocessor needs prompts as a dict with "
            "'token_ids' and 'padding_mask'.")
    if isinstance(prompts, str):
        prompts = [prompts]
    if hasattr(prompts, "element_spec"):
        raise TypeError("DecodingBudget.generate takes a list of prompts, not a tf.data.Dataset.")
    prompts = list(prompts)
    if max_length is None:
        max_length = preprocessor.sequence_length
    if not prompts:
        return int(max_length), []
    x = preprocessor.generate_preprocess(prompts, sequence_length=int(max_length))
    mask = np.asarray(ops.convert_to_numpy(x["padding_mask"])).astype(bool)
    return int(max_length), [int(n) for n in mask.sum(axis=-1)]


def _is_token_dict(x):
    return isinstance(x, dict) and "token_ids" in x and "padding_mask" in x


# --------------------------------------------------------------------------
# Utility: perplexity under the mixture
# --------------------------------------------------------------------------

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
