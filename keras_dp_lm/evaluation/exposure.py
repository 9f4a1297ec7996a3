"""Canary exposure: ``log2 |R| - log2 rank(canary)``, by rank or extrapolated."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.special
import scipy.stats

from keras_dp_lm.evaluation.canaries import Canary
from keras_dp_lm.evaluation.canaries import CanarySpace
from keras_dp_lm.evaluation.scoring import as_log_likelihood_fn

if TYPE_CHECKING:
    import keras_hub
    from numpy.typing import ArrayLike


@dataclasses.dataclass
class ExposureResult:
    """Exposure of one canary.

    ``exposure`` is in bits. ``rank`` (rank method) is the canary's mid-rank among the
    ``space_size`` candidates; the extrapolated method records the fitted
    ``distribution`` and its ``fit_params`` (scipy order) instead.
    ``canary_log_perplexity`` is the canary's negated log-likelihood (nats),
    ``num_candidates_scored`` the other candidates scored, and ``capped`` is
    True when the extrapolated value was cut to ``log2(space_size)``
    (``space_size`` is -1 when extrapolated without a known space).
    """

    exposure: float
    method: str
    space_size: int
    canary_log_perplexity: float
    num_candidates_scored: int
    rank: float | None = None
    distribution: str | None = None
    fit_params: tuple | None = None
    capped: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["fit_params"] is not None:
            d["fit_params"] = [float(p) for p in d["fit_params"]]
        return d


def exposure_from_log_perplexities(canary_log_perplexity: float,
                                   candidate_log_perplexities: ArrayLike, method: str = "rank",
                                   space_size: int | None = None,
                                   distribution: str = "skewnorm") -> ExposureResult:
    """Exposure from already computed log-perplexities (the math without a model).

    Args:
        canary_log_perplexity: the canary's negated log-likelihood.
        candidate_log_perplexities: those of the *other* candidates (canary excluded).
            For ``"rank"`` these must be the whole space minus the canary; for
            ``"extrapolate"`` a random sample of it.
        method: ``"rank"`` or ``"extrapolate"``.
        space_size: ``|R|``. Default for ``"rank"``: ``len(candidates) + 1``. For
            ``"extrapolate"`` it only caps the result at ``log2 |R|`` (the largest
            exposure the definition allows); ``None`` = no cap.
        distribution: ``"skewnorm"`` or ``"normal"`` (extrapolate only).

    The rank is a mid-rank: ``1 + #{lower log-perplexity} + #{ties} / 2``, so a model
    that scores every candidate alike has exposure about 1 bit, not ``log2 |R|``.
    """
    c = float(canary_log_perplexity)
    others = np.asarray(candidate_log_perplexities, dtype=np.float64).reshape(-1)
    if not np.isfinite(c) or not np.all(np.isfinite(others)):
        raise ValueError("log-perplexities must be finite")
    if method == "rank":
        size = int(space_size) if space_size is not None else others.size + 1
        if size != others.size + 1:
            raise ValueError(f"rank exposure needs all {size - 1} other candidates, "
                             f"got {others.size}")
        rank = 1.0 + np.sum(others < c) + 0.5 * np.sum(others == c)
        return ExposureResult(
            exposure=float(math.log2(size) - math.log2(rank)), method="rank",
            space_size=size, canary_log_perplexity=c,
            num_candidates_scored=int(others.size), rank=float(rank))
    if method != "extrapolate":
        raise ValueError(f"method must be 'rank' or 'extrapolate', got {method!r}")
    if others.size < 10:
        raise ValueError("extrapolation needs at least 10 candidate scores")
    if distribution == "skewnorm":
        params = scipy.stats.skewnorm.fit(others)
        log_cdf = float(scipy.stats.skewnorm.logcdf(c, *params))
        if not np.isfinite(log_cdf):  # far left tail underflows: use the normal bound
            a, loc, scale = params
            log_cdf = float(scipy.stats.norm.logcdf(c, loc, scale) + math.log(2.0))
    elif distribution in ("normal", "norm"):
        params = scipy.stats.norm.fit(others)
        log_cdf = float(scipy.stats.norm.logcdf(c, *params))
        distribution = "normal"
    else:
        raise ValueError(f"distribution must be 'skewnorm' or 'normal', got {distribution!r}")
    value = max(0.0, -log_cdf / math.log(2.0))
    capped = False
    if space_size is not None and value > math.log2(space_size):
        value, capped = math.log2(space_size), True
    return ExposureResult(
        exposure=float(value), method="extrapolate",
        space_size=int(space_size) if space_size is not None else -1,
        canary_log_perplexity=c, num_candidates_scored=int(others.size),
        distribution=distribution, fit_params=tuple(float(p) for p in params),
        capped=capped)


def exposure(causal_lm_or_logprob_fn: keras_hub.models.CausalLM | Callable[[list[str]], np.ndarray],
             canary: Canary | str, candidates_or_space: Sequence[str] | CanarySpace | None = None,
             method: str = "auto", num_samples: int = 1000, max_enumerate: int = 10_000,
             distribution: str = "skewnorm", seed: int | None = 0, batch_size: int = 64,
             sequence_length: int | None = None) -> ExposureResult:
    """Exposure of ``canary`` (a :class:`Canary` or a string) under a model.

    Args:
        causal_lm_or_logprob_fn: a KerasHub CausalLM, or a function mapping a list
            of texts to log-likelihoods.
        canary: the inserted canary.
        candidates_or_space: the candidate space ``R``: a list of texts (the canary
            is added if missing; with ``method="extrapolate"`` a list is taken as a
            random sample of ``R``), or a :class:`CanarySpace`. Default: the
            canary's own space.
        method: ``"rank"`` (score all of ``R``), ``"extrapolate"`` (fit a
            distribution to ``num_samples`` random candidates, or to the given list),
            or ``"auto"`` (rank when ``R`` has at most ``max_enumerate`` texts).
        distribution: ``"skewnorm"`` (Carlini et al.) or ``"normal"``.
        seed: seed for sampling candidates.
        batch_size, sequence_length: scoring with a CausalLM (a short
            ``sequence_length`` that still fits the canary makes scoring faster).

    Returns:
        :class:`ExposureResult`.
    """
    score = as_log_likelihood_fn(causal_lm_or_logprob_fn, batch_size=batch_size,
                                 sequence_length=sequence_length)
    text = str(canary)
    space = candidates_or_space
    if space is None:
        if not isinstance(canary, Canary):
            raise ValueError("give candidates_or_space for a plain-string canary")
        space = canary.space
    if isinstance(space, CanarySpace):
        size = space.size
        if method == "auto":
            method = "rank" if size <= max_enumerate else "extrapolate"
        if method == "rank":
            if size > max_enumerate:
                raise ValueError(f"space of {size} texts is above max_enumerate="
                                 f"{max_enumerate}; use method='extrapolate'")
            others = [t for t in space.enumerate() if t != text]
        else:
            others = space.sample(num_samples, seed=seed, exclude=[text])
    else:
        others = [str(t) for t in space if str(t) != text]
        if method == "auto":
            method = "rank"
        # A list is the whole space for the rank method, a sample of an unknown
        # space for extrapolation (then nothing caps the estimate).
        size = len(others) + 1 if method == "rank" else None
    lp = -score([text] + others)
    return exposure_from_log_perplexities(
        lp[0], lp[1:], method=method, space_size=size, distribution=distribution)
