"""``DPSampler``: the KerasHub sampler that mixes the model with uniform noise."""

from __future__ import annotations

import fractions
import math
import os
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import ops
from keras_hub.samplers import Sampler

from keras_dp_lm.samplers.epsilon import _check_lambda
from keras_dp_lm.samplers.epsilon import epsilon_per_sequence
from keras_dp_lm.samplers.epsilon import epsilon_per_token
from keras_dp_lm.samplers.epsilon import vocabulary_size_of

if TYPE_CHECKING:
    import tensorflow as tf

_COIN_RANGE = 2 ** 62


# Keras (TF backend) reduces each of the two seed words modulo 2**31 - 2.
_SEED_WORD_RANGE = 2 ** 31 - 2


def _coin_threshold_of(lambda_):
    """Exact ``floor(lambda_ * 2**62)`` with ``lambda_``'s exact binary value."""
    return math.floor(fractions.Fraction(lambda_) * _COIN_RANGE)


def _entropy_seed():
    """A seed word from OS entropy (never Python's global ``random``)."""
    return int.from_bytes(os.urandom(8), "little") % _SEED_WORD_RANGE


def _read_only(getter, annotation, doc=None):
    """A read-only property of ``getter`` (a lambda) whose value has the type
    ``annotation`` (the string a lambda cannot carry as its return annotation)."""
    getter.__annotations__ = {"return": annotation}
    return property(getter, doc=doc)


def _check_temperature_and_seed(temperature, seed):
    """Refuse a non-finite / non-positive ``temperature`` and a non-integer ``seed``."""
    if isinstance(temperature, bool) or not isinstance(
            temperature, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(temperature)) or float(temperature) <= 0:
        raise ValueError(
            f"`temperature` must be a finite number > 0. Received: {temperature!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(
            seed, (int, np.integer))):
        raise ValueError(f"`seed` must be an int or None. Received: {seed!r}")


def _seed_generator(seed):
    """A ``SeedGenerator`` from ``seed``, or with both words of its state from OS
    entropy (~62 bits) when ``seed`` is None: a guessable seed would let an
    observer replay the draws."""
    initial = seed if seed is not None else _entropy_seed()
    generator = keras.random.SeedGenerator(initial)
    if seed is None:
        generator.state.assign(np.array([initial, _entropy_seed()], dtype="int64"))
    return generator


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPSampler(Sampler):
    """KerasHub sampler drawing each token from ``lambda_*q + (1-lambda_)*u``.

    Install it with ``causal_lm.compile(sampler=DPSampler(lambda_=...))``;
    ``causal_lm.generate()`` then samples every new token from the mixture
    over the full vocabulary (works under ``tf.function(jit_compile=True)``).
    Install it through ``compile``, not ``causal_lm.sampler = ...``: KerasHub
    keeps its traced generate function, which reads the sampler only when it
    traces, so a direct ``generate`` after an assignment may still sample with
    the old sampler. :class:`DecodingBudget` ``.generate`` always samples with
    the sampler it charges.
    ``compute_probabilities`` is KerasHub's (``q``); the mixing happens in
    :meth:`get_next_token` with an exact integer coin (see :mod:`keras_dp_lm.samplers`),
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

    Example (``causal_lm.compile(sampler=sampler)`` puts it to work):
        >>> import numpy as np
        >>> sampler = DPSampler(lambda_=0.5, seed=0)
        >>> round(sampler.epsilon_per_token(vocabulary_size=4), 4)  # log(2.5 / 0.5)
        1.6094
        >>> logits = np.log(np.array([[0.97, 0.01, 0.01, 0.01]], "float32"))
        >>> [round(float(p), 3) for p in sampler.mixture_probabilities(logits)[0]]
        [0.61, 0.13, 0.13, 0.13]
        >>> tuple(sampler.get_next_token(sampler.compute_probabilities(logits)).shape)
        (1,)
    """

    def __init__(self, lambda_: float, temperature: float = 1.0, seed: int | None = None,
                 **kwargs: Any) -> None:
        lambda_ = _check_lambda(lambda_)
        _check_temperature_and_seed(temperature, seed)
        super().__init__(temperature=float(temperature), **kwargs)
        # The traced sampler reads the coin threshold from this variable at run
        # time, so changing ``lambda_`` after ``generate`` was traced changes what
        # is applied and what is charged together (invariant 9).
        self._coin_threshold_variable = keras.Variable(
            np.int64(_coin_threshold_of(lambda_)), dtype="int64", trainable=False,
            name="dp_sampler_coin_threshold")
        self.lambda_ = lambda_
        self.seed = None if seed is None else int(seed)
        self.seed_generator = _seed_generator(self.seed)

    @property
    def lambda_(self) -> float:
        """The mixing weight; may be changed at any time (see the class notes).

        Setting it validates the value and assigns the coin threshold variable
        the traced ``generate`` reads on every call, so the next call samples
        with the new value and every charge (:meth:`epsilon_per_token`,
        :class:`DecodingBudget`) is computed at it.
        """
        return self._lambda

    @lambda_.setter
    def lambda_(self, value: float) -> None:
        value = _check_lambda(value)
        threshold = _coin_threshold_of(value)
        self._coin_threshold_variable.assign(np.int64(threshold))
        self._lambda = value
        self._coin_threshold = threshold

    @property
    def variables(self) -> list[keras.Variable]:
        # KerasHub threads ``sampler.variables`` through stateless backends (JAX):
        # the coin threshold must be state there too, never a traced constant.
        return super().variables + [self._coin_threshold_variable]

    def applied_lambda(self) -> float:
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
    def epsilon_per_token(self, vocabulary_size: int) -> float:
        """Epsilon of one sampled token over a vocabulary of ``vocabulary_size``
        tokens (the model's ``|V|``), at the ``lambda_`` the (traced) sampler
        applies now."""
        return epsilon_per_token(self.applied_lambda(), vocabulary_size)

    def epsilon_per_sequence(self, vocabulary_size: int, num_tokens: int) -> float:
        """Epsilon of ``num_tokens`` sampled tokens (charge the maximum new tokens)
        over a vocabulary of ``vocabulary_size`` tokens, at the ``lambda_`` the
        (traced) sampler applies now."""
        return epsilon_per_sequence(self.applied_lambda(), vocabulary_size, num_tokens)

    # -- sampling ----------------------------------------------------------
    @property
    def effective_lambda(self) -> float:
        """The mixing weight actually used: ``floor(lambda_ * 2**62) / 2**62 <= lambda_``.

        The model-or-uniform coin is an exact integer comparison, so the
        realised weight never exceeds ``lambda_`` (and is at most 2**-62
        below it): the epsilon reported for ``lambda_`` is an upper bound.
        """
        return self._coin_threshold / _COIN_RANGE

    def mixture_probabilities(self, logits: np.ndarray | tf.Tensor) -> tf.Tensor:
        """``q' = lambda_ * softmax(logits / temperature) + (1 - lambda_) / |V|``
        (float32): the distribution :meth:`get_next_token` samples from, for
        inspection and tests."""
        q = self.compute_probabilities(logits)
        vocabulary_size = ops.cast(ops.shape(q)[-1], "float32")
        return self.lambda_ * q + (1.0 - self.lambda_) / vocabulary_size

    # ``compute_probabilities`` is the base class's: q = softmax(logits / T).

    def get_next_token(self, probabilities: tf.Tensor) -> tf.Tensor:
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

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"lambda_": self.lambda_, "seed": self.seed})
        return config

    def __repr__(self):
        return (f"DPSampler(lambda_={self.lambda_!r}, temperature={self.temperature!r}, "
                f"seed={self.seed!r})")
