"""Privacy reports: a dict, a readable statement and JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event

from keras_dp_lm.accounting._arguments import ACCOUNTANTS
from keras_dp_lm.accounting._arguments import POISSON_NOTE
from keras_dp_lm.accounting._arguments import SHUFFLE_NOTE
from keras_dp_lm.accounting._arguments import check_accountant
from keras_dp_lm.accounting._arguments import check_delta
from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.accounting._arguments import check_rate
from keras_dp_lm.accounting._arguments import check_steps
from keras_dp_lm.accounting.epsilon import compose_epsilon
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.epsilon import max_steps
from keras_dp_lm.accounting.events import EpsilonDeltaDpEvent
from keras_dp_lm.accounting.events import as_event
from keras_dp_lm.accounting.events import describe_event
from keras_dp_lm.accounting.events import epsilon_of
from keras_dp_lm.accounting.events import pick_accountant
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.user_level import user_level_epsilon

if TYPE_CHECKING:
    import dp_accounting


# ---------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------
def _finite_or_str(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else str(value)
    return value


def privacy_report(noise_multiplier: float, sampling_rate: float, steps: int, delta: float, *,
                   dataset_size: int | None = None, batch_size: int | None = None,
                   sampling: str = "poisson", accountant: str = "pld",
                   extra_events: Sequence[dp_accounting.DpEvent | tuple[float, float]] = (),
                   target_epsilon: float | None = None, examples_per_user: int | None = None,
                   l2_norm_clip: float | None = None) -> dict[str, Any]:
    """A dict describing the guarantee of a DP-SGD run (+ other releases).

    Keys: ``noise_multiplier, sampling_rate, steps, epochs, delta,
    epsilon_rdp, epsilon_pld, epsilon, accountant, sampling, sampling_note,
    extras, total_epsilon, total_delta, total_accountant, sum_epsilon,
    sum_delta`` (+ ``dataset_size, batch_size, l2_norm_clip, target_epsilon,
    max_steps, user_level_epsilon, examples_per_user``). ``epochs`` is
    ``steps * sampling_rate`` (expected passes over the data).

    The total composes training and every extra event in one accountant (PLD
    when it supports them all, else RDP) at ``total_delta``: the ``delta`` you
    asked for, plus the deltas of extra ``(epsilon, delta)`` pairs (a pair's
    delta is spent whatever the rest). A ``DpEvent`` composed in the same
    accountant adds no delta of its own: the total is the whole pipeline's
    epsilon at the delta you gave. ``sum_epsilon`` is the simple sum of
    epsilons, each event's at ``delta``, at ``sum_delta`` (``delta`` per
    event plus the pairs' deltas), for comparison only. ``extra_events``: the
    other releases, each a ``DpEvent`` or an ``(epsilon, delta)`` pair.

    Example:
        >>> r = privacy_report(1.1, 0.01, 1000, 1e-5, extra_events=[(0.5, 1e-6)])
        >>> r["total_epsilon"] < r["sum_epsilon"]
        True
    """
    noise_multiplier = check_noise(noise_multiplier)
    sampling_rate = check_rate(sampling_rate)
    steps = check_steps(steps)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    if sampling not in ("poisson", "shuffle"):
        raise ValueError(f"`sampling` must be 'poisson' or 'shuffle', got {sampling!r}.")
    extras = [as_event(e) for e in extra_events]

    eps = {name: compute_epsilon(noise_multiplier, sampling_rate, steps, delta, name)
           for name in ACCOUNTANTS}
    report = {
        "noise_multiplier": noise_multiplier,
        "sampling_rate": sampling_rate,
        "steps": steps,
        "epochs": steps * sampling_rate,
        "delta": delta,
        "epsilon_rdp": eps["rdp"],
        "epsilon_pld": eps["pld"],
        "epsilon": eps[accountant],
        "accountant": accountant,
        "sampling": sampling,
        "sampling_note": POISSON_NOTE if sampling == "poisson" else SHUFFLE_NOTE,
        "dataset_size": dataset_size,
        "batch_size": batch_size,
        "l2_norm_clip": l2_norm_clip,
        "target_epsilon": target_epsilon,
        "max_steps": None,
    }
    if target_epsilon is not None:
        report["max_steps"] = max_steps(target_epsilon, delta, noise_multiplier,
                                        sampling_rate, accountant, near=steps or None)

    extra_rows = []
    sum_eps, sum_delta = eps[accountant], delta
    for event in extras:
        if isinstance(event, EpsilonDeltaDpEvent):
            row = {"event": describe_event(event), "epsilon": float(event.epsilon),
                   "delta": float(event.delta)}
        else:
            name = pick_accountant([event], accountant)
            if name is None:
                raise ValueError(f"No accountant supports the extra event {event!r}.")
            row = {"event": describe_event(event),
                   "epsilon": epsilon_of(event, delta, name), "delta": delta}
        extra_rows.append(row)
        sum_eps += row["epsilon"]
        sum_delta += row["delta"]
    report["extras"] = extra_rows
    report["sum_epsilon"] = sum_eps
    report["sum_delta"] = sum_delta
    report["total_delta"] = delta + sum(float(event.delta) for event in extras
                                        if isinstance(event, EpsilonDeltaDpEvent))
    report["total_accountant"] = accountant
    report["total_epsilon"] = eps[accountant]
    if extras:
        training = dp_sgd_event(noise_multiplier, sampling_rate, steps)
        if noise_multiplier == 0 and steps > 0:
            training = dp_event.NonPrivateDpEvent()
        name = pick_accountant([training] + extras, "pld")
        report["total_accountant"] = name
        report["total_epsilon"] = (
            None if name is None or report["total_delta"] >= 1
            else compose_epsilon([training] + extras, report["total_delta"], name))

    report["examples_per_user"] = examples_per_user
    report["user_level_epsilon"] = None
    if examples_per_user is not None:
        report["user_level_epsilon"] = user_level_epsilon(
            noise_multiplier, sampling_rate, steps, delta, examples_per_user,
            "group", accountant)
    return report


def format_number(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}" if isinstance(value, float) else f"{value:,}"


def format_epsilon(value):
    """An epsilon rounded UP to 3 significant digits: the text never under-reports."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return "inf"
    if value <= 0:
        return "0"
    unit = 10.0 ** (math.floor(math.log10(value)) - 2)
    return f"{math.ceil(value / unit - 1e-9) * unit:.3g}"


def privacy_statement(report: Mapping[str, Any]) -> str:
    """A readable paragraph for a :func:`privacy_report` dict ``report``.

    Epsilons are rounded up to 3 significant digits.

    Example:
        >>> print(privacy_statement(privacy_report(1.1, 0.01, 1000, 1e-5)).split(".")[0])
        DP-SGD with noise multiplier 1
    """
    r = report
    user_level = r.get("privacy_unit") == "user"
    batch = ""
    if r.get("batch_size") and r.get("dataset_size"):
        batch = (f" (logical batch {format_number(r['batch_size'])} of "
                 f"{format_number(r['dataset_size'])} {'users' if user_level else 'examples'})")
    clip = (f", clipping norm {format_number(float(r['l2_norm_clip']))}"
            if r.get("l2_norm_clip") else "")
    other = "rdp" if r["accountant"] == "pld" else "pld"
    lines = [
        f"DP-SGD with noise multiplier {format_number(r['noise_multiplier'], 6)}{clip}, "
        f"sampling rate {format_number(r['sampling_rate'], 4)}{batch}, "
        f"{format_number(r['steps'])} noised updates ({r['epochs']:.2f} epochs)."
    ]
    if r["noise_multiplier"] == 0 and r["steps"] > 0:
        lines.append("This training is NOT differentially private "
                     "(noise multiplier 0): epsilon is infinite.")
    else:
        lines.append(
            f"It satisfies (epsilon = {format_epsilon(r['epsilon'])}, delta = {r['delta']:.3g})"
            f"-differential privacy for each "
            f"{'user (all of its examples)' if user_level else 'training example'}"
            f" under add/remove-one "
            f"adjacency ({r['accountant'].upper()} accountant; the "
            f"{other.upper()} accountant gives epsilon = {format_epsilon(r['epsilon_' + other])}).")
    lines.append(f"Sampling: {r['sampling_note']}.")
    if r.get("overflow_probability"):
        with_overflow = r["delta_with_overflow"]
        lines.append(
            f"The batches' padded cap is exceeded with probability "
            f"{r['overflow_probability']:.3g} over the run, where the draws are no longer "
            f"Poisson: counting it, delta = {with_overflow:.3g}"
            + (" (no guarantee: pick max_batch_size with suggest_max_batch_size)"
               if with_overflow >= 0.01 else "") + ".")
    if r.get("target_epsilon") is not None:
        lines.append(
            f"Target epsilon {format_number(float(r['target_epsilon']))}: at most "
            f"{format_number(r['max_steps'])} updates fit in the budget.")
    if r.get("extras"):
        parts = "; ".join(f"{row['event']}: epsilon = {format_epsilon(row['epsilon'])}, "
                          f"delta = {row['delta']:.3g}" for row in r["extras"])
        lines.append(f"Other releases composed with training: {parts}.")
        total = ("could not be composed in one accountant"
                 if r["total_epsilon"] is None else
                 f"satisfies (epsilon = {format_epsilon(r['total_epsilon'])}, delta = "
                 f"{r['total_delta']:.3g})-DP composed in one "
                 f"{r['total_accountant'].upper()} accountant")
        lines.append(
            f"The whole pipeline {total}; the simple sum of epsilons is "
            f"{format_epsilon(r['sum_epsilon'])} (delta {r['sum_delta']:.3g}).")
    if r.get("examples_per_user") is not None:
        lines.append(
            f"For a user contributing at most {r['examples_per_user']} examples: "
            f"epsilon = {format_epsilon(r['user_level_epsilon'])} at delta = {r['delta']:.3g} "
            "(group privacy over example-level DP" + ("; training alone: the other "
                                                      "releases are not in it)." if
                                                      r.get("extras") else ")."))
    return " ".join(lines)


def report_to_json(report: Mapping[str, Any]) -> dict[str, Any]:
    """``report`` with non-finite floats as strings, ready for ``json.dumps``."""
    out = {}
    for key, value in report.items():
        if isinstance(value, list):
            value = [{k: _finite_or_str(v) for k, v in row.items()}
                     if isinstance(row, dict) else row for row in value]
        out[key] = _finite_or_str(value)
    return out


