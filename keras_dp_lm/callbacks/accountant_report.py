"""The report of :class:`~keras_dp_lm.callbacks.PrivacyAccountant`: what the model has received so far."""

import math

from keras_dp_lm.accounting.epsilon import ledger_epsilon
from keras_dp_lm.accounting.overflow import overflow_probability
from keras_dp_lm.accounting.events import ledger_events
from keras_dp_lm.accounting.report import privacy_report
from keras_dp_lm.accounting.user_level import user_level_epsilon
from keras_dp_lm.training.model_ledgers import ledger_of


def accountant_report(accountant, assumptions, rows, searched, *, overflow_cap, batches_rate):
    """``accountant.report()`` (:meth:`PrivacyAccountant.report`).

    Args:
        accountant: the :class:`PrivacyAccountant` (its public attributes: the model,
            ``dataset_size``, ``delta``, ``accountant``, ``extra_events``,
            ``examples_per_user``, ``target_epsilon``, ``max_steps``, ``epsilon``,
            ``stopped_at``).
        assumptions: its :class:`~keras_dp_lm.callbacks.fit_assumptions.FitAssumptions`.
        rows: the ledger's accounted rows with updates.
        searched: the events of the private search the model was released by, or [].
        overflow_cap: the real-example cap of the ``batches`` it was given, or None.
        batches_rate: the sampling rate of those batches, or None.
    """
    count = sum(row.updates for row in rows)
    unit = ledger_of(accountant.model).privacy_unit or "example"
    if unit == "user" and accountant.examples_per_user is not None:
        raise ValueError(
            "examples_per_user= adds a group-privacy epsilon to EXAMPLE-level "
            "training; this model's updates clipped whole users (user batches), so "
            "its epsilon is user-level already: drop examples_per_user.")
    if len(rows) <= 1:
        sigma = rows[0].noise_multiplier if rows else assumptions.noise_multiplier
        rate = rows[0].rate(accountant.dataset_size) if rows else assumptions.sampling_rate
        extra = accountant.extra_events + searched
    else:  # several configurations: the earlier rows compose as extra events
        sigma, rate = rows[-1].noise_multiplier, rows[-1].rate(accountant.dataset_size)
        extra = (ledger_events(rows[:-1], accountant.dataset_size) + accountant.extra_events
                 + searched)
        count = rows[-1].updates
    report = privacy_report(
        sigma, rate, count, accountant.delta,
        dataset_size=accountant.dataset_size, batch_size=rate * accountant.dataset_size,
        sampling=assumptions.sampling, accountant=accountant.accountant,
        extra_events=extra, target_epsilon=None,
        examples_per_user=accountant.examples_per_user,
        l2_norm_clip=assumptions.l2_norm_clip)
    if len(rows) > 1:
        # The headline is the training's whole ledger at delta, composed in
        # one accountant (the call above read the earlier rows as extra
        # releases, each at its own delta).
        epsilons = {name: ledger_epsilon(rows, accountant.dataset_size, accountant.delta, name)
                    for name in ("pld", "rdp")}
        report.update(epsilon=epsilons[accountant.accountant], epsilon_pld=epsilons["pld"],
                      epsilon_rdp=epsilons["rdp"], steps=sum(row.updates for row in rows))
        report["epochs"] = sum(row.updates * row.rate(accountant.dataset_size)
                               for row in rows)
        if not accountant.extra_events:
            report.update(extras=[], total_epsilon=report["epsilon"],
                          total_delta=accountant.delta, total_accountant=accountant.accountant,
                          sum_epsilon=report["epsilon"], sum_delta=accountant.delta)
        if accountant.examples_per_user is not None:
            # group privacy of one configuration, bounded by the costliest:
            # the smallest sigma and largest rate over all the updates
            report["user_level_epsilon"] = user_level_epsilon(
                min(row.noise_multiplier for row in rows),
                max(row.rate(accountant.dataset_size) for row in rows),
                sum(row.updates for row in rows), accountant.delta, accountant.examples_per_user,
                "group", accountant.accountant)
    if searched:
        # Released by a private search: the headline counts the search (whose
        # epsilon covers the released trial's updates) and what came after.
        report.update(epsilon=accountant.epsilon, search={
            "epsilon": searched[0].epsilon, "delta": searched[0].delta,
            "note": "the private hyperparameter search this model was released by"})
        report[f"epsilon_{accountant.accountant}"] = report["epsilon"]
        if accountant.accountant == "pld":
            report["epsilon_rdp"] = None  # RDP cannot compose an (epsilon, delta) release
        if not accountant.extra_events:
            report.update(total_epsilon=report["epsilon"], sum_epsilon=report["epsilon"])
    report["target_epsilon"] = accountant.target_epsilon
    report["max_steps"] = accountant.max_steps
    report.update({
        "dp_updates": sum(row.updates for row in rows),
        "ledger": [dict(row._asdict(), sampling_rate=row.rate(accountant.dataset_size))
                   for row in rows],
        "batch_size_source": assumptions.batch_size_source,
        "sampling_source": assumptions.sampling_source,
        "steps_per_execution": assumptions.steps_per_execution,
        "gradient_accumulation_steps": assumptions.gradient_accumulation_steps,
        "stopped_at": accountant.stopped_at,
        "privacy_unit": unit,
    })
    overflow = (overflow_probability(accountant.dataset_size, batches_rate, overflow_cap,
                                     report["dp_updates"]) if overflow_cap is not None else 0.0)
    if overflow > 0:
        # The draws differ from Poisson sampling only when a batch overflows its
        # cap, for both neighbours; every update of the ledger counts as a draw
        # from these batches (an over-count when earlier fits used others).
        eps = report["epsilon"]
        report["overflow_probability"] = overflow
        report["delta_with_overflow"] = _with_overflow(accountant.delta, eps, overflow)
        if report.get("extras") and report["total_epsilon"] is not None:
            # The whole pipeline's delta, the overflow included: what the user
            # asked for when the recipe made the accountant (it reserved the share).
            report["total_delta"] = _with_overflow(report["total_delta"],
                                                   report["total_epsilon"], overflow)
    return report


def _with_overflow(delta, epsilon, overflow):
    """``delta`` of an ``epsilon`` guarantee once a Poisson draw above the
    padded cap (probability ``overflow`` over the run) is counted."""
    if not math.isfinite(epsilon) or epsilon > 700:
        return 1.0
    return min(1.0, delta + (1.0 + math.exp(epsilon)) * overflow)
