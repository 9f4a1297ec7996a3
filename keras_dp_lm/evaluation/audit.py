"""One-run privacy audit (Steinke, Nasr, Jagielski 2023): an epsilon lower bound."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.special
import scipy.stats

from keras_dp_lm.evaluation.scoring import as_log_likelihood_fn

if TYPE_CHECKING:
    import keras_hub
    from numpy.typing import ArrayLike


def audit_p_value(num_examples: int, num_guesses: int, num_correct: int, epsilon: float,
                  delta: float = 0.0) -> float:
    """P-value of ``num_correct`` or more correct guesses under (eps, delta)-DP.

    The one-run audit's null hypothesis: the training algorithm is
    (``epsilon``, ``delta``)-DP, ``num_examples`` canaries were each included with
    probability 1/2, and the auditor made ``num_guesses`` guesses (abstaining on the
    rest). With ``q = e^eps / (1 + e^eps)``:

    * ``delta = 0``: the correct-guess count is stochastically dominated by
      ``Binomial(num_guesses, q)``, so ``p = P[Binomial(r, q) >= v]``.
    * ``delta > 0``: the paper's Theorem adds ``2 m delta`` times
      ``max_{1 <= i <= v} P[v - i <= Binomial(r, q) < v] / i``
      (the (eps, delta) form of the main theorem of Steinke, Nasr, Jagielski 2023,
      computed as in their Appendix D).

    Returns the p-value clipped to [0, 1].
    """
    m, r, v = int(num_examples), int(num_guesses), int(num_correct)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= num_correct <= num_guesses <= num_examples, "
                         f"got {v}, {r}, {m}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError("need epsilon >= 0 and 0 <= delta <= 1")
    q = float(scipy.special.expit(epsilon))
    p = float(scipy.stats.binom.sf(v - 1, r, q))
    if delta > 0 and v > 0:
        # P[v - i <= B < v] for i = 1..v, as a running sum of pmf(v-1), pmf(v-2), ...
        pmf = scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
        window = np.cumsum(pmf) / np.arange(1, v + 1)
        p += 2.0 * m * delta * float(np.max(window))
    return min(max(p, 0.0), 1.0)


def audit_lower_bound(num_guesses: int, num_correct: int, confidence: float = 0.95,
                      delta: float = 0.0, num_examples: int | None = None,
                      tol: float = 1e-6) -> float:
    """Epsilon lower bound from a one-run audit, valid with probability ``confidence``.

    The largest ``eps`` whose null hypothesis "(eps, delta)-DP" is rejected at level
    ``beta = 1 - confidence`` by :func:`audit_p_value`: with probability at least
    ``confidence`` over the canary coin flips and the training randomness, an
    algorithm that really is (eps, delta)-DP yields a bound ``<= eps``. Returns 0
    when the guesses give no evidence (e.g. right only about half the time).

    Args:
        num_guesses: ``r``, the guesses made (abstentions excluded).
        num_correct: ``v``, the correct ones.
        confidence: ``1 - beta``.
        delta: the delta of the DP claim under test. ``delta > 0`` uses the paper's
            delta-adjusted p-value and needs ``num_examples`` (``m``, all canaries,
            guessed or not); with ``delta = 0`` the bound is for pure eps-DP.
        num_examples: ``m``; defaults to ``num_guesses`` (only allowed for delta=0).
        tol: the bisection stops when the bracket on epsilon is narrower than
            this; the returned lower end is never above the exact bound.
    """
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    if num_examples is None:
        if delta > 0:
            raise ValueError("delta > 0 needs num_examples (all canaries, m)")
        num_examples = num_guesses
    beta = 1.0 - confidence

    def pval(eps):
        return audit_p_value(num_examples, num_guesses, num_correct, eps, delta)

    if pval(0.0) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while pval(hi) < beta:
        lo, hi = hi, hi * 2.0
        if hi > 1e4:
            return float("inf")
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if pval(mid) < beta:
            lo = mid
        else:
            hi = mid
    return float(lo)


@dataclasses.dataclass
class AuditResult:
    """Outcome of :func:`one_run_audit`.

    Attributes:
        epsilon_lower_bound: the audited epsilon lower bound
            (:func:`audit_lower_bound`; 0 without evidence, ``inf`` beyond 1e4).
        num_canaries: ``m``, all canaries scored.
        num_included: how many of them were in the training data.
        k_plus: guesses "included" (the highest scores).
        k_minus: guesses "excluded" (the lowest scores).
        num_guesses: ``r = k_plus + k_minus``.
        num_correct: ``v``, the correct guesses.
        confidence: the probability with which the bound holds.
        delta: the delta of the DP claim tested (0: pure epsilon-DP).
    """

    epsilon_lower_bound: float
    num_canaries: int
    num_included: int
    k_plus: int
    k_minus: int
    num_guesses: int
    num_correct: int
    confidence: float
    delta: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def one_run_audit(scores: ArrayLike, included_mask: ArrayLike, k_plus: int,
                  k_minus: int | None = None, confidence: float = 0.95,
                  delta: float = 0.0) -> AuditResult:
    """One-run privacy audit from per-canary membership scores.

    Args:
        scores: one score per canary, higher = more likely trained on (e.g. the
            canary's log-likelihood under the trained model minus that under a
            reference model).
        included_mask: booleans, True where the canary was in the training data. The
            audit is only valid if each entry was drawn independently with
            probability 1/2 *before* training.
        k_plus: guess the ``k_plus`` highest scores as included.
        k_minus: guess the ``k_minus`` lowest scores as excluded (default ``k_plus``).
        confidence, delta: as in :func:`audit_lower_bound`. ``delta = 0`` tests a
            pure eps-DP claim; training with DP-SGD is only (eps, delta)-DP, so pass
            the accountant's delta to get the paper's delta-adjusted bound (it is
            smaller). Choose ``k_plus``/``k_minus`` before looking at the results;
            trying several and keeping the best voids the confidence level.

    Returns:
        :class:`AuditResult`.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    mask = np.asarray(included_mask, dtype=bool).reshape(-1)
    if scores.shape != mask.shape:
        raise ValueError("scores and included_mask need the same length")
    k_minus = k_plus if k_minus is None else k_minus
    k_plus, k_minus = int(k_plus), int(k_minus)
    m = scores.size
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus + k_minus <= {m} canaries")
    # Ties are broken by canary index, which is fixed before the inclusion coins
    # are flipped, so the tie-break carries no information about them.
    order = np.argsort(-scores, kind="stable")
    guessed_in = order[:k_plus]
    guessed_out = order[m - k_minus:] if k_minus else order[:0]
    correct = int(mask[guessed_in].sum() + (~mask[guessed_out]).sum())
    r = k_plus + k_minus
    eps = audit_lower_bound(r, correct, confidence=confidence, delta=delta,
                            num_examples=m)
    return AuditResult(
        epsilon_lower_bound=eps, num_canaries=m, num_included=int(mask.sum()),
        k_plus=k_plus, k_minus=k_minus, num_guesses=r, num_correct=correct,
        confidence=float(confidence), delta=float(delta))


def membership_scores(
        causal_lm_or_fn: keras_hub.models.CausalLM | Callable[[list[str]], np.ndarray],
        texts: Sequence[str],
        reference: keras_hub.models.CausalLM | Callable[[list[str]], np.ndarray] | None = None,
        batch_size: int = 64, sequence_length: int | None = None) -> np.ndarray:
    """Per-text membership score: log-likelihood under the model, minus that under
    ``reference`` (a model never trained on the texts) when given. Higher = more
    likely a training member. ``causal_lm_or_fn`` (and ``reference``): a KerasHub
    CausalLM or a function texts -> log-likelihoods (:func:`as_log_likelihood_fn`);
    ``batch_size`` (texts per forward pass) and ``sequence_length`` (tokens,
    default the preprocessor's) apply to CausalLM scoring only."""
    texts = [str(t) for t in texts]
    scores = as_log_likelihood_fn(causal_lm_or_fn, batch_size, sequence_length)(texts)
    if reference is not None:
        scores = scores - as_log_likelihood_fn(reference, batch_size, sequence_length)(texts)
    return scores
