"""Rényi-divergence arithmetic for :class:`PublicMixtureSampler` (plain NumPy, no TensorFlow).

What is here (the mechanism and its proof are in :mod:`keras_dp_lm.samplers.public_mixture`):

- :func:`renyi_divergence`: ``D_a(P || Q)`` of two discrete distributions, in float64.
- :func:`project_to_ball`: the float64 reference of the sampler's projection
  ``p_hat = lam * p + (1 - lam) * p0`` with the largest ``lam`` in the ball, by the
  same bisection (same steps, same safety margin) as the traced sampler.
- :func:`per_token_rdp`: the data-independent per-token RDP curve ``eps(a)`` of the
  mechanism at a list of orders.
- :func:`epsilon_for_rdp`: ``(eps, delta)`` of an RDP curve, by dp_accounting's
  conversion (``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon``).
- :func:`sequence_epsilon`, :func:`beta_for_epsilon`: ``eps`` of ``T`` tokens at
  ``delta``, and the ball radius ``beta`` for a target ``eps`` per ``T`` tokens;
  :func:`ball_for_epsilon` also picks the order ``alpha``.
- :func:`pure_dp_rdp`: the RDP curve of a pure ``eps``-DP mechanism, so pure
  charges (``DPSampler``) and RDP charges share one ledger.

Example (a ball radius for epsilon 8 per 64-token sequence at delta 1e-6, 4 models):
    >>> beta = beta_for_epsilon(8.0, delta=1e-6, num_tokens=64, num_models=4, alpha=8.0)
    >>> round(beta, 4), sequence_epsilon(beta, 8.0, 4, 64, 1e-6) <= 8.0
    (0.1137, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

# -- constants shared by the traced sampler and this reference ---------------

#: Orders :func:`ball_for_epsilon` chooses the ball's order from.
BALL_ALPHAS = (3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)

#: Orders of the RDP ledger unless told otherwise: dp_accounting's default grid plus
#: :data:`BALL_ALPHAS` (a ball's own order is where its curve is best converted).
DEFAULT_ORDERS = tuple(sorted(
    {float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS} | set(BALL_ALPHAS)))

#: Bisection steps of the projection: ``lam`` is rounded DOWN to a multiple of
#: 2**-16 (the bisection's lower end is always inside the ball, so fewer steps
#: only give up at most 2**-16 of the private weight, never privacy). 16 steps
#: instead of 40 make jit ``generate`` at GPT-2-124M size ~1.2x the private
#: model alone instead of 1.38x (benchmarks/dp_decoding_utility.py).
BISECTION_STEPS = 16

#: The projection checks its computed divergences against ``beta * (1 - 1e-6) - 1e-12``
#: (float64), so rounding in the divergence sums cannot take the exact divergence
#: above ``beta`` (float64 rounding there is ~1e-13 relative; see the module notes).
RELATIVE_MARGIN = 1e-6
ABSOLUTE_MARGIN = 1e-12

#: Distributions are drawn from integer weights ``floor(p * 2**QUANT_BITS)``; every
#: weight total is below ``2 ** (QUANT_BITS + 1)``.
QUANT_BITS = 32

#: Integer draws use 62-bit uniform words reduced modulo the total: a total ``W``
#: biases each outcome by a factor within ``1 +- W / 2**62``.
RANDOM_BITS = 62

#: The largest ball order accepted (2 * alpha is the order of the projection's
#: forward divergence; beyond this the float64 sums lose their margin).
MAX_ALPHA = 256.0


def _check_beta(beta):
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(beta)) or float(beta) <= 0:
        raise ValueError(
            f"`beta` (the Rényi ball radius) must be a finite number > 0. Received: {beta!r}")
    return float(beta)


def _check_alpha(alpha):
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(alpha)) or not (1.0 < float(alpha) <= MAX_ALPHA):
        raise ValueError(
            f"`alpha` (the RDP order of the ball) must be a number in (1, {MAX_ALPHA:g}]. "
            f"Received: {alpha!r}")
    return float(alpha)


def _check_num_models(num_models):
    if isinstance(num_models, bool) or not isinstance(num_models, (int, np.integer)) \
            or int(num_models) < 1:
        raise ValueError(f"`num_models` must be an integer >= 1. Received: {num_models!r}")
    return int(num_models)


def _check_delta(delta):
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.floating, np.integer)) \
            or not (0.0 < float(delta) < 1.0):
        raise ValueError(f"`delta` must be a number in (0, 1). Received: {delta!r}")
    return float(delta)


def _check_orders(orders):
    orders = np.asarray(DEFAULT_ORDERS if orders is None else orders, dtype="float64")
    if orders.ndim != 1 or orders.size == 0 or not np.all(np.isfinite(orders)) \
            or np.any(orders <= 1.0):
        raise ValueError(
            f"`orders` must be a non-empty 1-D list of finite RDP orders > 1. Received: {orders!r}")
    return orders


def ball_target(beta):
    """What the projection compares its computed divergences with: ``beta`` minus the margin.

    Example:
        >>> ball_target(1.0)
        0.999998999999
    """
    beta = _check_beta(beta)
    return beta * (1.0 - RELATIVE_MARGIN) - ABSOLUTE_MARGIN


def renyi_divergence(p: ArrayLike, q: ArrayLike, alpha: float) -> np.ndarray:
    """``D_alpha(p || q) = log(sum p**alpha * q**(1 - alpha)) / (alpha - 1)``, float64.

    ``alpha > 1`` (``math.inf`` gives ``log max p / q``). Works on the last axis;
    ``+inf`` where ``p`` has mass that ``q`` has not.

    Example:
        >>> round(float(renyi_divergence([0.5, 0.5], [0.25, 0.75], 2.0)), 6)  # log(4/3)
        0.287682
    """
    p = np.asarray(p, dtype="float64")
    q = np.asarray(q, dtype="float64")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_p, log_q = np.log(p), np.log(q)
        if alpha == math.inf:
            ratio = np.where(p > 0, log_p - log_q, -np.inf)
            return np.max(ratio, axis=-1)
        alpha = float(alpha)
        if not alpha > 1.0:
            raise ValueError(f"`alpha` must be > 1. Received: {alpha!r}")
        terms = np.where(p > 0, alpha * log_p + (1.0 - alpha) * log_q, -np.inf)
        return _logsumexp(terms) / (alpha - 1.0)


def _logsumexp(x):
    m = np.max(x, axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.sum(np.exp(x - m_safe), axis=-1)
        out = np.log(s) + np.squeeze(m_safe, -1)
    return np.where(np.squeeze(np.isposinf(m), -1), np.inf, out)


def ball_divergences(p_hat, p0, alpha):
    """``(D_{2 alpha}(p_hat || p0), D_{2 alpha - 1}(p0 || p_hat))``: what the ball bounds."""
    alpha = _check_alpha(alpha)
    return (renyi_divergence(p_hat, p0, 2.0 * alpha),
            renyi_divergence(p0, p_hat, 2.0 * alpha - 1.0))


def _in_ball(lam, p, p0, alpha, target):
    p_hat = lam[..., None] * p + (1.0 - lam[..., None]) * p0
    forward, backward = ball_divergences(p_hat, p0, alpha)
    return (forward <= target) & (backward <= target)


def project_to_ball(p, p0, beta, alpha, steps=BISECTION_STEPS):
    """Largest ``lam`` (a multiple of ``2**-steps``) with ``lam * p + (1 - lam) * p0`` in the ball.

    The ball: ``D_{2 alpha}(p_hat || p0) <= beta`` and ``D_{2 alpha - 1}(p0 || p_hat) <= beta``,
    checked (float64) against :func:`ball_target`. Both divergences grow
    monotonically with ``lam`` (see :mod:`~keras_dp_lm.samplers.public_mixture`),
    so bisection from ``lam = 0`` (``p_hat = p0``, divergence 0) finds it. Works on
    the last axis (batched rows). This is the float64 reference of the traced
    sampler's projection (same steps and margin). ``p0`` must be positive.

    Returns ``(lam, p_hat)``.

    Example:
        >>> lam, p_hat = project_to_ball([1.0, 0.0, 0.0], [0.5, 0.25, 0.25], beta=0.05, alpha=2)
        >>> round(float(lam), 4), [round(float(x), 4) for x in p_hat]
        (0.1639, [0.5819, 0.209, 0.209])
    """
    p = np.asarray(p, dtype="float64")
    p0 = np.asarray(p0, dtype="float64")
    if p.shape[-1] != p0.shape[-1]:
        raise ValueError(
            f"`p` and `p0` must have the same vocabulary size; got {p.shape[-1]} and "
            f"{p0.shape[-1]}.")
    if not np.all(p0 > 0):
        raise ValueError("`p0` (the public distribution) must be positive everywhere.")
    target = ball_target(beta)
    alpha = _check_alpha(alpha)
    batch = np.broadcast_shapes(p.shape, p0.shape)[:-1]
    lo = np.zeros(batch)
    hi = np.ones(batch)
    if target > 0:
        whole = _in_ball(hi, p, p0, alpha, target)
        lo = np.where(whole, 1.0, lo)
        for _ in range(int(steps)):
            mid = 0.5 * (lo + hi)
            ok = _in_ball(mid, p, p0, alpha, target)
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid)
    lam = lo
    return lam, lam[..., None] * p + (1.0 - lam[..., None]) * p0


def _formula(order, beta, num_models):
    """(1/(a-1)) log(1 - 1/N + exp((2a - 3/2) beta) / N): the bound at one order ``a``."""
    x = (2.0 * order - 1.5) * beta
    if num_models == 1:
        log_mgf = x
    else:
        log_mgf = np.logaddexp(math.log1p(-1.0 / num_models), x - math.log(num_models))
    return log_mgf / (order - 1.0)


def sampling_slack(order, num_models):
    """RDP added at order ``a`` for the integer draws' modulo bias (about 4e-9 per token).

    Every realised probability is within a factor ``[lo, hi]`` of the exact mixture,
    ``hi = (1 + N/2**62)(1 + 2**-29)``, ``lo = (1 - N/2**62)(1 - 2**-29)``, so
    ``D_a`` grows by at most ``a/(a-1) log hi - log lo``.
    """
    d_model = num_models / 2.0 ** RANDOM_BITS
    d_token = 2.0 ** (QUANT_BITS + 1) / 2.0 ** RANDOM_BITS
    log_hi = math.log1p(d_model) + math.log1p(d_token)
    log_lo = math.log1p(-d_model) + math.log1p(-d_token)
    return order / (order - 1.0) * log_hi - log_lo


def per_token_rdp(beta: float, alpha: float, num_models: int,
                  orders: Sequence[float] | None = None) -> np.ndarray:
    """The RDP curve ``eps(a)`` of one token of :class:`PublicMixtureSampler`.

    For orders ``1 < a <= alpha``::

        eps(a) = min over a' in [a, alpha] of  log(1 - 1/N + exp((2a' - 3/2) beta) / N) / (a' - 1)
                 + sampling_slack(a, N)

    (``a'`` ranges over ``orders`` and ``alpha``; N is ``num_models``, the private
    models) and ``inf`` above ``alpha``. ``orders`` None: :data:`DEFAULT_ORDERS`.
    The proof is in :mod:`keras_dp_lm.samplers.public_mixture`.

    Example (one private model: the bound is flat at its value at ``alpha``):
        >>> [round(float(e), 6) for e in per_token_rdp(0.1, alpha=4, num_models=1,
        ...                                             orders=[2, 3, 4, 5])]
        [0.216667, 0.216667, 0.216667, inf]
    """
    beta = _check_beta(beta)
    alpha = _check_alpha(alpha)
    num_models = _check_num_models(num_models)
    orders = _check_orders(orders)
    candidates = np.unique(np.concatenate([orders[orders <= alpha], [alpha]]))
    values = np.array([_formula(a, beta, num_models) for a in candidates])
    out = np.full(orders.shape, np.inf)
    for k, a in enumerate(orders):
        if a <= alpha:
            out[k] = np.min(values[candidates >= a]) + sampling_slack(a, num_models)
    return out


def pure_dp_rdp(epsilon, orders=None):
    """RDP curve of a pure ``epsilon``-DP mechanism: ``min(epsilon, a * epsilon**2 / 2)``.

    ``epsilon``-DP implies ``(a, epsilon)``-RDP (Mironov 2017, Prop. 3) and
    ``epsilon**2 / 2``-zCDP, i.e. ``(a, a epsilon**2 / 2)``-RDP (Bun & Steinke 2016,
    Prop. 3.3).

    Example:
        >>> [float(e) for e in pure_dp_rdp(0.5, orders=[2, 8])]
        [0.25, 0.5]
    """
    if isinstance(epsilon, bool) or not math.isfinite(float(epsilon)) or float(epsilon) < 0:
        raise ValueError(f"`epsilon` must be a finite number >= 0. Received: {epsilon!r}")
    orders = _check_orders(orders)
    epsilon = float(epsilon)
    return np.minimum(epsilon, orders * epsilon ** 2 / 2.0)


def epsilon_for_rdp(orders: Sequence[float] | None, rdp: ArrayLike,
                    delta: float) -> tuple[float, float]:
    """``(epsilon, best_order)`` of an RDP curve at ``delta``, by dp_accounting's conversion.

    ``orders``: the RDP orders (each > 1; None: :data:`DEFAULT_ORDERS`); ``rdp``:
    the curve, one non-negative value per order.

    Example:
        >>> eps, order = epsilon_for_rdp([2.0, 4.0, 8.0], [0.1, 0.2, 0.4], 1e-5)
        >>> round(eps, 4), order
        (1.6141, 8.0)
    """
    delta = _check_delta(delta)
    orders = _check_orders(orders)
    rdp = np.asarray(rdp, dtype="float64")
    if rdp.shape != orders.shape or np.any(np.isnan(rdp)) or np.any(rdp < 0):
        raise ValueError(
            f"`rdp` must be non-negative, one value per order ({orders.size}). Received: {rdp!r}")
    epsilon, order = rdp_privacy_accountant.compute_epsilon(
        list(orders), list(rdp), delta)
    return float(epsilon), float(order)


def sequence_epsilon(beta: float, alpha: float, num_models: int, num_tokens: int, delta: float,
                     orders: Sequence[float] | None = None) -> float:
    """Epsilon at ``delta`` of ``num_tokens`` tokens (RDP composed: ``num_tokens * eps(a)``).

    ``eps(a)`` is :func:`per_token_rdp` of a :class:`PublicMixtureSampler` with
    ball radius ``beta`` (> 0) at order ``alpha`` and ``num_models`` private
    models, converted at ``orders`` (None: :data:`DEFAULT_ORDERS`) plus ``alpha``.

    Example:
        >>> round(sequence_epsilon(0.05, alpha=8, num_models=1, num_tokens=64, delta=1e-6), 3)
        8.172
    """
    orders = _check_orders(orders)
    if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or int(num_tokens) < 0:
        raise ValueError(f"`num_tokens` must be an integer >= 0. Received: {num_tokens!r}")
    alpha = _check_alpha(alpha)
    orders = np.unique(np.concatenate([orders, [alpha]]))
    if int(num_tokens) == 0:
        return 0.0
    rdp = int(num_tokens) * per_token_rdp(beta, alpha, num_models, orders)
    return epsilon_for_rdp(orders, rdp, delta)[0]


def beta_for_epsilon(epsilon: float, delta: float, num_tokens: int, num_models: int = 1,
                     alpha: float = 8.0, orders: Sequence[float] | None = None) -> float:
    """The largest ball radius ``beta`` whose ``num_tokens``-token sequences are (eps, delta)-DP.

    Bisection (``sequence_epsilon`` grows with ``beta``) to a relative 1e-9, returning
    a ``beta`` that never overspends. ``alpha`` is a tuning knob: a small ``alpha``
    lets the projection keep more of the private models (its divergences are
    lower-order), a large one converts to ``(eps, delta)`` more cheaply; 4-16 is a
    reasonable range. Raises ``ValueError`` if even a vanishing ``beta`` cannot
    reach ``epsilon`` (the conversion's ``log(1/delta)/(alpha-1)`` term alone exceeds it).
    ``num_models``: the private models of the sampler (N); ``orders``: the RDP
    orders of the conversion (None: :data:`DEFAULT_ORDERS`).

    Example:
        >>> beta = beta_for_epsilon(8.0, delta=1e-6, num_tokens=64, num_models=1, alpha=8)
        >>> round(beta, 5), sequence_epsilon(beta, 8, 1, 64, 1e-6) <= 8.0
        (0.04871, True)
    """
    if isinstance(epsilon, bool) or not math.isfinite(float(epsilon)) or float(epsilon) <= 0:
        raise ValueError(f"`epsilon` must be a finite number > 0. Received: {epsilon!r}")
    epsilon = float(epsilon)
    _check_delta(delta)
    alpha = _check_alpha(alpha)
    num_models = _check_num_models(num_models)
    if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or int(num_tokens) < 1:
        raise ValueError(f"`num_tokens` must be an integer >= 1. Received: {num_tokens!r}")

    def cost(b):
        return sequence_epsilon(b, alpha, num_models, int(num_tokens), delta, orders)

    lo = 1e-12
    if cost(lo) > epsilon:
        raise ValueError(
            f"epsilon={epsilon} at delta={delta} is out of reach for {num_tokens} tokens at "
            f"alpha={alpha}: even beta -> 0 costs {cost(lo):.4g}. Use a larger alpha, a "
            f"larger delta or fewer tokens.")
    hi = 1.0
    while cost(hi) <= epsilon:
        lo, hi = hi, 2.0 * hi
        if hi > 1e6:
            return lo
    while (hi - lo) > 1e-9 * lo:
        mid = 0.5 * (lo + hi)
        if cost(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo



def _proxy_pair(vocabulary_size=256):
    """A fixed public pair (no private data): Zipf ``p0`` and a private ``p`` that
    half agrees with it and half ranks the vocabulary backwards."""
    ranks = np.arange(1, vocabulary_size + 1, dtype="float64")
    p0 = 1.0 / ranks
    p0 /= p0.sum()
    p = 0.5 * p0 + 0.5 * p0[::-1]
    return p, p0


def ball_for_epsilon(epsilon: float, delta: float, num_tokens: int, num_models: int = 1,
                     alphas: Sequence[float] = BALL_ALPHAS,
                     orders: Sequence[float] | None = None) -> tuple[float, float]:
    """``(alpha, beta)`` for a target ``(epsilon, delta)`` per ``num_tokens`` tokens.

    For each order in ``alphas`` that can reach ``epsilon``, ``beta`` is
    :func:`beta_for_epsilon`'s; the order kept is the one whose ball lets a fixed,
    public proxy private distribution (half Zipf like the public one, half
    reversed) keep the largest weight ``lam``: a utility heuristic that uses no
    data. The guarantee holds for any choice. ``num_models`` and ``orders`` are
    passed to :func:`beta_for_epsilon`.

    Example:
        >>> alpha, beta = ball_for_epsilon(8.0, delta=1e-6, num_tokens=64, num_models=4)
        >>> alpha, round(beta, 4)
        (3.0, 0.0521)
    """
    p, p0 = _proxy_pair()
    best = None
    for alpha in alphas:
        try:
            beta = beta_for_epsilon(epsilon, delta, num_tokens, num_models, alpha, orders)
        except ValueError as error:
            if "out of reach" in str(error):
                continue
            raise
        lam = float(project_to_ball(p, p0, beta, alpha, steps=30)[0])
        if best is None or lam > best[0]:
            best = (lam, float(alpha), beta)
    if best is None:
        raise ValueError(
            f"epsilon={epsilon} at delta={delta} is out of reach for {num_tokens} tokens "
            f"at every order in {tuple(alphas)}.")
    return best[1], best[2]
