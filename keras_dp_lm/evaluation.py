"""Empirical privacy evaluation of language models: canaries, extraction, auditing.

Three families of tests, each usable on any KerasHub ``CausalLM`` (or on a plain
function that scores texts):

* **Secret-sharer canaries** (Carlini et al., 2019, "The Secret Sharer"). Random
  secrets such as ``"my ssn is 381920"`` are inserted into the training data; after
  training, the canary's *exposure* measures how much more likely the model finds it
  than the other candidates of the same format::

      exposure = log2 |R| - log2 rank(canary)

  where ``R`` is the candidate space (all ``10**num_digits`` secrets) and the rank is
  the canary's position when ``R`` is sorted by log-perplexity (rank 1 = the most
  likely). When ``R`` is too big to score, the *extrapolated* exposure fits a
  skew-normal (or normal) distribution to the log-perplexities of random candidates
  and reports ``-log2 CDF(log-perplexity of the canary)``.
* **Extraction test**: prompt the model with the first tokens of training texts and
  greedily decode; report how often the true continuation comes out verbatim.
* **One-run privacy audit** (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with
  One (1) Training Run"): ``m`` canaries are each included in training with
  probability 1/2; after one training run the auditor guesses the ``k_plus`` highest
  scoring canaries as included and the ``k_minus`` lowest as excluded. If the training
  algorithm is (eps, delta)-DP, the number of correct guesses is unlikely to exceed a
  Binomial tail; inverting that test gives an epsilon *lower bound* at confidence
  ``1 - beta``. A bound above the epsilon an accountant claims is evidence of a bug.

Log-likelihoods are natural logs summed over a sequence's predicted tokens (the same
tokens the KerasHub preprocessor trains on: the text, its end token, not the start
token). Log-perplexity here is the negated log-likelihood; exposure does not depend
on the base of the logarithm of the perplexity.

Example:
    >>> from keras_dp_lm import evaluation as ev
    >>> canaries = ev.make_canaries(2, num_digits=4, seed=0)
    >>> train = ev.insert_canaries(["some text", "more text"], canaries,
    ...                            repetitions=3, seed=0)
    >>> len(train)
    8
    >>> ev.audit_lower_bound(num_guesses=10, num_correct=5)   # chance: no evidence
    0.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import scipy.special
import scipy.stats

__all__ = [
    "Canary",
    "CanarySpace",
    "ExposureResult",
    "ExtractionResult",
    "AuditResult",
    "make_canaries",
    "insert_canaries",
    "sequence_log_likelihood",
    "as_log_likelihood_fn",
    "exposure",
    "exposure_from_log_perplexities",
    "extraction_test",
    "audit_p_value",
    "audit_lower_bound",
    "one_run_audit",
    "membership_scores",
]


# --------------------------------------------------------------------------------------
# Canaries
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CanarySpace:
    """All texts ``format.format(digits=d)`` for ``num_digits``-digit strings ``d``.

    ``digit_separator`` is put between digits (``" "`` makes every digit its own word,
    which helps word-level vocabularies).
    """

    format: str = "my ssn is {digits}"
    num_digits: int = 6
    digit_separator: str = ""

    @property
    def size(self) -> int:
        return 10 ** self.num_digits

    def secret(self, index: int) -> str:
        return str(int(index)).zfill(self.num_digits)

    def text(self, secret) -> str:
        """The text for a secret given as an int index or a digit string."""
        if not isinstance(secret, str):
            secret = self.secret(secret)
        if len(secret) != self.num_digits or not secret.isdigit():
            raise ValueError(f"secret must be {self.num_digits} digits, got {secret!r}")
        return self.format.format(digits=self.digit_separator.join(secret))

    def enumerate(self) -> list:
        """Every text of the space, in secret order (only for small spaces)."""
        return [self.text(i) for i in range(self.size)]

    def sample(self, num, seed=None, exclude=()) -> list:
        """``num`` texts with uniformly random secrets (with replacement), never any
        text in ``exclude``."""
        rng = np.random.default_rng(seed)
        exclude = set(exclude)
        out = []
        while len(out) < num:
            for idx in _random_indices(rng, self.size, num - len(out)):
                text = self.text(int(idx))
                if text not in exclude:
                    out.append(text)
        return out


def _random_indices(rng, size, num):
    if size <= 2**62:
        return rng.integers(0, size, size=num)
    # Python ints for huge spaces.
    return [int("".join(map(str, rng.integers(0, 10, size=len(str(size)) - 1))))
            for _ in range(num)]


@dataclasses.dataclass(frozen=True)
class Canary:
    """One inserted secret: ``text`` is what goes into the training data."""

    text: str
    secret: str
    space: CanarySpace

    def __str__(self):
        return self.text


def make_canaries(num, format="my ssn is {digits}", num_digits=6, seed=None,
                  digit_separator=""):
    """``num`` canaries with distinct uniformly random secrets.

    Args:
        num: how many canaries.
        format: a ``str.format`` pattern with a ``{digits}`` field.
        num_digits: secret length; the candidate space has ``10**num_digits`` texts.
        seed: numpy seed (``None``: fresh entropy).
        digit_separator: put between digits (e.g. ``" "``).

    Returns:
        A list of :class:`Canary`.
    """
    if "{digits}" not in format:
        raise ValueError("format must contain a '{digits}' field")
    space = CanarySpace(format, int(num_digits), digit_separator)
    if num > space.size:
        raise ValueError(f"cannot draw {num} distinct secrets from {space.size}")
    rng = np.random.default_rng(seed)
    secrets, seen = [], set()
    while len(secrets) < num:
        for idx in _random_indices(rng, space.size, num - len(secrets)):
            s = space.secret(int(idx))
            if s not in seen:
                seen.add(s)
                secrets.append(s)
    return [Canary(space.text(s), s, space) for s in secrets]


def insert_canaries(texts, canaries, repetitions=1, seed=None):
    """Return a new list: ``texts`` plus each canary as its own record, repeated.

    Args:
        texts: the training records (strings).
        canaries: :class:`Canary` objects or strings.
        repetitions: an int for all canaries, or one int per canary (0 = left out).
        seed: the canary records are put at random positions drawn with this seed.
    """
    canaries = list(canaries)
    if isinstance(repetitions, (int, np.integer)):
        repetitions = [int(repetitions)] * len(canaries)
    repetitions = list(repetitions)
    if len(repetitions) != len(canaries):
        raise ValueError("need one repetition count per canary")
    if any(r < 0 for r in repetitions):
        raise ValueError("repetitions must be >= 0")
    out = [str(t) for t in texts]
    extra = [str(c) for c, r in zip(canaries, repetitions) for _ in range(r)]
    rng = np.random.default_rng(seed)
    # Random insertion points among the original records (original order kept).
    slots = rng.integers(0, len(out) + 1, size=len(extra))
    order = np.argsort(slots, kind="stable")
    result, prev = [], 0
    for j in order:
        result.extend(out[prev:slots[j]])
        prev = slots[j]
        result.append(extra[j])
    result.extend(out[prev:])
    return result


# --------------------------------------------------------------------------------------
# Scoring with a KerasHub CausalLM
# --------------------------------------------------------------------------------------


def sequence_log_likelihood(causal_lm, texts, batch_size=64, sequence_length=None,
                            return_token_counts=False):
    """Log-likelihood (natural log, summed over tokens) of each text under a CausalLM.

    The model's own preprocessor tokenizes and packs the texts exactly as in training
    (start token as context, end token predicted), so the score is the negated
    training loss of the text times its number of predicted tokens. Texts longer than
    ``sequence_length`` (default: the preprocessor's) are truncated.

    Returns a float64 array (and the per-text number of scored tokens if
    ``return_token_counts``).
    """
    import keras
    from keras import ops

    preprocessor = getattr(causal_lm, "preprocessor", None)
    if preprocessor is None:
        raise ValueError("causal_lm has no preprocessor; pass a function that scores "
                         "texts instead")
    texts = [str(t) for t in texts]
    lls, counts = [], []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        x, y, sw = keras.utils.unpack_x_y_sample_weight(
            preprocessor(chunk, sequence_length=sequence_length))
        logits = causal_lm(x, training=False)
        logp = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        tok = ops.take_along_axis(logp, ops.expand_dims(ops.cast(y, "int32"), -1), axis=-1)
        tok = ops.squeeze(tok, -1)
        sw = ops.cast(sw, "float32")
        lls.append(ops.convert_to_numpy(ops.sum(tok * sw, axis=-1)).astype(np.float64))
        counts.append(ops.convert_to_numpy(ops.sum(sw, axis=-1)).astype(np.int64))
    ll = np.concatenate(lls) if lls else np.zeros([0])
    cnt = np.concatenate(counts) if counts else np.zeros([0], np.int64)
    return (ll, cnt) if return_token_counts else ll


def as_log_likelihood_fn(causal_lm_or_fn, batch_size=64, sequence_length=None) -> Callable:
    """A function ``texts -> np.ndarray of log-likelihoods``.

    Accepts a KerasHub CausalLM (scored with :func:`sequence_log_likelihood`, packed to
    ``sequence_length`` tokens, default the preprocessor's) or any callable already
    mapping a list of texts to log-likelihoods (natural log).
    """
    if getattr(causal_lm_or_fn, "preprocessor", None) is not None and hasattr(
            causal_lm_or_fn, "backbone"):
        lm = causal_lm_or_fn
        return lambda texts: sequence_log_likelihood(lm, texts, batch_size=batch_size,
                                                     sequence_length=sequence_length)
    if callable(causal_lm_or_fn):
        fn = causal_lm_or_fn
        return lambda texts: np.asarray(fn(list(texts)), dtype=np.float64).reshape(-1)
    raise TypeError("expected a KerasHub CausalLM or a function texts -> log-likelihoods")


# --------------------------------------------------------------------------------------
# Exposure
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExposureResult:
    """Exposure of one canary.

    ``exposure`` is in bits. ``rank`` (rank method) is the canary's mid-rank among the
    ``space_size`` candidates; the extrapolated method records the fitted
    ``distribution`` and its ``fit_params`` (scipy order) instead.
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

    def to_dict(self):
        d = dataclasses.asdict(self)
        if d["fit_params"] is not None:
            d["fit_params"] = [float(p) for p in d["fit_params"]]
        return d


def exposure_from_log_perplexities(canary_log_perplexity, candidate_log_perplexities,
                                   method="rank", space_size=None,
                                   distribution="skewnorm"):
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


def exposure(causal_lm_or_logprob_fn, canary, candidates_or_space=None, method="auto",
             num_samples=1000, max_enumerate=10_000, distribution="skewnorm", seed=0,
             batch_size=64, sequence_length=None):
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


# --------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExtractionResult:
    """Greedy-decoding extraction of training continuations."""

    num_examples: int
    prefix_tokens: int
    suffix_tokens: int
    exact_match_rate: float
    token_accuracy: float
    examples: list

    def to_dict(self):
        return dataclasses.asdict(self)


def _token_lists(tokenizer, texts):
    out = tokenizer(list(texts))
    if hasattr(out, "to_list"):  # tf.RaggedTensor
        out = out.to_list()
    elif hasattr(out, "numpy"):  # dense tf.Tensor
        out = out.numpy()
    return [[int(i) for i in np.asarray(row).reshape(-1)] for row in out]


def extraction_test(causal_lm, training_texts, prefix_tokens=8, suffix_tokens=8,
                    max_examples=None, batch_size=32, seed=0, num_shown=5):
    """Prompt with training prefixes and check whether greedy decoding reproduces them.

    Every training text with at least ``prefix_tokens + suffix_tokens`` tokens gives one
    example: its first ``prefix_tokens`` tokens (after the start token, when the
    preprocessor adds one) are the prompt, the next ``suffix_tokens`` the target.
    Decoding is greedy (argmax of the model's logits), independent of the sampler
    the model was compiled with.

    Returns:
        :class:`ExtractionResult` with the exact-match rate (whole suffix right) and
        the token accuracy (fraction of suffix tokens right, position by position),
        plus a few decoded examples.
    """
    from keras import ops

    preprocessor = causal_lm.preprocessor
    tokenizer = preprocessor.tokenizer
    p, s = int(prefix_tokens), int(suffix_tokens)
    if p < 1 or s < 1:
        raise ValueError("prefix_tokens and suffix_tokens must be >= 1")
    ids = [t[: p + s] for t in _token_lists(tokenizer, training_texts) if len(t) >= p + s]
    if max_examples is not None and len(ids) > max_examples:
        rng = np.random.default_rng(seed)
        keep = np.sort(rng.choice(len(ids), size=max_examples, replace=False))
        ids = [ids[i] for i in keep]
    if not ids:
        return ExtractionResult(0, p, s, float("nan"), float("nan"), [])
    ids = np.asarray(ids, dtype=np.int32)
    start = []
    if getattr(preprocessor, "add_start_token", False) and getattr(
            tokenizer, "start_token_id", None) is not None:
        start = [int(tokenizer.start_token_id)]
    offset = len(start) + p
    generated = []
    for b in range(0, len(ids), batch_size):
        chunk = ids[b:b + batch_size]
        n = len(chunk)
        buf = np.zeros((n, offset + s), dtype=np.int32)
        if start:
            buf[:, 0] = start[0]
        buf[:, len(start):offset] = chunk[:, :p]
        mask = np.ones_like(buf, dtype=bool)  # causal attention: later slots unseen
        for t in range(s):
            logits = causal_lm({"token_ids": buf, "padding_mask": mask}, training=False)
            nxt = ops.convert_to_numpy(ops.argmax(logits[:, offset + t - 1, :], axis=-1))
            buf[:, offset + t] = nxt
        generated.append(buf[:, offset:].copy())
    generated = np.concatenate(generated)
    target = ids[:, p:p + s]
    correct = generated == target
    examples = []
    for i in range(min(num_shown, len(ids))):
        examples.append({
            "prefix": _detok(tokenizer, ids[i, :p]),
            "true_suffix": _detok(tokenizer, target[i]),
            "generated_suffix": _detok(tokenizer, generated[i]),
        })
    return ExtractionResult(
        num_examples=int(len(ids)), prefix_tokens=p, suffix_tokens=s,
        exact_match_rate=float(np.mean(np.all(correct, axis=1))),
        token_accuracy=float(np.mean(correct)), examples=examples)


def _detok(tokenizer, ids):
    out = tokenizer.detokenize(np.asarray(ids, dtype=np.int32))
    if hasattr(out, "numpy"):
        out = out.numpy()
    if isinstance(out, np.ndarray):
        out = out.item() if out.ndim == 0 else out.tolist()
    if isinstance(out, bytes):
        out = out.decode("utf-8", errors="replace")
    return str(out)


# --------------------------------------------------------------------------------------
# One-run auditing (Steinke, Nasr, Jagielski 2023)
# --------------------------------------------------------------------------------------


def audit_p_value(num_examples, num_guesses, num_correct, epsilon, delta=0.0):
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


def audit_lower_bound(num_guesses, num_correct, confidence=0.95, delta=0.0,
                      num_examples=None, tol=1e-6):
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
    """Outcome of :func:`one_run_audit`."""

    epsilon_lower_bound: float
    num_canaries: int
    num_included: int
    k_plus: int
    k_minus: int
    num_guesses: int
    num_correct: int
    confidence: float
    delta: float

    def to_dict(self):
        return dataclasses.asdict(self)


def one_run_audit(scores, included_mask, k_plus, k_minus=None, confidence=0.95,
                  delta=0.0):
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


def membership_scores(causal_lm_or_fn, texts, reference=None, batch_size=64,
                      sequence_length=None):
    """Per-text membership score: log-likelihood under the model, minus that under
    ``reference`` (a model never trained on the texts) when given. Higher = more
    likely a training member."""
    texts = [str(t) for t in texts]
    scores = as_log_likelihood_fn(causal_lm_or_fn, batch_size, sequence_length)(texts)
    if reference is not None:
        scores = scores - as_log_likelihood_fn(reference, batch_size, sequence_length)(texts)
    return scores
