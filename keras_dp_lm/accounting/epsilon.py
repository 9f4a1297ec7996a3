"""Epsilon of DP-SGD runs and of compositions, computed by ``dp_accounting``.

PLD (tight, default) or RDP (looser, cheap). The one-step PLD is built once per
configuration (:func:`keras_dp_lm.accounting._pld.gaussian_pld`) and shared;
:func:`epsilon_curve` gives epsilon after many step counts from it, and
:func:`max_steps` searches such curves and checks its answer with the
accountant's own arithmetic.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as _pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from keras_dp_lm.accounting._arguments import PLD_DISCRETIZATION
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_epsilon
from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting._arguments import COARSE_PLD_DISCRETIZATION
from keras_dp_lm.accounting._pld import PLDCurve
from keras_dp_lm.accounting._pld import gaussian_pld
from keras_dp_lm.accounting._pld import gaussian_pmf
from keras_dp_lm.accounting.events import EpsilonDeltaDpEvent
from keras_dp_lm.accounting.events import _PLDAccountant
from keras_dp_lm.accounting.events import as_event
from keras_dp_lm.accounting.events import describe_event
from keras_dp_lm.accounting.events import epsilon_of
from keras_dp_lm.accounting.events import LedgerRow
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import ledger_events
from keras_dp_lm.accounting.events import make_accountant
from keras_dp_lm.accounting.step_search import largest_n_within
from keras_dp_lm.accounting.step_search import largest_within

if TYPE_CHECKING:
    import dp_accounting


def compute_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                    accountant: str = "pld") -> float:
    """Epsilon of ``steps`` DP-SGD updates (Poisson rate ``q``, noise ``sigma``).

    Args:
        noise_multiplier: sigma (noise std / clipping norm). 0 gives ``inf``.
        sampling_rate: q = logical batch size / dataset size.
        steps: number of noised updates.
        delta: target delta.
        accountant: ``"pld"`` (tight, default) or ``"rdp"``.

    Example:
        >>> round(compute_epsilon(1.1, 0.01, 1000, 1e-5, accountant="rdp"), 3)
        1.712
    """
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return _cached_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant)


@functools.lru_cache(maxsize=512)
def _cached_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant):
    """A fresh dp_accounting accountant's answer (cached: it is deterministic)."""
    return epsilon_of(dp_sgd_event(noise_multiplier, sampling_rate, steps), delta, accountant)


class EpsilonCurve:
    """epsilon(n) for n self-composed DP-SGD steps, built once, cached per n.

    RDP: the one-step RDP vector from ``RdpAccountant`` times n, converted by
    ``dp_accounting``'s ``compute_epsilon`` -- exactly what ``RdpAccountant``
    does for ``SelfComposedDpEvent``. ~1 ms per new n.
    PLD: the one-step PLD built as ``PLDAccountant`` builds it
    (:func:`~keras_dp_lm.accounting._pld.gaussian_pld`, shared), self-composed
    n times and composed onto the identity PLD: the accountant's own
    arithmetic, so the values are identical. ~0.05-0.5 s per new n; for many n
    (curves, searches) :class:`ComposedEpsilonCurve` is ~10x cheaper per n.
    """

    def __init__(self, noise_multiplier, sampling_rate, delta, accountant,
                 discretization=PLD_DISCRETIZATION):
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self._cache = {0: 0.0}
        one_step = dp_event.PoissonSampledDpEvent(
            sampling_rate, dp_event.GaussianDpEvent(noise_multiplier))
        if noise_multiplier == 0:
            self._base = None
        elif accountant == "rdp":
            acc = make_accountant("rdp")
            acc.compose(one_step)
            self._orders, self._rdp = acc.orders, acc.rdp
        else:
            self._base = gaussian_pld(noise_multiplier, sampling_rate, discretization)
            self._identity = _pld_lib.identity(
                value_discretization_interval=discretization)

    def __call__(self, n):
        n = int(n)
        if n not in self._cache:
            if self.noise_multiplier == 0:
                value = math.inf
            elif self.accountant == "rdp":
                value = _rdp_lib.compute_epsilon(
                    self._orders, self._rdp * n, self.delta)[0]
            else:
                # identity.compose(...) exactly as PLDAccountant composes it.
                value = self._identity.compose(
                    self._base.self_compose(n)).get_epsilon_for_delta(self.delta)
            self._cache[n] = float(value)
        return self._cache[n]


class ComposedEpsilonCurve:
    """epsilon(n) of n DP-SGD steps composed with fixed other releases, for many n.

    The sibling of :class:`EpsilonCurve` for curves and searches, with the
    ``extra_events`` (DpEvents or ``(epsilon, delta)`` pairs) composed in the
    same accountant.

    PLD: :class:`~keras_dp_lm.accounting._pld.PLDCurve` on the shared one-step
    PLD: the k-fold self-composition as the k-th power of its Fourier
    transform, then the identity and the extra events' PLD composed as
    ``PLDAccountant`` composes them. ~5-50 ms per new n. The values agree with
    a fresh accountant up to FFT round-off: ~1e-8 relative at delta >= 1e-7;
    at delta 1e-10 to 1e-12 either side may be off by up to 1e-12 in delta
    (5e-3 relative in epsilon), a fresh accountant's own FFT included.
    Anything that must be exact is recomputed with :func:`compose_epsilon`.
    With ``upper_bound=True`` the values bound the accountant's from above:
    read at :func:`upper_bound_delta` (a margin 10x the round-off), and, below
    delta 1e-10 where that margin would be a large part of delta, computed by
    the accountant itself, point by point (~0.1-1 s each).
    RDP: the accountant's own sums (one-step vector times n, plus each extra
    event's vector), exact.
    """

    def __init__(self, noise_multiplier, sampling_rate, delta, accountant="pld",
                 extra_events=(), discretization=PLD_DISCRETIZATION, upper_bound=False):
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self.extra_events = tuple(extra_events)
        self.upper_bound = upper_bound
        self._cache = {}
        if accountant == "rdp":
            acc = make_accountant("rdp")
            acc.compose(dp_event.PoissonSampledDpEvent(
                sampling_rate, dp_event.GaussianDpEvent(noise_multiplier)))
            self._orders, self._rdp = acc.orders, acc.rdp
            self._extra_rdp = []
            for event in self.extra_events:
                extra = make_accountant("rdp")
                _check_supported(extra, event, "rdp")
                self._extra_rdp.append(extra.compose(event).rdp)
        else:
            self._extra = self._extra_accountant(discretization)
            self._curve = None if noise_multiplier == 0 else self._pld_curve(discretization)

    def _extra_accountant(self, discretization):
        extra = _PLDAccountant(value_discretization_interval=discretization)
        for event in self.extra_events:
            _check_supported(extra, event, "pld")
            extra.compose(event)
        return extra

    def _pld_curve(self, discretization):
        sigma, q = self.noise_multiplier, self.sampling_rate
        # pylint: disable=protected-access
        extra = self._extra._pld if self.extra_events else None
        remove = gaussian_pmf(sigma, q, discretization, "remove")
        if q == 1.0 and (extra is None or extra._symmetric):
            return PLDCurve(remove, None if extra is None else extra._pmf_remove)
        # The add direction is built only where a coarser (pessimistic, so
        # larger) PLD does not show it below the remove direction.
        add_bound = None
        if discretization < COARSE_PLD_DISCRETIZATION:
            coarse = self._extra_accountant(COARSE_PLD_DISCRETIZATION)._pld if extra else None
            add_bound = PLDCurve(gaussian_pmf(sigma, q, COARSE_PLD_DISCRETIZATION, "add"),
                                 None if coarse is None else coarse._pmf_add)
        extra_remove, extra_add = (None, None) if extra is None else (extra._pmf_remove,
                                                                      extra._pmf_add)
        # pylint: enable=protected-access
        return PLDCurve(remove, extra_remove,
                        functools.partial(gaussian_pmf, sigma, q, discretization, "add"),
                        extra_add, add_bound)

    def values(self, steps):
        """Epsilon after each step count in ``steps`` (a list of ints >= 0)."""
        steps = [int(n) for n in steps]
        new = sorted({n for n in steps if n not in self._cache})
        if new:
            self._cache.update(zip(new, self._compute(new)))
        return [self._cache[n] for n in steps]

    def __call__(self, n):
        return self.values([n])[0]

    def _compute(self, steps):
        if self.accountant == "rdp":
            values = []
            for n in steps:
                rdp = self._rdp * n
                for extra in self._extra_rdp:
                    rdp = rdp + extra
                values.append(float(_rdp_lib.compute_epsilon(self._orders, rdp, self.delta)[0]))
            return values
        # pylint: disable=protected-access
        if self._extra._contains_non_dp_event:
            return [math.inf] * len(steps)
        alone = float(self._extra.get_epsilon(self.delta)) if self.extra_events else 0.0
        positive = [n for n in steps if n > 0]
        if self._curve is None:  # no noise
            found = [math.inf] * len(positive)
        elif self.upper_bound and self.delta < EXACT_CURVE_BELOW_DELTA:
            found = [compose_epsilon([dp_sgd_event(self.noise_multiplier, self.sampling_rate, n),
                                      *self.extra_events], self.delta) for n in positive]
        else:
            delta = upper_bound_delta(self.delta) if self.upper_bound else self.delta
            found = [float(e) for e in self._curve.epsilons(positive, delta)]
        found = dict(zip(positive, found))
        return [found[n] if n else alone for n in steps]


def _check_supported(acc, event, accountant):
    if not acc.supports(event):
        hint = (" (epsilon, delta) pairs compose only in the PLD accountant."
                if isinstance(event, EpsilonDeltaDpEvent) else "")
        raise ValueError(
            f"The {accountant.upper()} accountant cannot compose "
            f"{describe_event(event)}.{hint}")


# The fast PLD curve and a fresh accountant differ by FFT round-off, at most
# ~1e-12 in delta over sigma 0.5-2, q 0.005-0.1, 100-3,000 steps, delta 1e-10
# and 1e-12 (tests/test_accounting.py). Curves that must bound the accountant
# from above are read at delta minus ten times that; where this would be a
# large part of delta, the accountant computes every point.
FFT_DELTA_MARGIN = 1e-11
EXACT_CURVE_BELOW_DELTA = 1e-10


def upper_bound_delta(delta):
    """The delta at which fast PLD curves are read to bound the accountant's epsilon."""
    return delta - min(delta / 2, FFT_DELTA_MARGIN)


@functools.lru_cache(maxsize=8)
def _cached_composed_curve(noise_multiplier, sampling_rate, delta, accountant, extra_events,
                           discretization=PLD_DISCRETIZATION, upper_bound=False):
    return ComposedEpsilonCurve(noise_multiplier, sampling_rate, delta, accountant,
                                extra_events, discretization, upper_bound)


def composed_curve(noise_multiplier, sampling_rate, delta, accountant="pld", extra_events=(),
                   discretization=PLD_DISCRETIZATION, upper_bound=False):
    """A cached :class:`ComposedEpsilonCurve` (uncached if an event is unhashable)."""
    extra_events = tuple(as_event(e) for e in extra_events)
    try:
        hash(extra_events)
    except TypeError:
        return ComposedEpsilonCurve(noise_multiplier, sampling_rate, delta, accountant,
                                    extra_events, discretization, upper_bound)
    return _cached_composed_curve(noise_multiplier, sampling_rate, delta, accountant,
                                  extra_events, discretization, upper_bound)


def epsilon_curve(noise_multiplier: float, sampling_rate: float, steps: Sequence[int], delta: float,
                  extra_events: Sequence[dp_accounting.DpEvent | tuple[float, float]] = (),
                  accountant: str = "pld") -> list[float]:
    """Epsilon after each number of DP-SGD updates in ``steps``, in one accountant.

    ``epsilon_curve(sigma, q, steps, delta, extras)[i]`` is the epsilon at
    ``delta`` of ``steps[i]`` updates (Poisson rate ``q``, noise ``sigma``)
    composed with ``extra_events`` (``dp_accounting.DpEvent`` objects or
    ``(epsilon, delta)`` pairs, the latter PLD only), i.e.
    ``compose_epsilon([dp_sgd_event(sigma, q, steps[i]), *extras], delta)``,
    without recomputing the PLD per step count: the one-step PLD is built once
    and its k-fold composition obtained from its Fourier transform. PLD values
    are upper bounds on a fresh accountant's: read at a delta 1e-11 lower (at
    most half of it), far above the FFT round-off, they are at most ~1e-6
    relative above it at delta 1e-6 and ~0.3% at delta 1e-10; below delta
    1e-10 every point is the accountant's own (~0.1-1 s each). RDP values are
    exact. A 13-point curve takes well under a second.

    Args:
        noise_multiplier: sigma.
        sampling_rate: q.
        steps: a list of step counts (ints >= 0).
        delta: target delta of the whole composition.
        extra_events: other releases about the same data.
        accountant: ``"pld"`` (default) or ``"rdp"``.

    Returns:
        A list of floats, one per entry of ``steps``.

    Example:
        >>> eps = epsilon_curve(1.0, 0.01, [0, 500, 1000], 1e-5, extra_events=[(0.5, 0.0)])
        >>> [round(e, 3) for e in eps]
        [0.5, 1.774, 2.265]
    """
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    if isinstance(steps, (numbers.Number, str)) or not hasattr(steps, "__iter__"):
        raise ValueError(f"`steps` must be a list of step counts, got {steps!r}.")
    steps = [check_steps(n) for n in steps]
    return composed_curve(noise_multiplier, sampling_rate, delta, accountant,
                          extra_events, upper_bound=True).values(steps)


def max_steps(target_epsilon: float, delta: float, noise_multiplier: float, sampling_rate: float,
              accountant: str = "pld", near: int | None = None) -> int:
    """Largest number of DP-SGD updates whose epsilon stays <= ``target_epsilon``.

    Epsilon is taken at ``delta`` (in (0, 1)) for Poisson sampling rate
    ``sampling_rate`` (q, in (0, 1]) and ``noise_multiplier`` (sigma), with the
    ``accountant`` ``"pld"`` (tight, the default) or ``"rdp"``. The result
    ``n`` satisfies ``compute_epsilon(..., n, ...) <= target_epsilon`` and
    ``compute_epsilon(..., n + 1, ...) > target_epsilon`` (same accountant).
    ``near``: an optional step count believed close to the answer (e.g. the
    steps a noise multiplier was calibrated for); it only speeds the search.
    Returns 0 if even one update exceeds it (or ``noise_multiplier == 0``).

    Example:
        >>> max_steps(2.0, 1e-5, noise_multiplier=1.0, sampling_rate=0.01, accountant="rdp")
        881
    """
    target_epsilon = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    accountant = check_accountant(accountant)
    if noise_multiplier == 0:
        return 0
    return _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon,
                             accountant, near)


@functools.lru_cache(maxsize=16)
def cached_epsilon_curve(noise_multiplier, sampling_rate, delta, accountant,
                         discretization=PLD_DISCRETIZATION):
    return EpsilonCurve(noise_multiplier, sampling_rate, delta, accountant, discretization)


@functools.lru_cache(maxsize=256)
def _cached_max_steps(noise_multiplier, sampling_rate, delta, target_epsilon, accountant,
                      near=None):
    return _max_steps_with(
        cached_epsilon_curve(noise_multiplier, sampling_rate, delta, accountant),
        target_epsilon, near)


def _max_steps_with(curve, target_epsilon, near=None):
    """Search the cheap curve, then let the accountant's arithmetic decide."""
    if curve.accountant == "rdp":
        # Final word to a fresh dp_accounting accountant (cheap for RDP).
        return largest_within(
            curve, lambda k: compute_epsilon(curve.noise_multiplier, curve.sampling_rate, k,
                                             curve.delta, "rdp"),
            target_epsilon, near or 1, 1.01 if near else 2.0)
    search = composed_curve(curve.noise_multiplier, curve.sampling_rate, curve.delta, "pld")
    if near:
        guess, growth = near, 1.01
    else:  # RDP over-estimates epsilon: its answer is a close lower guess
        rdp_curve = cached_epsilon_curve(curve.noise_multiplier, curve.sampling_rate,
                                         curve.delta, "rdp")
        guess, growth = max(1, largest_n_within(rdp_curve, target_epsilon)), 1.5
    # The PLD EpsilonCurve performs PLDAccountant's exact computation (a test
    # checks it).
    return largest_within(search, curve, target_epsilon, guess, growth)



def compose_epsilon(events: Sequence[dp_accounting.DpEvent | tuple[float, float]], delta: float,
                    accountant: str = "pld") -> float:
    """Epsilon at ``delta`` of several mechanisms composed in ONE accountant.

    ``events`` are ``dp_accounting.DpEvent`` objects or ``(epsilon, delta)``
    pairs (the latter need the PLD accountant).

    Example:
        >>> import dp_accounting
        >>> train = dp_sgd_event(1.0, 0.01, 1000)
        >>> vocab = dp_accounting.GaussianDpEvent(10.0)
        >>> round(compose_epsilon([train, vocab, (0.1, 0.0)], delta=1e-5), 2)
        1.91
    """
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    events = [as_event(e) for e in events]
    acc = make_accountant(accountant)
    for event in events:
        _check_supported(acc, event, accountant)
        acc.compose(event)
    return float(acc.get_epsilon(delta))


def ledger_epsilon(rows: Iterable[LedgerRow | tuple[float, float, float, int]], dataset_size: int,
                   delta: float, accountant: str = "pld") -> float:
    """Epsilon at ``delta`` of everything a privacy ledger records.

    ``rows``: the ledger's ``(noise_multiplier, sampling_rate, max_real_batch,
    updates)`` rows (:class:`LedgerRow`). ``dataset_size``: the number of
    privacy units (examples or users), which prices fixed-size rows at
    ``max_real_batch / dataset_size``. ``accountant``: ``"pld"`` (the default)
    or ``"rdp"``. 0 for no updates, ``inf`` if any row used no noise.

    Example:
        >>> rows = [(1.1, 0.01, 10.0, 1000)]
        >>> ledger_epsilon(rows, 1000, 1e-5) == compute_epsilon(1.1, 0.01, 1000, 1e-5)
        True
    """
    rows = [LedgerRow(*row) for row in rows if row[3]]
    if not rows:
        return 0.0
    if any(row.noise_multiplier == 0 for row in rows):
        return math.inf
    if len(rows) == 1:
        (row,) = rows
        return cached_epsilon_curve(row.noise_multiplier, row.rate(dataset_size), delta,
                                    accountant)(row.updates)
    return compose_epsilon(ledger_events(rows, dataset_size), delta, accountant)


