"""``DecodingBudget``: a total decoding epsilon, charged before each generation.

Two modes: pure epsilon (``DecodingBudget(total_epsilon)``, :class:`DPSampler`
only) and ``(epsilon, delta)`` with an RDP ledger
(``DecodingBudget(total_epsilon, delta=...)``, for :class:`PublicMixtureSampler`
and :class:`DPSampler`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from keras import ops

from keras_dp_lm.samplers import renyi
from keras_dp_lm.samplers.dp_sampler import DPSampler
from keras_dp_lm.samplers.epsilon import epsilon_per_token
from keras_dp_lm.samplers.public_mixture import PublicMixtureSampler
from keras_dp_lm.samplers.epsilon import num_sampled_tokens
from keras_dp_lm.samplers.epsilon import vocabulary_size_of

if TYPE_CHECKING:
    import keras_hub
    from numpy.typing import ArrayLike


class BudgetExhaustedError(RuntimeError):
    """A decoding request would take a :class:`DecodingBudget` past its total.

    Example:
        >>> budget = DecodingBudget(total_epsilon=1.0)
        >>> try:
        ...     budget.charge(2.0)
        ... except BudgetExhaustedError:
        ...     print("refused; spent:", budget.spent)
        refused; spent: 0.0
    """


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

    ``(epsilon, delta)`` mode (``delta`` given): the budget keeps an RDP ledger
    (the sum of every charge's RDP curve at ``orders``, default dp_accounting's
    grid) and :attr:`spent` is its epsilon at ``delta`` by dp_accounting's
    conversion. A :class:`PublicMixtureSampler` call is charged
    ``tokens * sampler.rdp(orders)`` per sequence, a :class:`DPSampler` call
    ``tokens * min(eps_token, a eps_token**2 / 2)`` per sequence (pure DP as RDP),
    summed over the sequences of a call (``"sequential"``) or their element-wise
    maximum (``"parallel"``); :meth:`charge` takes a pure epsilon,
    :meth:`charge_rdp` a curve. A charge whose ledger would convert above
    ``total_epsilon`` is refused and recorded nowhere, before anything is
    generated. ``remaining`` is ``total_epsilon - spent`` (RDP charges do not add
    up linearly in epsilon).

    Example (``budget.generate(causal_lm, prompts)`` charges, then generates):
        >>> from keras_dp_lm import testing
        >>> causal_lm = testing.tiny_gpt2_causal_lm(["To be, or not to be."],
        ...                                         vocabulary_size=300)
        >>> causal_lm.compile(sampler=DPSampler(lambda_=0.5, seed=0))
        >>> budget = DecodingBudget(total_epsilon=100.0)
        >>> cost = budget.epsilon_for(causal_lm, ["To be", "or not"], max_length=8)
        >>> round(cost, 2), budget.can_afford(cost)  # 2 prompts x 5 sampled tokens
        (55.91, True)
        >>> round(budget.charge(cost), 2)            # what remains
        44.09
    """

    _RELATIVE_SLACK = 1e-12

    def __init__(self, total_epsilon: float, delta: float | None = None,
                 orders: Sequence[float] | None = None) -> None:
        if isinstance(total_epsilon, bool) or not isinstance(
                total_epsilon, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(total_epsilon)) or float(total_epsilon) < 0:
            raise ValueError(
                f"`total_epsilon` must be a finite number >= 0. Received: {total_epsilon!r}")
        self.total_epsilon = float(total_epsilon)
        self._charges = []
        if delta is None:
            if orders is not None:
                raise ValueError("`orders` needs `delta` (an (epsilon, delta) budget).")
            self.delta = None
            self.orders = None
        else:
            self.delta = renyi._check_delta(delta)
            self.orders = tuple(float(a) for a in renyi._check_orders(orders))
            self._rdp_charges = []
        # Per model: the generate functions only this budget traced, by sampler
        # (see `_generate_with`), and the model's own function it last restored.
        self._traced = weakref.WeakKeyDictionary()

    @property
    def uses_rdp(self) -> bool:
        """Whether this is an ``(epsilon, delta)`` budget with an RDP ledger."""
        return self.delta is not None

    @property
    def rdp_spent(self) -> np.ndarray:
        """The ledger: the summed RDP curve at :attr:`orders` (``(epsilon, delta)`` mode)."""
        self._require_rdp("rdp_spent")
        total = np.zeros(len(self.orders))
        for curve in self._rdp_charges:
            total = total + curve
        return total

    def _epsilon_of(self, rdp):
        if not np.any(rdp > 0):
            return 0.0
        return renyi.epsilon_for_rdp(self.orders, rdp, self.delta)[0]

    @property
    def spent(self) -> float:
        """Epsilon charged so far (at :attr:`delta` in ``(epsilon, delta)`` mode)."""
        if self.uses_rdp:
            return self._epsilon_of(self.rdp_spent)
        return math.fsum(self._charges)

    @property
    def remaining(self) -> float:
        """Epsilon left (never negative)."""
        return max(self.total_epsilon - self.spent, 0.0)

    @property
    def num_charges(self) -> int:
        return len(self._rdp_charges) if self.uses_rdp else len(self._charges)

    def _require_rdp(self, what):
        if not self.uses_rdp:
            raise ValueError(
                f"`{what}` needs an (epsilon, delta) budget: "
                "DecodingBudget(total_epsilon, delta=...).")

    def _check_rdp(self, rdp):
        rdp = np.asarray(rdp, dtype="float64")
        if rdp.shape != (len(self.orders),) or np.any(np.isnan(rdp)) or np.any(rdp < 0):
            raise ValueError(
                f"`rdp` must be a non-negative curve with one value per order "
                f"({len(self.orders)}). Received shape {rdp.shape}.")
        return rdp

    def can_afford(self, epsilon: float) -> bool:
        """Whether :meth:`charge` of ``epsilon`` would succeed."""
        epsilon = self._check_epsilon(epsilon)
        if self.uses_rdp:
            return self.can_afford_rdp(renyi.pure_dp_rdp(epsilon, self.orders))
        new_total = math.fsum(self._charges + [epsilon])
        return new_total <= self.total_epsilon * (1.0 + self._RELATIVE_SLACK)

    def can_afford_rdp(self, rdp: ArrayLike) -> bool:
        """Whether :meth:`charge_rdp` of the curve ``rdp`` (one non-negative value
        per order of :attr:`orders`) would succeed."""
        self._require_rdp("can_afford_rdp")
        rdp = self._check_rdp(rdp)
        new_epsilon = self._epsilon_of(self.rdp_spent + rdp)
        return new_epsilon <= self.total_epsilon * (1.0 + self._RELATIVE_SLACK)

    def charge_rdp(self, rdp: ArrayLike) -> float:
        """Add the RDP curve ``rdp`` (one non-negative value per order of
        :attr:`orders`) to the ledger; raise
        :class:`BudgetExhaustedError` (charging nothing) if the ledger would then
        convert above ``total_epsilon`` at ``delta``. Returns the remaining epsilon."""
        self._require_rdp("charge_rdp")
        rdp = self._check_rdp(rdp)
        if not self.can_afford_rdp(rdp):
            raise BudgetExhaustedError(
                f"Decoding budget exhausted: with this request the ledger would reach "
                f"epsilon={self._epsilon_of(self.rdp_spent + rdp):.6g} at "
                f"delta={self.delta:.3g}, above total_epsilon={self.total_epsilon:.6g} "
                f"(spent {self.spent:.6g} in {self.num_charges} charge(s)). Nothing was "
                f"generated. Use fewer new tokens (smaller max_length), a smaller beta / "
                f"lambda_, or a new budget for a different protected record.")
        self._rdp_charges.append(rdp)
        return self.remaining

    def charge(self, epsilon: float) -> float:
        """Record ``epsilon`` spent; raise :class:`BudgetExhaustedError` (charging
        nothing) if it would take the total past ``total_epsilon``. Returns the
        remaining epsilon. (In ``(epsilon, delta)`` mode a pure ``epsilon`` is charged
        as the RDP curve of one ``epsilon``-DP mechanism.)"""
        epsilon = self._check_epsilon(epsilon)
        if self.uses_rdp:
            return self.charge_rdp(renyi.pure_dp_rdp(epsilon, self.orders))
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

    def rdp_for(self, causal_lm: keras_hub.models.CausalLM,
                prompts: str | Sequence[str] | dict[str, Any], max_length: int | None = None,
                composition: str = "sequential") -> np.ndarray:
        """The RDP curve (at :attr:`orders`) :meth:`generate` would charge
        (``(epsilon, delta)`` mode; charges nothing). ``causal_lm``, ``prompts``,
        ``max_length`` and ``composition`` as for :meth:`generate`: each
        sequence costs its sampled tokens times the sampler's per-token curve."""
        self._require_rdp("rdp_for")
        sampler = self._sampler_of(causal_lm, composition)
        max_length, prompt_lengths = _prompt_lengths(causal_lm, prompts, max_length)
        if isinstance(sampler, PublicMixtureSampler):
            per_token = sampler.rdp(self.orders)
        else:
            eps_token = epsilon_per_token(sampler.applied_lambda(),
                                          vocabulary_size_of(causal_lm))
            per_token = renyi.pure_dp_rdp(eps_token, self.orders)
        # 0 tokens cost nothing, also at orders where the per-token curve is inf.
        curves = [t * per_token if t > 0 else np.zeros(len(self.orders)) for t in
                  (num_sampled_tokens(max_length, n) for n in prompt_lengths)]
        if not curves:
            return np.zeros(len(self.orders))
        if composition == "sequential":
            return np.sum(curves, axis=0)
        return np.max(curves, axis=0)

    def _sampler_of(self, causal_lm, composition):
        sampler = getattr(causal_lm, "sampler", None)
        if isinstance(sampler, PublicMixtureSampler) and not self.uses_rdp:
            raise ValueError(
                "A PublicMixtureSampler is (epsilon, delta)-DP, not pure epsilon-DP: "
                "charge it to DecodingBudget(total_epsilon, delta=...).")
        if not isinstance(sampler, (DPSampler, PublicMixtureSampler)):
            raise ValueError(
                "DecodingBudget.generate needs a model compiled with a DPSampler or a "
                f"PublicMixtureSampler, got sampler={sampler!r}. Call "
                "`causal_lm.compile(sampler=keras_dp_lm.DPSampler(lambda_=...))` first.")
        if composition not in ("parallel", "sequential"):
            raise ValueError(
                f"`composition` must be 'parallel' or 'sequential'. Received: {composition!r}")
        return sampler

    def epsilon_for(self, causal_lm: keras_hub.models.CausalLM,
                    prompts: str | Sequence[str] | dict[str, Any], max_length: int | None = None,
                    composition: str = "sequential") -> float:
        """What :meth:`generate` would charge for these arguments (charges nothing).

        ``causal_lm``, ``prompts``, ``max_length`` and ``composition`` as for
        :meth:`generate`. In ``(epsilon, delta)`` mode: the epsilon at ``delta`` of
        this call alone (the ledger is charged its RDP curve, :meth:`rdp_for`)."""
        if self.uses_rdp:
            return self._epsilon_of(self.rdp_for(causal_lm, prompts, max_length, composition))
        sampler = self._sampler_of(causal_lm, composition)
        max_length, prompt_lengths = _prompt_lengths(causal_lm, prompts, max_length)
        vocabulary_size = vocabulary_size_of(causal_lm)
        per_sequence = [sampler.epsilon_per_sequence(
            vocabulary_size, num_sampled_tokens(max_length, n)) for n in prompt_lengths]
        if not per_sequence:
            return 0.0
        return math.fsum(per_sequence) if composition == "sequential" else max(per_sequence)

    def generate(self, causal_lm: keras_hub.models.CausalLM,
                 prompts: str | Sequence[str] | dict[str, Any], max_length: int | None = None,
                 composition: str = "sequential", **generate_kwargs: Any) -> Any:
        """Charge this call's epsilon, then ``causal_lm.generate(prompts, max_length, ...)``.

        ``causal_lm``: a KerasHub CausalLM compiled with a :class:`DPSampler` or
        :class:`PublicMixtureSampler`. ``prompts``: a string, a list of strings,
        or (for a model without preprocessor) a dict with ``token_ids`` and
        ``padding_mask``. ``max_length`` defaults to the preprocessor's
        ``sequence_length``. ``composition``: ``"sequential"`` (the default: the
        sum over the call's sequences) or ``"parallel"`` (their maximum; see the
        class notes for when it is valid).
        Raises :class:`BudgetExhaustedError` before generating anything if
        the charge does not fit. Extra keyword arguments go to ``generate``.
        """
        sampler = self._sampler_of(causal_lm, composition)
        if self.uses_rdp:
            self.charge_rdp(self.rdp_for(causal_lm, prompts, max_length, composition))
        else:
            self.charge(self.epsilon_for(causal_lm, prompts, max_length, composition))
        return self._generate_with(sampler, causal_lm, prompts, max_length=max_length,
                                   **generate_kwargs)

    def _generate_with(self, sampler, causal_lm, prompts, **generate_kwargs):
        """``causal_lm.generate`` on a generate function traced only here, with
        ``sampler`` (the one charged) as ``causal_lm.sampler``.

        KerasHub keeps ``causal_lm.generate_function`` across calls and reads
        ``causal_lm.sampler`` only when it traces, once per input shape. After
        ``lm.sampler = other`` (no ``compile``), or after a trace made outside
        the budget with another sampler, the model's own function samples with
        a sampler that was not charged. So the budget runs its own function,
        one per (model, sampler), and puts the model's back afterwards. They are
        dropped when the model's function changed since (a trace outside the
        budget), or its optimizer (a ``compile``: KerasHub builds a new one unless
        given one), ``jit_compile`` or ``run_eagerly`` did. A ``compile`` with the
        same optimizer object does not drop them: after changing a sampler's
        ``temperature`` (not part of any charge) use a new sampler object. The
        budget holds the models it generated with until it is deleted.
        """
        state = (getattr(causal_lm, "optimizer", None),
                 getattr(causal_lm, "jit_compile", None),
                 getattr(causal_lm, "run_eagerly", None))
        own = self._traced.get(causal_lm)
        if (own is None or own["restored"] is not causal_lm.generate_function
                or any(a is not b for a, b in zip(own["state"], state))):
            own = {"functions": {}, "restored": None, "state": state}
            self._traced[causal_lm] = own
        entry = own["functions"].get(id(sampler))
        saved = causal_lm.generate_function
        causal_lm.generate_function = entry[1] if entry is not None else None
        try:
            output = causal_lm.generate(prompts, **generate_kwargs)
            if causal_lm.sampler is not sampler:
                # Traced after a swap (another thread): not what was charged. The
                # output is withheld; tokens never released cost nothing.
                raise RuntimeError(
                    "The model's sampler changed during DecodingBudget.generate; the "
                    "output is withheld. A budget and its model are not thread-safe: "
                    "do not assign `sampler` while a budget generates.")
            return output
        finally:
            if causal_lm.generate_function is not None and causal_lm.sampler is sampler:
                own["functions"][id(sampler)] = (sampler, causal_lm.generate_function)
            causal_lm.generate_function = saved
            own["restored"] = saved

    def get_config(self) -> dict[str, Any]:
        if not self.uses_rdp:
            return {"total_epsilon": self.total_epsilon, "charges": list(self._charges)}
        return {"total_epsilon": self.total_epsilon, "delta": self.delta,
                "orders": list(self.orders),
                "rdp_charges": [[float(x) for x in c] for c in self._rdp_charges]}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DecodingBudget:
        budget = cls(config["total_epsilon"], delta=config.get("delta"),
                     orders=config.get("orders"))
        for epsilon in config.get("charges", []):
            budget._charges.append(cls._check_epsilon(epsilon))
        for curve in config.get("rdp_charges", []):
            budget._rdp_charges.append(budget._check_rdp(curve))
        return budget

    def __repr__(self):
        if self.uses_rdp:
            return (f"DecodingBudget(total_epsilon={self.total_epsilon!r}, "
                    f"delta={self.delta!r}, spent={self.spent!r})")
        return (f"DecodingBudget(total_epsilon={self.total_epsilon!r}, "
                f"spent={self.spent!r})")


def _prompt_lengths(causal_lm, prompts, max_length):
    """(max_length, [tokens before sampling starts, per prompt]) as ``generate`` sees them."""
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(
            max_length, (int, np.integer)) or max_length < 1):
        raise ValueError(f"`max_length` must be a positive int or None. Received: "
                         f"{max_length!r}")
    preprocessor = getattr(causal_lm, "preprocessor", None)
    if isinstance(prompts, dict):
        if preprocessor is not None and not _is_token_dict(prompts):
            raise TypeError("Pass prompts as strings when the model has a preprocessor.")
        raw_mask = np.asarray(ops.convert_to_numpy(prompts["padding_mask"]))
        if raw_mask.dtype != bool and not np.isin(raw_mask, (0, 1)).all():
            # generate starts sampling at the mask's integer sum: other values (e.g.
            # -1 under XLA) sample and release more positions than counted here.
            raise ValueError(
                "`padding_mask` must be boolean or hold only 0 and 1; got values "
                f"{np.unique(raw_mask)[:8].tolist()}.")
        mask = raw_mask.astype(bool)
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
