"""One DP head path for balanced and unbalanced labels (issue 52), in balanced accuracy.

Issue 52's procedure (``benchmarks/results/imbalanced.md``) adopted the head trained with
DP class priors, logit adjustment (tau 1) and prior weights (``la_weights``) on eleven
unbalanced tasks. Before it replaces the README quick start's plain cross-entropy, this
measures what it does where classes are balanced: the README's own tasks. The procedure
and the criterion are in ``benchmarks/results/balanced_heads.md``, committed before the
first run.

Per task, 3 DP repeats at total epsilon 3 and 8 (every release composed into the
recipe): the README path (``readme``, the suite's ``head_norm`` row) and ``la_weights``
(``imbalanced.dp_head_priors``), with accuracy, each class's recall and balanced accuracy
(mean recall). Two non-private references on the same features: the suite's probe
(learning rate picked on validation accuracy) and the best of the same rates with and
without class-balanced loss weights, picked on validation *balanced* accuracy (the
bar's reference).

    python benchmarks/balanced_heads.py --data-dir data --tasks rotten_tomatoes \
        rotten_tomatoes_3000 --output benchmarks/results/balanced_heads.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

import imbalanced  # noqa: E402
import utility_suite  # noqa: E402
import utility_tasks  # noqa: E402


def non_private_balanced_best(splits, classes):
    """The best non-private probe by validation balanced accuracy, over the suite's
    rates, each with plain and with class-balanced loss weights (N / (K n_c))."""
    import keras

    (x, y), (xv, yv), (xt, yt) = (splits[s][:2] for s in ("train", "validation", "test"))
    counts = np.bincount(y, minlength=classes).astype("float64")
    balanced_weights = {c: len(y) / (classes * counts[c]) for c in range(classes) if counts[c]}
    best = None
    for weighted in (False, True):
        for lr in utility_suite.NON_PRIVATE_RATES:
            keras.utils.set_random_seed(0)
            model = utility_suite._probe(x.shape[1], classes)
            model.compile(optimizer=keras.optimizers.Adam(lr),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=64, epochs=30, verbose=0,
                      class_weight=balanced_weights if weighted else None)
            val = float(np.mean(utility_suite._test_scores(model, xv, yv)["test_recall"]))
            if best is None or val > best[0]:
                best = (val, lr, weighted, utility_suite._test_scores(model, xt, yt))
    return {"validation_balanced": best[0], "learning_rate": best[1],
            "class_weighted": best[2], **best[3]}


def run_task(name, data_dir, repeats):
    splits = utility_tasks.load_task(name, data_dir)
    y = splits["train"][1]
    classes = int(max(y.max(), splits["test"][1].max())) + 1
    row = {"task": name, "train_size": int(len(y)), "classes": classes,
           "smallest_class": int(np.bincount(y, minlength=classes).min())}
    t = time.time()
    row["non_private"] = utility_suite.non_private_best(splits, classes)
    row["non_private_balanced"] = non_private_balanced_best(splits, classes)
    row["variants"] = {
        "readme": {f"eps{eps:g}": [utility_suite.dp_head_normalized(splits, classes, eps)
                                   for _ in range(repeats)] for eps in utility_suite.EPSILONS},
        "la_weights": {f"eps{eps:g}": [imbalanced.dp_head_priors(splits, eps, 1.0, True,
                                                                 classes=classes)
                                       for _ in range(repeats)]
                       for eps in utility_suite.EPSILONS}}
    row["seconds"] = time.time() - t
    return row


def _scores(runs):
    """(accuracy, balanced accuracy, smallest recall), %, means over ``runs``."""
    recall = np.mean([r["test_recall"] for r in runs], axis=0)
    return (100 * np.mean([r["test"] for r in runs]), 100 * recall.mean(), 100 * recall.min())


def markdown(rows):
    lines = ["| task | N / smallest class | row | eps 3: acc / balanced / lowest recall | "
             "eps 8: same | largest total epsilon (eps 3 / 8) |", "|---|---|---|---:|---:|---:|"]
    for row in rows:
        size = f"{row['train_size']:,} / {row['smallest_class']:,}"
        for label, key in (("non-private probe (picked on accuracy)", "non_private"),
                           ("non-private probe (picked on balanced accuracy)",
                            "non_private_balanced")):
            lines.append(f"| {row['task']} | {size} | {label} | "
                         + "{:.1f} / {:.1f} / {:.1f}".format(*_scores([row[key]])) + " | | |")
        for variant, runs in row["variants"].items():
            cells = [_scores(runs[f"eps{eps:g}"]) for eps in utility_suite.EPSILONS]
            spent = " / ".join(f"{max(r['total_epsilon'] for r in runs[f'eps{eps:g}']):.4f}"
                               for eps in utility_suite.EPSILONS)
            lines.append(f"| {row['task']} | {size} | {variant} | "
                         + " | ".join("{:.1f} / {:.1f} / {:.1f}".format(*c) for c in cells)
                         + f" | {spent} |")
    return "\n".join(lines)


def unbalanced_rows(data_dir, dp_rows_json):
    """Issue 52's bar on the unbalanced tasks: their DP rows as run
    (``imbalanced_class_priors.json``), with the balanced-picked non-private probe
    computed here on the same subsample (the stored probe was picked on accuracy)."""
    rows = json.loads(Path(dp_rows_json).read_text())
    for row in rows:
        splits, _ = imbalanced.load_unbalanced(row["task"], data_dir)
        row["non_private_balanced"] = non_private_balanced_best(splits, 2)
        row["smallest_class"] = int(np.bincount(splits["train"][1], minlength=2).min())
    return rows


def unbalanced_markdown(rows):
    """One line per unbalanced task: the bar's three tests for ``readme`` and
    ``la_weights`` (smallest class under 400, so balanced accuracy within 3 points
    of the balanced-picked probe at epsilon 8; rare recall at epsilon 8 at least
    half the probe's; rare recall at least 5% at epsilon 3)."""
    lines = ["| task | rare train | probe balanced / rare recall (picked on balanced) | "
             "variant | eps 3: balanced / rare recall | eps 8: same | gap at eps 8 | "
             "bar: gap >= -3 / rare eps 8 >= half / rare eps 3 >= 5 |",
             "|---|---:|---:|---|---:|---:|---:|---|"]
    for row in rows:
        probe = _scores([row["non_private_balanced"]])
        probe_rare = 100 * row["non_private_balanced"]["test_recall"][1]
        for variant in ("readme", "la_weights"):
            runs = row["variants"][variant]
            cells = [_scores(runs[f"eps{eps:g}"]) for eps in utility_suite.EPSILONS]
            rare = [100 * np.mean([r["test_recall"][1] for r in runs[f"eps{eps:g}"]])
                    for eps in utility_suite.EPSILONS]
            gap = cells[1][1] - probe[1]
            verdict = " / ".join("yes" if ok else "**no**" for ok in (
                gap >= -3.0, rare[1] >= 0.5 * probe_rare, rare[0] >= 5.0))
            lines.append(f"| {row['task']} | {row['smallest_class']} | {probe[1]:.1f} / "
                         f"{probe_rare:.1f} | {variant} | {cells[0][1]:.1f} / {rare[0]:.1f} | "
                         f"{cells[1][1]:.1f} / {rare[1]:.1f} | {gap:+.1f} | {verdict} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="*", default=["rotten_tomatoes", "rotten_tomatoes_3000"])
    parser.add_argument("--output", default=str(BENCHMARKS / "results" / "balanced_heads.json"))
    parser.add_argument("--from-json", default=None, help="render an earlier run's rows")
    parser.add_argument("--unbalanced", default=None, metavar="JSON",
                        help="instead: the bar on the unbalanced tasks of this "
                             "imbalanced.py --variants output (readme, la_weights)")
    args = parser.parse_args(argv)
    if args.unbalanced:
        rows = unbalanced_rows(args.data_dir, args.unbalanced)
        Path(args.output).write_text(json.dumps(rows, indent=1))
        print(unbalanced_markdown(rows))
        return
    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())))
        return
    utility_tasks.build_cache(args.data_dir, utility_tasks.sources_of(args.tasks))
    rows = []
    for name in args.tasks:
        rows.append(run_task(name, args.data_dir, args.repeats))
        print("\n".join(markdown(rows[-1:]).splitlines()[2:]), flush=True)
        Path(args.output).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
