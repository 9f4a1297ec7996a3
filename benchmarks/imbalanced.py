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

    python benchmarks/imbalanced.py --data-dir data   # writes benchmarks/imbalanced.json
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
MAJORITY_RECALL = 0.05


def unbalanced(splits, minority, train_size, seed=0):
    """The seeded unbalanced subsample described in the module docstring."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, (x, y) in splits.items():
        zeros, ones = np.flatnonzero(y == 0), np.flatnonzero(y == 1)
        if split == "train":
            n_ones = int(round(minority * train_size))
            n_zeros = train_size - n_ones
        else:
            n_zeros = len(zeros)
            n_ones = int(n_zeros * minority / (1 - minority))
        if n_zeros > len(zeros) or n_ones > len(ones):
            raise ValueError(f"{split}: not enough examples for {minority:.0%} of {train_size}")
        keep = np.concatenate([rng.choice(zeros, n_zeros, replace=False),
                               rng.choice(ones, n_ones, replace=False)])
        out[split] = (x[keep], y[keep])
    return out


def run_task(name, data_dir, repeats):
    source, minority, train_size, seen = TASKS[name]
    splits = unbalanced(utility_tasks.load_task(source, data_dir), minority, train_size)
    row = {"task": name, "source": source, "minority": minority, "train_size": train_size,
           "seen": seen, "majority_test": float(np.mean(splits["test"][1] == 0))}
    t = time.time()
    row["non_private"] = utility_suite.non_private_best(splits, 2)
    for eps in utility_suite.EPSILONS:
        row[f"eps{eps:g}"] = [utility_suite.dp_head_normalized(splits, 2, eps)
                              for _ in range(repeats)]
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--output", default=str(BENCHMARKS / "imbalanced.json"))
    args = parser.parse_args(argv)
    rows = []
    for name in args.tasks:
        rows.append(run_task(name, args.data_dir, args.repeats))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        Path(args.output).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
