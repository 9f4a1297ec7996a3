"""The DP class-means head against the trained head where classes are small (issue 52).

Issue 52's bar for fewer than 400 examples in the smallest class is balanced accuracy
within 3 points of the best non-private probe at epsilon 8, and rare classes predicted.
The trained head of the README (``la_weights``: DP class priors, logit adjustment and
prior weights) met it on 5 of 11 unbalanced tasks (``balanced_heads.md``).
``keras_dp_lm.data.DPClassMeans`` replaces training by one release of the class sums
and counts (a nearest-class-mean head). The procedure, the held-out tasks and the
criterion are in ``benchmarks/results/class_means_head.md``, committed before the first
run.

Rows per task, 3 repeats at total epsilon 3 and 8 (delta 1e-6, every release composed):
``la_weights`` (``imbalanced.dp_head_priors``, unchanged) and ``class_means``
(``DPFeatureNormalization`` + ``DPClassMeans.for_budget``), with the non-private probe
picked on validation balanced accuracy (``balanced_heads.non_private_balanced_best``).

    python benchmarks/class_means_head.py --data-dir data --output \\
        benchmarks/results/class_means_head.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

import balanced_heads  # noqa: E402
import imbalanced  # noqa: E402
import utility_suite  # noqa: E402
import utility_tasks  # noqa: E402

# Held-out unbalanced tasks, fixed with the procedure before any run: one class of a
# suite source against the others pooled (class 1 = the rare one), none of them a class
# an earlier unbalanced task used. name: (suite task, minority share, training
# examples, the source class made class 1)
HELD_OUT = {"folio_comedy_5pct_1000": ("folio_genre", 0.05, 1000, 0),
            "folio_history_10pct_1000": ("folio_genre", 0.10, 1000, 1),
            "fortunes_startrek_10pct_600": ("fortunes_4c", 0.10, 600, 3),
            "fortunes_linux_20pct_600": ("fortunes_4c", 0.20, 600, 1),
            "fortunes_zippy_10pct_1000": ("fortunes_5b", 0.10, 1000, 4),
            "fortunes_songs_5pct_1000": ("fortunes_6", 0.05, 1000, 5),
            "kjv_poetry_10pct_1000": ("kjv_division", 0.10, 1000, 2)}
# Suite tasks with fewer than 400 training examples in their smallest class (the
# regime the class-means head is for), and the larger ones, for the regime boundary.
SMALL_SUITE = ("fortunes_6_1000", "fortunes_5b", "fortunes_4c", "fortunes_4d",
               "fortunes_5e", "kjv_division_1000", "fortunes_5f", "kjv_gospel",
               "milton_work_600", "shakespeare_play_1500")
LARGE_SUITE = ("rotten_tomatoes_3000", "shakespeare_genre_2000", "shakespeare_history_2000",
               "fortunes_6", "folio_genre")


def dp_class_means(splits, epsilon, classes, normalization=None, other_events=()):
    """``DPFeatureNormalization`` then ``DPClassMeans`` calibrated so that the two
    releases (and ``other_events``, releases made elsewhere on the same data) compose
    to ``epsilon``; no training. ``normalization``: a release already made."""
    import keras

    from keras_dp_lm.accounting import compose_epsilon
    from keras_dp_lm.data import DPClassMeans
    from keras_dp_lm.data import DPFeatureNormalization

    (x, y, *users), (xt, yt) = splits["train"], splits["test"][:2]
    user_ids = users[0] if users else None  # a user-level task: the unit is a user
    if normalization is None:
        normalization = DPFeatureNormalization()
        normalization.adapt(x, user_ids=user_ids)
    other_events = [normalization.dp_event(), *other_events]
    means = DPClassMeans.for_budget(classes, epsilon, utility_suite.DELTA,
                                    extra_events=other_events)
    means.adapt(np.asarray(normalization(x)), y, user_ids=user_ids)
    model = keras.Sequential([keras.Input((x.shape[1],)), normalization, means])
    events = [*other_events, means.dp_event()]
    return {**utility_suite._test_scores(model, xt, yt),
            "noise_multiplier": means.noise_multiplier,
            "total_epsilon": compose_epsilon(events, utility_suite.DELTA),
            "total_delta": utility_suite.DELTA}


def load(name, data_dir):
    """``(splits, classes, row)`` of a held-out unbalanced, development unbalanced
    (``imbalanced.TASKS`` / ``imbalanced.HELD_OUT``) or suite task."""
    if name in HELD_OUT:
        source, minority, train_size, positive = HELD_OUT[name]
        splits = {s: (x, (y == positive).astype("int32"))
                  for s, (x, y) in utility_tasks.load_task(source, data_dir).items()}
        splits, classes = imbalanced.unbalanced(splits, minority, train_size), 2
        kind = "held-out unbalanced"
    elif name in imbalanced.TASKS or name in imbalanced.HELD_OUT:
        (splits, _), classes = imbalanced.load_unbalanced(name, data_dir), 2
        kind = "development unbalanced"
    else:
        splits = utility_tasks.load_task(name, data_dir)
        classes = int(splits["train"][1].max()) + 1
        kind = "suite"
    y = splits["train"][1]
    row = {"task": name, "kind": kind, "train_size": int(len(y)), "classes": classes,
           "smallest_class": int(np.bincount(y, minlength=classes).min())}
    if len(splits["train"]) > 2:  # user-level: the bar counts privacy units (users)
        row["smallest_class_units"] = smallest_class_users(splits["train"], classes)
    return splits, classes, row


def smallest_class_users(train, classes):
    """The fewest users (privacy units) any class has, of a user-level task."""
    _, y, users = train
    return int(min(len(np.unique(users[y == c])) for c in range(classes)))


def run_task(name, data_dir, repeats, variants):
    splits, classes, row = load(name, data_dir)
    t = time.time()
    row["non_private_balanced"] = balanced_heads.non_private_balanced_best(splits, classes)
    make = {"la_weights": lambda eps: imbalanced.dp_head_priors(splits, eps, 1.0, True,
                                                                 classes=classes),
            "class_means": lambda eps: dp_class_means(splits, eps, classes)}
    row["variants"] = {variant: {f"eps{eps:g}": [make[variant](eps) for _ in range(repeats)]
                                 for eps in utility_suite.EPSILONS}
                       for variant in variants}
    row["seconds"] = time.time() - t
    return row


def _rare(runs, eps=None):
    """(balanced accuracy, rare-class recall), %, means over ``runs`` (class 1 is
    the rare one of an unbalanced task)."""
    runs = runs if eps is None else runs[f"eps{eps:g}"]
    recall = np.mean([r["test_recall"] for r in runs], axis=0)
    return 100 * recall.mean(), 100 * recall[1]


def bar_epsilon(row):
    """The epsilon at which issue 52's bar reads a row's gap: 8 below
    ``SMALL_DATA_UNITS_PER_CLASS`` privacy units in the smallest class, else 3."""
    from keras_dp_lm.recipes.expectations import SMALL_DATA_UNITS_PER_CLASS

    units = row.get("smallest_class_units", row["smallest_class"])
    return 8.0 if units < SMALL_DATA_UNITS_PER_CLASS else 3.0


def bar_markdown(rows):
    """Issue 52's bar, every row. Unbalanced tasks: balanced accuracy / rare recall,
    the gap at epsilon 8 and the three parts of the bar. Suite tasks: balanced
    accuracy / lowest recall and the gap where the bar reads it (epsilon 3 with at
    least 400 in the smallest class, epsilon 8 below)."""
    lines = ["| task | N / smallest class | probe | row | eps 3 | eps 8 | gap (at eps) | "
             "bar | largest total epsilon (3 / 8) |", "|---|---|---:|---|---:|---:|---:|---|---:|"]
    for row in rows:
        unbalanced = "unbalanced" in row["kind"]
        score = _rare if unbalanced else (lambda runs, eps=None: balanced_heads._scores(
            runs if eps is None else runs[f"eps{eps:g}"])[1:])
        probe = score([row["non_private_balanced"]])
        bar_eps = 8.0 if unbalanced else bar_epsilon(row)
        for variant, runs in row["variants"].items():
            eps3, eps8 = score(runs, 3.0), score(runs, 8.0)
            gap = (eps8 if bar_eps == 8.0 else eps3)[0] - probe[0]
            parts = [gap >= -3]
            if unbalanced:
                parts += [eps8[1] >= probe[1] / 2, eps3[1] >= 5]
            verdict = " / ".join("yes" if ok else "**no**" for ok in parts)
            spent = " / ".join(f"{max(r['total_epsilon'] for r in runs[f'eps{eps:g}']):.4f}"
                               for eps in utility_suite.EPSILONS)
            lines.append(f"| {row['task']} | {row['train_size']:,} / {row['smallest_class']:,}"
                         f" | {probe[0]:.1f} / {probe[1]:.1f} | {variant} | {eps3[0]:.1f} / "
                         f"{eps3[1]:.1f} | {eps8[0]:.1f} / {eps8[1]:.1f} | {gap:+.1f} "
                         f"({bar_eps:g}) | {verdict} | {spent} |")
    return "\n".join(lines)


def markdown(rows):
    """Balanced accuracy / smallest recall, %, and the gap to the probe, every row."""
    lines = ["| task | kind | N / smallest class | probe: balanced / lowest recall | row | "
             "eps 3: balanced / lowest recall | eps 8: same | gap at eps 8 | "
             "largest total epsilon (3 / 8) |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        probe = balanced_heads._scores([row["non_private_balanced"]])
        for variant, runs in row["variants"].items():
            cells = [balanced_heads._scores(runs[f"eps{eps:g}"])
                     for eps in utility_suite.EPSILONS]
            spent = " / ".join(f"{max(r['total_epsilon'] for r in runs[f'eps{eps:g}']):.4f}"
                               for eps in utility_suite.EPSILONS)
            lines.append(
                f"| {row['task']} | {row['kind']} | {row['train_size']:,} / "
                f"{row['smallest_class']:,} | {probe[1]:.1f} / {probe[2]:.1f} | {variant} | "
                + " | ".join(f"{c[1]:.1f} / {c[2]:.1f}" for c in cells)
                + f" | {cells[-1][1] - probe[1]:+.1f} | {spent} |")
    return "\n".join(lines)


def parse_arguments(argv, description, tasks, variants, choices=None):
    """The command line both head benchmarks share (``choices``: the variants one may
    ask for, ``variants`` by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--tasks", nargs="*", default=list(tasks))
    parser.add_argument("--variants", nargs="*", default=list(variants),
                        choices=list(choices or variants))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table", nargs="*", default=None, metavar="FILE",
                        help="print the bar table of these JSON files and exit")
    parser.add_argument("--output", default=None, help="write the rows as JSON (appended "
                        "to the file's rows when it exists)")
    return parser.parse_args(argv)


def run_rows(args, run, bar_table, row_table):
    """``--table``: print ``bar_table`` of the files; else run every task (``run(name,
    data_dir, repeats, variants)``), printing ``row_table`` of each row as it ends and
    writing the rows to ``--output`` after each (appended to the file's rows)."""
    if args.table is not None:
        print(bar_table([row for path in args.table
                         for row in json.loads(Path(path).read_text())]))
        return
    rows = []
    if args.output and Path(args.output).exists():
        rows = json.loads(Path(args.output).read_text())
    for name in args.tasks:
        try:
            row = run(name, args.data_dir, args.repeats, args.variants)
        except FileNotFoundError as error:  # a source whose features are not built
            print(f"{name}: not run ({error})", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(row_table([row]), flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps(rows, indent=1))
    print(row_table(rows))


def main(argv=None):
    args = parse_arguments(argv, __doc__.splitlines()[0],
                           list(HELD_OUT) + list(SMALL_SUITE) + list(LARGE_SUITE),
                           ["la_weights", "class_means"])
    run_rows(args, run_task, bar_markdown, markdown)


if __name__ == "__main__":
    main()
