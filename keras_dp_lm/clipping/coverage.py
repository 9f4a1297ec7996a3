"""What fast clipping will do for each variable of a model, and why."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from keras_dp_lm.clipping._common import _layer_desc
from keras_dp_lm.clipping._common import _plain
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping._common import _var_path
from keras_dp_lm.clipping.fast import _LAST_DECISIONS
from keras_dp_lm.clipping.fast import _LAST_REASONS
from keras_dp_lm.clipping.recording import _Plan
from keras_dp_lm.clipping.registry import _rules
from keras_dp_lm.clipping.registry import _lora_unsupported

if TYPE_CHECKING:
    import keras


def clipping_coverage(model: keras.Model, sequence_length: int | None = None,
                      batch_size: int | None = None) -> dict[str, str]:
    """How each trainable variable's per-example norm will be computed.

    Returns a dict ``var.path -> "ghost" | "instantiate" | "exact"``:

    * ``"ghost"``: norm from Gram matrices of layer inputs and output
      gradients, never forming the per-example gradient;
    * ``"instantiate"``: per-example gradient formed (transiently, or kept when
      tiny: norm scales, biases) to take its norm;
    * ``"exact"``: no fast rule; exact per-example gradients from one
      forward/backward pass per example (``method="auto"``) or an
      :class:`UncoveredLayersError` (``method="fast"``).

    Covered variables' clipped sums always use book-keeping (one
    ``sum_i c_i a_i^T g_i`` matmul, or ``sum_i c_i grad_i`` when instantiated).
    Without ``sequence_length``, the decisions of the last
    :func:`fast_clipped_sum` call on this model are reported if there was one,
    else they are estimated for ``sequence_length=128, batch_size=32``.  The
    ghost / instantiate choice is made per call from static shapes.
    """
    plan = _Plan(model)
    last = _LAST_DECISIONS.get(model) if sequence_length is None else None
    T = sequence_length or 128
    B = batch_size or 32
    out = {}
    for v in plan.trainable:
        path = _var_path(v)
        if id(v) not in plan.covered:
            out[path] = "exact"
        elif last is not None and path in last:
            out[path] = last[path]
        else:
            layer, rule = plan.covered[id(v)]
            out[path] = rule.static_method(layer, v, T, B)
    return out


def exact_reason(model: keras.Model, variable: keras.Variable) -> str:
    """Why ``variable`` of ``model`` gets exact per-example gradients ("" when it
    does not): the reason the last :func:`fast_clipped_sum` on ``model``
    recorded, else one read from the model's layers."""
    reason = _LAST_REASONS.get(model, {}).get(_var_path(variable))
    if reason:
        return reason
    plan = _Plan(model)
    if id(variable) in plan.covered:
        return ""
    layer = plan.owners.get(id(variable))
    if layer is None:
        return "not created by a layer"
    if not _plain(layer):
        return "quantized or per-instance call"
    if _lora_unsupported(_rules().get(type(layer)), layer):
        return f"LoRA on {type(layer).__name__}: its rule does not describe LoRA adapters"
    if type(layer) not in _rules():
        parents = [c.__name__ for c in type(layer).__mro__[1:] if c in _rules()]
        if parents:
            return (f"{type(layer).__name__} subclasses {parents[0]} but is not registered "
                    "(register_clipping_rule): a subclass may change the computation")
        return f"no rule for {type(layer).__name__}"
    return "the rule does not cover this variable"


def coverage_report(model: keras.Model, sequence_length: int | None = None,
                    batch_size: int | None = None) -> str:
    """A readable table of :func:`clipping_coverage` with layer names and sizes.

    One row per trainable variable of ``model`` (a Keras model), then each
    method's share of the parameters and the uncovered layers.
    ``sequence_length`` (tokens per example) and ``batch_size`` (examples per
    call) are the shapes the ghost / instantiate choice is estimated at, as in
    :func:`clipping_coverage`: None reports the last :func:`fast_clipped_sum`
    call's decisions, or estimates at 128 and 32.
    """
    cov = clipping_coverage(model, sequence_length, batch_size)
    plan = _Plan(model)
    rows = []
    counts = collections.Counter()
    for v in plan.trainable:
        path = _var_path(v)
        layer = plan.owners.get(id(v))
        size = product_of([static_dim(s) for s in v.shape]) or 0
        counts[cov[path]] += size
        rows.append((path, _layer_desc(layer) if layer is not None else "-",
                     "x".join(str(s) for s in v.shape), cov[path],
                     exact_reason(model, v) if cov[path] == "exact" else ""))
    header = ("variable", "layer", "shape", "method", "why exact")
    w = [max([len(r[i]) for r in rows] + [len(h)]) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % n for n in w)
    lines = [fmt.format(*header), fmt.format(*("-" * n for n in w))]
    lines += [fmt.format(*r) for r in rows]
    total = sum(counts.values()) or 1
    lines.append("")
    lines.append("parameters: " + ", ".join(
        f"{k} {n} ({100.0 * n / total:.1f}%)" for k, n in sorted(counts.items())))
    uncovered = plan.describe(plan.uncovered)
    if uncovered:
        lines.append("uncovered layers (exact per-example gradients with "
                     "method='auto', error with method='fast'): "
                     + "; ".join(uncovered))
    return "\n".join(lines)
