"""The README path's DP head on unbalanced binary tasks (issue 38).

Does the DP head (``DPFeatureNormalization`` + ``suggest_recipe(trainable="head")``,
the utility suite's ``head_norm`` row) still predict the rare class when one class
is 5-20% of the data, as rare labels in clinical or support text often are?

Each task takes a binary suite task and keeps a seeded subsample: ``train_size``
training examples of which ``minority`` are class 1; validation and test keep every
class-0 example and as many class-1 examples as give the same share. The tasks, the
metrics and the verdict below were fixed before the package was run on them; four
(marked ``seen``) had been run once in a numpy re-run of the head
(``benchmarks/variants/head_levers.py``) when the collapse was noticed.

Metrics, 3 DP repeats at epsilon 3 and 8: accuracy; each class's recall; balanced
accuracy (the mean recall). The verdict "ends at the majority class" is a minority
recall under 5% (mean of the repeats).

    python benchmarks/imbalanced.py --data-dir data
    # writes benchmarks/results/imbalanced.json

Issue 52 (lever 1, class-aware DP training): ``--variants`` runs the README path and
the head trained with ``DPClassPriors`` (a DP release of the label counts, composed
into the recipe's total) and ``LogitAdjustedSparseCategoricalCrossentropy``, on the
seven development tasks and the four ``HELD_OUT`` tasks (``--tasks``); the procedure
and the adoption criteria are in ``benchmarks/results/imbalanced.md`` (committed before
the runs).

    python benchmarks/imbalanced.py --data-dir data --variants readme la weights la_weights \
        --output benchmarks/results/imbalanced_class_priors.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

import utility_suite  # noqa: E402
import utility_tasks  # noqa: E402

# name: (suite task, minority share, training examples, seen before the runs)
TASKS = {"shakespeare_genre_10pct_1000": ("shakespeare_genre_2000", 0.10, 1000, True),
         "milton_shakespeare_5pct_1000": ("milton_vs_shakespeare_2000", 0.05, 1000, True),
         "milton_shakespeare_10pct_1000": ("milton_vs_shakespeare_2000", 0.10, 1000, True),
         "rotten_tomatoes_10pct_3000": ("rotten_tomatoes", 0.10, 3000, True),
         "rotten_tomatoes_20pct_1000": ("rotten_tomatoes", 0.20, 1000, False),
         "shakespeare_history_20pct_1000": ("shakespeare_history_2000", 0.20, 1000, False),
         "kjv_testament_5pct_1000": ("kjv_testament_2000", 0.05, 1000, False)}
# Issue 52's held-out tasks, fixed before any variant ran on them: one class of a
# multi-class suite task against the others pooled (class 1 = the rare one).
# name: (suite task, minority share, training examples, the source class made class 1)
HELD_OUT = {"fortunes_science_10pct_1000": ("fortunes_6", 0.10, 1000, 2),
            "fortunes_wisdom_5pct_1000": ("fortunes_5b", 0.05, 1000, 3),
            "kjv_john_10pct_1000": ("kjv_gospel", 0.10, 1000, 3),
            "shakespeare_tempest_5pct_1000": ("shakespeare_play_1500", 0.05, 1000, 0)}
MAJORITY_RECALL = 0.05
# Issue 52's variants: (tau, class_weighting) of the loss; "readme" is the README path.
VARIANTS = {"readme": None, "la": (1.0, False), "weights": (0.0, True),
            "la_weights": (1.0, True)}


def unbalanced(splits, minority, train_size, seed=0, rare=1, round_count=False):
    """A seeded subsample where class ``rare`` is ``minority`` of the ``train_size``
    training examples (the others drawn uniformly, so they keep their proportions);
    validation and test keep every other example and as many of ``rare`` as give
    the same share (that count truncated, or rounded with ``round_count``)."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, (x, y) in splits.items():
        others, rares = np.flatnonzero(y != rare), np.flatnonzero(y == rare)
        if split == "train":
            n_rare = int(round(minority * train_size))
            n_others = train_size - n_rare
        else:
            n_others = len(others)
            n_rare = n_others * minority / (1 - minority)
            n_rare = int(round(n_rare)) if round_count else int(n_rare)
        if n_others > len(others) or n_rare > len(rares):
            raise ValueError(f"{split}: not enough examples for {minority:.0%} of {train_size}")
        keep = np.concatenate([rng.choice(others, n_others, replace=False),
                               rng.choice(rares, n_rare, replace=False)])
        out[split] = (x[keep], y[keep])
    return out


def load_unbalanced(name, data_dir):
    """``(splits, row)`` of a development (``TASKS``) or held-out (``HELD_OUT``) task."""
    if name in HELD_OUT:
        source, minority, train_size, positive = HELD_OUT[name]
        seen = False
        splits = {s: (x, (y == positive).astype("int32"))
                  for s, (x, y) in utility_tasks.load_task(source, data_dir).items()}
    else:
        source, minority, train_size, seen = TASKS[name]
        splits = utility_tasks.load_task(source, data_dir)
    splits = unbalanced(splits, minority, train_size)
    row = {"task": name, "source": source, "minority": minority, "train_size": train_size,
           "seen": seen, "held_out": name in HELD_OUT,
           "majority_test": float(np.mean(splits["test"][1] == 0))}
    return splits, row


def dp_head_priors(splits, epsilon, tau, class_weighting, classes=2, normalization=None,
                   priors=None, head_displacement=None, epochs=None, initial_head=None):
    """The README path plus ``DPClassPriors`` (released once, composed into the
    recipe's total with the mean's release) and the logit-adjusted loss; the test
    predictions use the raw logits. ``normalization`` / ``priors``: releases already
    made on the training split (used as they are, not released again);
    ``head_displacement``, ``epochs``: the recipe's (``None``: the default, and the
    suite's ``DP_EPOCHS``); ``initial_head``: a released ``DPClassMeans`` whose
    logits start the trained head (composed into the total), else zeros."""
    import keras

    from keras_dp_lm.data import DPClassPriors
    from keras_dp_lm.data import DPFeatureNormalization
    from keras_dp_lm.data import LogitAdjustedSparseCategoricalCrossentropy
    from keras_dp_lm.recipes import suggest_recipe

    (x, y, *users), (xt, yt) = splits["train"], splits["test"][:2]
    user_ids = users[0] if users else None  # a user-level task: the unit is a user
    if normalization is None:
        normalization = DPFeatureNormalization()
        normalization.adapt(x, user_ids=user_ids)
    if priors is None:
        priors = DPClassPriors(num_classes=classes)
        priors.release(y, user_ids=user_ids)
    displacement = {} if head_displacement is None else {"head_displacement": head_displacement}
    recipe = suggest_recipe(utility_suite._privacy_units(splits), epsilon, utility_suite.DELTA,
                            epochs=utility_suite.DP_EPOCHS if epochs is None else epochs,
                            num_parameters=(x.shape[1] + 1) * classes, trainable="head",
                            extra_events=[normalization.dp_event(), priors.dp_event(),
                                          *([] if initial_head is None
                                            else [initial_head.dp_event()])],
                            **displacement)
    model = keras.Sequential([keras.Input((x.shape[1],)), normalization,
                              utility_suite._probe(x.shape[1], classes)])
    if initial_head is not None:  # the class means' logits on the normalised features
        kernel, bias = (np.asarray(w) for w in (initial_head.kernel, initial_head.bias))
        model.layers[-1].layers[-1].set_weights([kernel / initial_head.max_norm, bias])
    batches = (recipe.poisson_user_batches((x, y), user_ids, utility_suite.EXAMPLES_PER_USER)
               if users else recipe.poisson_batches((x, y)))
    optimizer = recipe.optimizer(utility_suite.DP_OPTIMIZER)
    model.compile(optimizer=optimizer, loss=LogitAdjustedSparseCategoricalCrossentropy(
        priors, tau=tau, class_weighting=class_weighting))
    accountant = recipe.accountant(batches=batches, verbose=0)
    model.fit(batches, epochs=1, callbacks=[accountant], verbose=0, shuffle=False)
    report = accountant.report()
    return {**utility_suite._test_scores(model, xt, yt),
            "learning_rate": float(optimizer.learning_rate.numpy()), "steps": recipe.steps,
            "released_prior_1": float(priors.priors[1]),  # a DP output
            "epsilon": accountant.epsilon, "total_epsilon": report["total_epsilon"],
            "total_delta": report["total_delta"]}


def _dp_run(splits, epsilon, variant):
    if VARIANTS[variant] is None:
        return utility_suite.dp_head_normalized(splits, 2, epsilon)
    return dp_head_priors(splits, epsilon, *VARIANTS[variant])


def run_task(name, data_dir, repeats, variants=None):
    splits, row = load_unbalanced(name, data_dir)
    t = time.time()
    row["non_private"] = utility_suite.non_private_best(splits, 2)
    if variants is None:  # issue 38's run: the README path only, rows at the top level
        for eps in utility_suite.EPSILONS:
            row[f"eps{eps:g}"] = [utility_suite.dp_head_normalized(splits, 2, eps)
                                  for _ in range(repeats)]
    else:
        row["variants"] = {variant: {f"eps{eps:g}": [_dp_run(splits, eps, variant)
                                                     for _ in range(repeats)]
                                     for eps in utility_suite.EPSILONS}
                           for variant in variants}
    row["seconds"] = time.time() - t
    return row


def _summary(runs):
    accuracy = 100 * np.mean([r["test"] for r in runs])
    recall = np.mean([r["test_recall"] for r in runs], axis=0)
    return accuracy, 100 * recall.mean(), 100 * recall[1]


def markdown(rows):
    lines = ["| task | seen | majority | non-private: acc / balanced / minority recall | "
             "eps 3: acc / balanced / minority recall | eps 8: same | at the majority "
             "class (eps 3 / 8) |", "|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        cells = [_summary([row["non_private"]])] + [
            _summary(row[f"eps{eps:g}"]) for eps in utility_suite.EPSILONS]
        collapsed = ["yes" if c[2] < 100 * MAJORITY_RECALL else "no" for c in cells[1:]]
        lines.append(f"| {row['task']} | {'yes' if row['seen'] else 'no'} | "
                     f"{100 * row['majority_test']:.1f} | "
                     + " | ".join(f"{a:.1f} / {b:.1f} / {m:.1f}" for a, b, m in cells)
                     + f" | {' / '.join(collapsed)} |")
    return "\n".join(lines)


def variant_markdown(rows):
    """One line per task and variant, with issue 52's three criteria (means of the
    repeats): rare recall >= 5% at eps 3; rare recall at eps 8 >= half the
    non-private probe's; balanced accuracy within 1 point of the README path's at
    eps 3 and at eps 8 (the README path's own line says "-")."""
    lines = ["| task | set | variant | eps 3: acc / balanced / rare recall | eps 8: same | "
             "(a) rare >= 5% at eps 3 | (b) eps-8 rare >= half non-private | "
             "(c) balanced >= README - 1 (eps 3 / 8) |",
             "|---|---|---|---:|---:|---|---|---|"]
    for row in rows:
        non_private = _summary([row["non_private"]])
        kind = "held-out" if row.get("held_out") else "dev"
        lines.append(f"| {row['task']} | {kind} | non-private probe | "
                     + "{:.1f} / {:.1f} / {:.1f}".format(*non_private) + " | | | | |")
        base = row["variants"].get("readme")
        for variant, runs in row["variants"].items():
            cells = [_summary(runs[f"eps{eps:g}"]) for eps in utility_suite.EPSILONS]
            a = "yes" if cells[0][2] >= 100 * MAJORITY_RECALL else "**no**"
            b = "yes" if cells[1][2] >= 0.5 * non_private[2] else "**no**"
            if variant == "readme" or base is None:
                c = "-"
            else:
                ref = [_summary(base[f"eps{eps:g}"]) for eps in utility_suite.EPSILONS]
                c = " / ".join("yes" if cell[1] >= r[1] - 1.0 else "**no**"
                               for cell, r in zip(cells, ref))
            lines.append(f"| {row['task']} | {kind} | {variant} | "
                         + " | ".join("{:.1f} / {:.1f} / {:.1f}".format(*cell)
                                      for cell in cells) + f" | {a} | {b} | {c} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS),
                        help=f"development tasks {list(TASKS)} or held-out {list(HELD_OUT)}")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=None,
                        help="issue 52: run these variants (readme: the README path)")
    parser.add_argument("--output", default=str(BENCHMARKS / "results" / "imbalanced.json"))
    args = parser.parse_args(argv)
    rows = []
    table = markdown if args.variants is None else variant_markdown
    for name in args.tasks:
        rows.append(run_task(name, args.data_dir, args.repeats, args.variants))
        print("\n".join(table(rows[-1:]).splitlines()[2:]), flush=True)
        Path(args.output).write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
