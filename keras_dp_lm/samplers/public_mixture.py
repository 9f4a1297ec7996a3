r"""``PublicMixtureSampler``: private decoding by mixing private models into a public one.

A PMixED-style mechanism (Flemings, Razaviyayn & Annavaram, NAACL 2024; cf.
SubMix, Ginart et al. 2022) with its own, data-independent RDP analysis.

Setting
-------
The private data set is split into ``N`` disjoint shards and one causal LM is fine-tuned on each
(``N = 1`` allowed). A *public* causal LM (e.g. the pre-trained model the private ones started
from) never sees private data. Neighbouring data sets differ in one record, which lies in at most
one shard: they differ in at most one private model, arbitrarily. (This needs the shard of a record
to depend on that record only, e.g. a hash of its user / record id: a split into ``N`` consecutive
chunks of equal size is *not* valid under add/remove neighbours, since one insertion shifts every
chunk.) The prompt and the public model are public.

Mechanism (one sampled token, given the released prefix)
--------------------------------------------------------
1. Public distribution: ``p0 = w0 / sum(w0)`` with integer weights
   ``w0 = floor((1 - gamma) softmax(z0 / T) 2**32) + c``,
   ``c = max(1, floor(gamma 2**32 / V))`` (``gamma = public_floor``): every token
   has public probability ``>= c / sum(w0) > 0``.
2. Private distributions: ``p_i = w_i / sum(w_i)``, ``w_i = floor(softmax(z_i / T) 2**32)``
   (any distribution is allowed here, zeros included).
3. Projection onto the Rényi ball of radius ``beta`` at order ``alpha``:
   ``p_hat_i = lam_i p_i + (1 - lam_i) p0`` with the largest ``lam_i`` (a multiple
   of 2**-16, by bisection in float64) such that
   ``D_{2 alpha}(p_hat_i || p0) <= beta`` and ``D_{2 alpha - 1}(p0 || p_hat_i) <= beta``
   (checked against ``beta (1 - 1e-6) - 1e-12``).
4. Output: one token from ``q = (1/N) sum_i p_hat_i``, drawn with integers only:
   a model ``i`` uniformly, an exact coin ``lam_i`` (62-bit threshold), then an
   inverse-CDF draw from the chosen integer weights ``w_i`` or ``w0``.

Claim
-----
For every order ``1 < a <= alpha`` one token is ``(a, eps(a))``-RDP with::

    eps(a) = min_{a <= a' <= alpha} log(1 - 1/N + exp((2a' - 3/2) beta) / N) / (a' - 1)

(plus a ``~4e-9`` slack for the integer draws, below). ``T`` tokens compose to
``T eps(a)`` (adaptive RDP composition: the bound holds for every prefix), and
:func:`~keras_dp_lm.samplers.renyi.epsilon_for_rdp` converts to ``(eps, delta)``
with dp_accounting. For ``N = 1``, ``eps(a) = (2 alpha - 3/2) beta / (alpha - 1)``.

Proof
-----
Write ``F_a(P, Q) = sum_x P(x)^a Q(x)^(1-a) = exp((a - 1) D_a(P || Q))``.

(i) Monotonicity in the order: ``D_a`` is non-decreasing in ``a`` (van Erven &
    Harremoës 2014, Thm 3). So the ball's constraints at orders ``2 alpha`` and
    ``2 alpha - 1`` hold at ``2a`` and ``2a - 1`` for every ``a <= alpha``, and a
    bound on ``D_{a'}`` bounds ``D_a`` for ``a <= a'`` (the ``min``).
(ii) Monotonicity in ``lam`` (bisection is valid): with ``r = p / p0``,
    ``F_{2alpha}(p_hat || p0) = sum p0 (1 + lam (r - 1))^{2alpha}`` and
    ``F_{2alpha-1}(p0 || p_hat) = sum p0 (1 + lam (r - 1))^{2 - 2alpha}`` are convex in
    ``lam`` with derivative ``const * sum p0 (r - 1) = 0`` at ``lam = 0``, hence
    non-decreasing on ``[0, 1]``; ``lam = 0`` gives ``p_hat = p0`` (divergence 0).
(iii) Weak triangle inequality (Mironov 2017, Prop. 11, with ``p = q = 2``): for
    distributions ``P, Q, R``, Hölder's inequality on
    ``F_a(P, Q) = sum R (P/R)^a (R/Q)^(a-1)`` gives
    ``F_a(P, Q) <= F_{2a}(P, R)^(1/2) F_{2a-1}(R, Q)^(1/2)``, i.e.
    ``D_a(P||Q) <= (a - 1/2)/(a - 1) D_{2a}(P||R) + D_{2a-1}(R||Q)``.
    With ``R = p0``, ``P = p_hat_j``, ``Q = p_hat_j'`` (the changed model's projections
    on the two data sets) and (i): ``(a - 1) D_a(p_hat_j || p_hat_j') <= (a - 1/2) beta +
    (a - 1) beta = (2a - 3/2) beta``.
(iv) Joint convexity: ``(x, y) -> x^a y^(1-a)`` is the perspective of the convex
    ``x -> x^a`` (``a > 1``), hence jointly convex, and so is ``F_a``. The two
    output distributions share the weights and the ``N - 1`` unchanged components
    (each depends on its own shard and the public ``p0`` only), so
    ``F_a(q, q') <= (1 - 1/N) F_a(r, r) + (1/N) F_a(p_hat_j, p_hat_j')
    <= 1 - 1/N + exp((2a - 3/2) beta) / N`` with ``F_a(r, r) = 1``. The same holds for
    ``F_a(q', q)`` (the roles of the data sets are symmetric). Taking the log and
    dividing by ``a - 1`` gives the claim. (Nothing depends on ``lam_j`` except
    through the ball, which both ``p_hat_j`` and ``p_hat_j'`` satisfy; the ``lam_i``
    are not released.)
(v) Realised distribution: every draw is an exact integer computation except for the reductions of
    62-bit uniform words modulo ``N`` and modulo a weight total ``W < 2**33``: each outcome's
    probability is within a factor ``1 +- N/2**62`` (model) and ``1 +- 2**-29`` (token) of the
    exact one, so the realised ``q~`` satisfies ``lo q <= q~ <= hi q`` and
    ``D_a(q~ || q~') <= D_a(q || q') + a/(a-1) log hi - log lo``
    (:func:`~keras_dp_lm.samplers.renyi.sampling_slack`, included in every charge). ``lam_i`` is
    used as the exact dyadic ``floor(lam_i 2**62) / 2**62``.

The bound is not loose: for ``N = 1`` brute force over small vocabularies attains it to within the
``1e-6`` margin (it is tight); for ``N > 1`` step (iv) costs a factor of about 2-3 (see the tests).

Random subsets (PMixED samples ``m`` of the ``N`` models per token): the token
from a uniformly random ``m``-subset's average has the *same* distribution as
the token from all ``N`` (by symmetry, ``E_S avg_{i in S} p_hat_i = avg_i p_hat_i``
and the subset is not released), so subsampling changes neither the output
distribution nor this bound; it only saves compute, and it is not implemented.

Residual risks (stated honestly)
--------------------------------
- The projection's divergences are float64 sums (``~1e-13`` relative rounding
  for the vocabularies and orders accepted, ``alpha <= 256``); the ``1e-6``
  relative margin absorbs it but is an engineering margin, not a formal
  floating-point error bound. float64 runs on CPU and GPU; TPUs have no float64.
- What is protected is the private models' training records. The prompt is
  returned verbatim and is assumed public; the public model must not have seen
  private data; each private model must be trained on its shard only.
- Early stopping at an end token is not accounted: charge the maximum number
  of new tokens (what :class:`DecodingBudget` does).
- A fixed ``seed`` makes the draws reproducible by anyone who knows it (tests only).

Cost: every step runs the public and all ``N`` private models (each with its own
KV cache) plus ``N`` bisections of 16 float64 steps over the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras_hub.models import CausalLM
from keras_hub.samplers import Sampler

from keras_dp_lm.samplers import renyi
from keras_dp_lm.samplers.dp_sampler import _check_temperature_and_seed
from keras_dp_lm.samplers.dp_sampler import _read_only
from keras_dp_lm.samplers.dp_sampler import _seed_generator
from keras_dp_lm.samplers.causal_lms import _any_equal
from keras_dp_lm.samplers.causal_lms import _check_causal_lm
from keras_dp_lm.samplers.causal_lms import _check_same_vocabulary

_WORD_RANGE = 2 ** renyi.RANDOM_BITS
_QUANT_SCALE = float(2 ** renyi.QUANT_BITS)


def _logsumexp(x):
    return ops.logsumexp(x, axis=-1)


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class PublicMixtureSampler(Sampler):
    """KerasHub sampler: private models projected onto a Rényi ball around a public model.

    Each token is drawn from ``(1/N) sum_i p_hat_i`` where ``p_hat_i`` is private model ``i``'s
    next-token distribution pulled towards the public model's until both Rényi divergences of the
    ball are ``<= beta`` (see :mod:`keras_dp_lm.samplers.public_mixture` for the mechanism, the
    proof and its residual risks). One token is ``(a, eps(a))``-RDP for ``a <= alpha``
    (:meth:`rdp`); a sequence is charged with :meth:`epsilon_per_sequence` or a
    :class:`DecodingBudget` holding ``(total_epsilon, delta)``.

    Install it on the public model (or on one of the private models; all must
    share one tokenizer)::

        public_lm.compile(sampler=PublicMixtureSampler([private_1, private_2], beta=0.1))
        public_lm.generate(["The patient"], max_length=40)

    Inside ``generate`` (eager or ``jit_compile=True``) the sampler runs its own decoding loop: the
    compiled model goes through KerasHub's ``next`` (its own cache), every other model through its
    ``call_with_cache`` with a KV cache the sampler builds from the prompt.

    Args:
        private_models: list of ``N >= 1`` KerasHub causal LMs, each fine-tuned on
            one disjoint shard of the private data.
        beta: the ball radius (> 0); see :func:`beta_for_epsilon` to pick it from
            a target epsilon. Small ``beta`` is close to the public model.
        alpha: RDP order of the ball (``1 < alpha <= 256``, default 8): the
            projection bounds ``D_{2 alpha}`` and ``D_{2 alpha - 1}``; RDP is stated for
            orders up to ``alpha``.
        public_model: the public causal LM, or ``None`` (default): the model the
            sampler is compiled on is the public one.
        public_floor: weight ``gamma`` in ``[0, 1)`` of the uniform distribution mixed into the
            public one (default ``1e-3``): every token keeps public probability ``>= gamma / V`` so
            private models can move mass onto it. Public, so it does not change epsilon.
        temperature: positive; divides every model's logits.
        seed: int or ``None`` (OS entropy, like :class:`DPSampler`).

    ``beta``, ``alpha``, ``public_floor`` and the models are fixed at construction
    (what is charged is what is applied): build a new sampler to change them.

    Example (tiny random GPT-2s stand in for the public and two private models):
        >>> import numpy as np
        >>> from keras_dp_lm import testing
        >>> from keras_dp_lm.samplers import ball_for_epsilon
        >>> def tiny(seed):
        ...     return testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT],
        ...                                        vocabulary_size=270, seed=seed)
        >>> public, private = tiny(0), [tiny(1), tiny(2)]
        >>> alpha, beta = ball_for_epsilon(8.0, delta=1e-6, num_tokens=64, num_models=2)
        >>> sampler = PublicMixtureSampler(private, beta=beta, alpha=alpha, seed=0)
        >>> public.compile(sampler=sampler)
        >>> text = public.generate("To be", max_length=8)
        >>> text.startswith("To be"), sampler.epsilon_per_sequence(64, delta=1e-6) <= 8.0
        (True, True)

        The distributions of one step (logits of the public model, and of the
        ``N`` private models stacked):

        >>> one = PublicMixtureSampler(private[:1], beta=0.5, alpha=8, seed=0)
        >>> z0 = np.log([[0.7, 0.2, 0.1]]); z = np.log([[[0.01, 0.01, 0.98]]])
        >>> lam = one.projection_weights(z0, z)          # (N, batch)
        >>> q = one.mixture_probabilities(z0, z)         # what a token is drawn from
        >>> round(float(lam[0, 0]), 4), [round(float(x), 3) for x in q[0]]
        (0.0963, [0.633, 0.182, 0.185])
    """

    def __init__(self, private_models: Sequence[CausalLM], beta: float, alpha: float = 8.0,
                 public_model: CausalLM | None = None, public_floor: float = 1e-3,
                 temperature: float = 1.0, seed: int | None = None, **kwargs: Any) -> None:
        if isinstance(private_models, (list, tuple)):
            private_models = tuple(private_models)
        else:
            raise ValueError(
                "`private_models` must be a non-empty list of KerasHub causal LMs "
                f"(one per private shard). Received: {private_models!r}")
        if not private_models:
            raise ValueError("`private_models` must contain at least one model.")
        for k, model in enumerate(private_models):
            _check_causal_lm(model, f"private_models[{k}]")
        if public_model is not None:
            _check_causal_lm(public_model, "public_model")
            if any(public_model is m for m in private_models):
                raise ValueError(
                    "`public_model` must not be one of the private models: it must "
                    "never have seen private data.")
        models = ([public_model] if public_model is not None else []) + list(private_models)
        names = (["public_model"] if public_model is not None else []) + [
            f"private_models[{k}]" for k in range(len(private_models))]
        self._vocabulary_size = _check_same_vocabulary(models, names)
        self._beta = renyi._check_beta(beta)
        self._alpha = renyi._check_alpha(alpha)
        if isinstance(public_floor, bool) or not isinstance(
                public_floor, (int, float, np.floating, np.integer)) \
                or not (0.0 <= float(public_floor) < 1.0):
            raise ValueError(f"`public_floor` must be in [0, 1). Received: {public_floor!r}")
        self._public_floor = float(public_floor)
        _check_temperature_and_seed(temperature, seed)
        super().__init__(temperature=float(temperature), **kwargs)
        self._private_models = private_models
        self._public_model = public_model
        self.seed = None if seed is None else int(seed)
        self.seed_generator = _seed_generator(self.seed)

    # -- read-only parameters ------------------------------------------------
    beta = _read_only(lambda self: self._beta, "float", "The Rényi ball radius.")
    alpha = _read_only(lambda self: self._alpha, "float", "The RDP order of the ball.")
    public_floor = _read_only(lambda self: self._public_floor, "float",
                              "Weight of the uniform distribution in the public one.")
    private_models = _read_only(lambda self: self._private_models, "tuple[CausalLM, ...]",
                                "The private models (a tuple).")
    public_model = _read_only(lambda self: self._public_model, "CausalLM | None",
                              "The public model, or None (the compiled model).")
    num_models = _read_only(lambda self: len(self._private_models), "int",
                            "N, the number of private models.")
    vocabulary_size = _read_only(lambda self: self._vocabulary_size, "int")

    # -- privacy -------------------------------------------------------------
    def rdp(self, orders: Sequence[float] | None = None) -> np.ndarray:
        """Per-token RDP ``eps(a)`` at ``orders`` (default: dp_accounting's grid); ``inf``
        above ``alpha``."""
        return renyi.per_token_rdp(self._beta, self._alpha, self.num_models, orders)

    def epsilon_per_sequence(self, num_tokens: int, delta: float,
                             orders: Sequence[float] | None = None) -> float:
        """Epsilon at ``delta`` of ``num_tokens`` sampled tokens (RDP summed over tokens
        at the RDP ``orders``, default ``renyi.DEFAULT_ORDERS``, converted with
        dp_accounting). Charge the maximum number of new tokens."""
        return renyi.sequence_epsilon(self._beta, self._alpha, self.num_models,
                                      num_tokens, delta, orders)

    # -- the distributions ---------------------------------------------------
    def _public_weights(self, public_logits):
        z = ops.cast(public_logits, "float64") / self.temperature
        p = ops.softmax(z, axis=-1)
        p = ops.where(ops.isnan(p), ops.zeros_like(p), p)
        size = public_logits.shape[-1]
        floor = max(1, math.floor(self._public_floor * _QUANT_SCALE / int(size)))
        w = ops.floor(p * ((1.0 - self._public_floor) * _QUANT_SCALE))
        return ops.cast(w, "int64") + floor

    def _private_weights(self, private_logits, public_weights):
        z = ops.cast(private_logits, "float64") / self.temperature
        p = ops.softmax(z, axis=-1)
        p = ops.where(ops.isnan(p), ops.zeros_like(p), p)
        w = ops.cast(ops.floor(p * _QUANT_SCALE), "int64")
        total = ops.sum(w, axis=-1, keepdims=True)
        # A row with no mass at all (non-finite logits): use the public row. Any
        # private distribution is allowed by the analysis.
        return ops.where(total > 0, w, public_weights[None])

    def _in_ball(self, lam, p, p0, log_p0, target):
        a = 2.0 * self._alpha
        b = 2.0 * self._alpha - 1.0
        lam = lam[..., None]
        p_hat = lam * p + (1.0 - lam) * p0
        log_p_hat = ops.log(p_hat)
        forward = _logsumexp(a * log_p_hat + (1.0 - a) * log_p0) / (a - 1.0)
        backward = _logsumexp(b * log_p0 + (1.0 - b) * log_p_hat) / (b - 1.0)
        return ops.logical_and(forward <= target, backward <= target)

    def _prepare(self, public_logits, private_logits):
        """(w0 [B,V], w [N,B,V], lam [N,B] float64 dyadic) for one step."""
        public_logits = ops.convert_to_tensor(public_logits)
        private_logits = ops.convert_to_tensor(private_logits)
        if len(public_logits.shape) != 2 or len(private_logits.shape) != 3:
            raise ValueError(
                "Expected public logits of shape (batch, vocabulary) and private logits "
                f"of shape (num_models, batch, vocabulary); got {public_logits.shape} and "
                f"{private_logits.shape}.")
        if public_logits.shape[-1] != private_logits.shape[-1] or (
                private_logits.shape[0] is not None
                and int(private_logits.shape[0]) != self.num_models):
            raise ValueError(
                f"Mismatched logits: public {public_logits.shape}, private "
                f"{private_logits.shape} for {self.num_models} private model(s); the "
                "public and private models must share one vocabulary.")
        w0 = self._public_weights(public_logits)
        w = self._private_weights(private_logits, w0)
        p0 = ops.cast(w0, "float64") / ops.cast(ops.sum(w0, axis=-1, keepdims=True), "float64")
        p = ops.cast(w, "float64") / ops.cast(ops.sum(w, axis=-1, keepdims=True), "float64")
        p0 = p0[None]
        log_p0 = ops.log(p0)
        shape = ops.shape(p)[:-1]
        target = renyi.ball_target(self._beta)
        if target <= 0:
            lam = ops.zeros(shape, dtype="float64")
        else:
            hi = ops.ones(shape, dtype="float64")
            lo = ops.where(self._in_ball(hi, p, p0, log_p0, target), hi, ops.zeros_like(hi))

            def step(_, bounds):
                lo, hi = bounds
                mid = 0.5 * (lo + hi)
                ok = self._in_ball(mid, p, p0, log_p0, target)
                return ops.where(ok, mid, lo), ops.where(ok, hi, mid)

            lam, _ = ops.fori_loop(0, renyi.BISECTION_STEPS, step, (lo, hi))
        return w0, w, lam

    def projection_weights(self, public_logits: np.ndarray | tf.Tensor,
                           private_logits: np.ndarray | tf.Tensor) -> tf.Tensor:
        """``lam_i`` per private model and row (float64, shape ``(N, batch)``): the
        exact weights the draws use.

        ``public_logits``: ``(batch, V)``; ``private_logits``: ``(N, batch, V)``."""
        return self._prepare(public_logits, private_logits)[2]

    def mixture_probabilities(self, public_logits: np.ndarray | tf.Tensor,
                              private_logits: np.ndarray | tf.Tensor) -> tf.Tensor:
        """The distribution a token is drawn from, ``(1/N) sum_i p_hat_i`` (float64,
        ``(batch, V)``), for ``public_logits`` ``(batch, V)`` and ``private_logits``
        ``(N, batch, V)``, built from the integer weights the draw uses (up to the
        ``<= 2**-29`` relative modulo bias of the draw)."""
        w0, w, lam = self._prepare(public_logits, private_logits)
        p0 = ops.cast(w0, "float64") / ops.cast(ops.sum(w0, axis=-1, keepdims=True), "float64")
        p = ops.cast(w, "float64") / ops.cast(ops.sum(w, axis=-1, keepdims=True), "float64")
        lam = lam[..., None]
        return ops.mean(lam * p + (1.0 - lam) * p0[None], axis=0)

    def draw(self, public_logits: np.ndarray | tf.Tensor,
             private_logits: np.ndarray | tf.Tensor) -> tf.Tensor:
        """One token per row (int32, ``(batch,)``) from :meth:`mixture_probabilities` of
        ``public_logits`` and ``private_logits``, in integer arithmetic (module notes)."""
        w0, w, lam = self._prepare(public_logits, private_logits)
        batch = ops.shape(w0)[0]
        n = self.num_models
        threshold = ops.cast(ops.floor(lam * float(_WORD_RANGE)), "int64")   # (N, B)

        def word():
            return keras.random.randint((batch,), 0, _WORD_RANGE, dtype="int64",
                                        seed=self.seed_generator)

        model = ops.mod(word(), n)                                           # (B,)
        choice = ops.cast(ops.one_hot(model, n, axis=0), "int64")            # (N, B)
        use_private = word() < ops.sum(threshold * choice, axis=0)
        private_row = ops.sum(w * choice[..., None], axis=0)                 # (B, V)
        weights = ops.where(use_private[:, None], private_row, w0)
        cumulative = ops.cumsum(weights, axis=-1)
        u = ops.mod(word(), cumulative[:, -1])
        token = ops.sum(ops.cast(cumulative <= u[:, None], "int32"), axis=-1)
        return token

    def get_next_token(self, probabilities: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError(
            "PublicMixtureSampler draws from several models' logits: use `draw(public_logits, "
            "private_logits)`, or `causal_lm.generate` after `compile(sampler=...)`.")

    # -- the decoding loop ---------------------------------------------------
    def _slots(self, model):
        """The models in order (public first) and which slot is the compiled model."""
        public = self._public_model if self._public_model is not None else model
        if public is None:
            raise ValueError(
                "PublicMixtureSampler has no public model: pass `public_model=` or compile "
                "it on the public model (`public_lm.compile(sampler=...)`).")
        _check_causal_lm(public, "the public model")
        models = [public] + list(self._private_models)
        if self._public_model is None:
            if any(public is m for m in self._private_models):
                raise ValueError(
                    "PublicMixtureSampler was compiled on one of its private models but "
                    "has no `public_model`: pass `public_model=` (it must never have "
                    "seen private data).")
            names = ["the compiled (public) model"] + [
                f"private_models[{k}]" for k in range(self.num_models)]
            _check_same_vocabulary(models, names)
        host = next((k for k, m in enumerate(models) if m is model), None)
        if model is not None and host is None:
            raise ValueError(
                "Compile PublicMixtureSampler on its public model or on one of its private "
                "models (the tokenizer of the compiled model encodes the prompts).")
        return models, host

    def __call__(self, next, prompt, cache=None, index=0, mask=None, stop_token_ids=None,
                 hidden_states=None, model=None, **kwargs):
        if keras.config.backend() != "tensorflow":
            raise NotImplementedError(
                "PublicMixtureSampler runs on the TensorFlow backend only (it calls "
                "several models inside one generate loop).")
        models, host = self._slots(model)
        max_length = ops.cast(ops.shape(prompt)[-1], "int32")
        index = ops.cast(index, "int32")
        mask = ops.zeros_like(prompt, dtype="bool") if mask is None else ops.cast(mask, "bool")
        caches = []
        for k, m in enumerate(models):
            if k == host and cache is not None:
                caches.append(cache)
            else:
                caches.append(m._build_cache(prompt)[1])
        use_next = [k == host and cache is not None for k in range(len(models))]

        def cond(prompt, caches, index, mask):
            if stop_token_ids is None:
                return ops.convert_to_tensor(True, dtype="bool")
            end_tokens = _any_equal(prompt, stop_token_ids, ops.logical_not(mask))
            return ops.logical_not(ops.all(ops.any(end_tokens, axis=-1)))

        def body(prompt, caches, index, mask):
            logits, new_caches = [], []
            for k, m in enumerate(models):
                if use_next[k]:
                    step_logits, _, step_cache = next(prompt, caches[k], index)
                else:
                    batch = ops.shape(prompt)[0]
                    token = ops.slice(prompt, [0, index - 1], [batch, 1])
                    step_logits, _, step_cache = m.call_with_cache(token, caches[k], index - 1)
                    step_logits = ops.squeeze(step_logits, axis=1)
                logits.append(step_logits)
                new_caches.append(step_cache)
            sizes = {int(x.shape[-1]) for x in logits if x.shape[-1] is not None}
            if len(sizes) != 1 or sizes != {self._vocabulary_size}:
                raise ValueError(
                    f"PublicMixtureSampler: the models' logits have sizes "
                    f"{[x.shape[-1] for x in logits]}; all must be the shared vocabulary "
                    f"size {self._vocabulary_size}.")
            next_token = self.draw(logits[0], ops.stack(logits[1:], axis=0))
            next_token = ops.cast(next_token, prompt.dtype)
            next_token = ops.where(mask[:, index], prompt[:, index], next_token)
            prompt = ops.slice_update(prompt, [0, index], next_token[:, None])
            return prompt, tuple(new_caches), index + 1, mask

        prompt, _, _, _ = self.run_loop(
            cond, body, loop_vars=(prompt, tuple(caches), index, mask),
            maximum_iterations=(max_length - index), model=model)
        return prompt

    # -- serialization ---------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Hyperparameters only: models (and their weights) are not part of a config."""
        config = super().get_config()
        config.update({"beta": self._beta, "alpha": self._alpha,
                       "public_floor": self._public_floor, "seed": self.seed,
                       "num_private_models": self.num_models})
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], private_models: Sequence[CausalLM] | None = None,
                    public_model: CausalLM | None = None) -> PublicMixtureSampler:
        """Rebuild from :meth:`get_config`; the models must be passed again:
        ``PublicMixtureSampler.from_config(config, private_models=[...], public_model=...)``."""
        config = dict(config)
        count = config.pop("num_private_models", None)
        private_models = config.pop("private_models", private_models)
        public_model = config.pop("public_model", public_model)
        if private_models is None:
            raise ValueError(
                "A PublicMixtureSampler config holds no models: call "
                "`PublicMixtureSampler.from_config(config, private_models=[...], "
                "public_model=...)` with the private models (and the public one unless it "
                "is the compiled model).")
        if count is not None and len(private_models) != int(count):
            raise ValueError(
                f"The config was saved with {count} private model(s); got "
                f"{len(private_models)}.")
        return cls(private_models=private_models, public_model=public_model, **config)

    def __repr__(self):
        return (f"PublicMixtureSampler(num_private_models={self.num_models}, "
                f"beta={self._beta!r}, alpha={self._alpha!r}, "
                f"public_floor={self._public_floor!r}, temperature={self.temperature!r}, "
                f"seed={self.seed!r})")
