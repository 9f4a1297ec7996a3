"""Diagnostic: how far can either DP head get on the suite tasks where the README path misses? (issue 52)

Not part of the suite and not a test; nothing here is adopted from it. Three measurements
on a task, each against the non-private probe picked on validation balanced accuracy
(``balanced_heads.non_private_balanced_best``), in balanced accuracy:

* ``grid``: the README path's trained head (``DPFeatureNormalization``, ``DPClassPriors``,
  the logit-adjusted class-weighted loss, DP-Adam on Poisson batches) over 12 recipes
  (``epochs`` 20 / 50 / 150 x ``head_displacement`` 1 / 2 / 4 / 8), 3 repeats each, and
  the best of the 12 **picked on the test split**: an optimistic upper bound on what
  tuning these two knobs could reach, not a method;
* ``class-means``: ``class_means_head.dp_class_means`` (the class-means head with the
  normalization's release, total ``epsilon``) over 8 repeats;
* ``ceiling``: the same class-means head with a negligible noise (1e-9): what class means
  reach without privacy;
* ``learning-curve``: the same non-private probe (picked on validation balanced accuracy)
  trained on a seeded class-stratified quarter and half of the training split (2 draws
  each): what the task's learning curve gives back between them and all of it, to read
  against the DP rows (which fraction of the data a DP head is worth).

    python benchmarks/variants/head_ceilings.py --data-dir data --mode grid \\
        --task milton_work_600 --epsilon 8
"""

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

import balanced_heads  # noqa: E402
import class_means_head  # noqa: E402
import head_rule  # noqa: E402
import imbalanced  # noqa: E402

EPOCHS = (20.0, 50.0, 150.0)
DISPLACEMENTS = (1.0, 2.0, 4.0, 8.0)


def _balanced(recall):
    return 100 * float(np.mean(recall))


def trained_head(splits, epsilon, classes, epochs, displacement):
    """One run of the README path's trained head (``imbalanced.dp_head_priors``) with
    these two recipe choices: ``(balanced accuracy %, steps)``."""
    result = imbalanced.dp_head_priors(splits, epsilon, 1.0, True, classes=classes,
                                       head_displacement=displacement, epochs=epochs)
    assert result["total_epsilon"] <= epsilon + 1e-6
    return _balanced(result["test_recall"]), result["steps"]


def noiseless_class_means(splits, classes):
    """The class-means head with noise 1e-9 on both releases (no privacy)."""
    from keras_dp_lm.data import DPClassMeans
    from keras_dp_lm.data import DPFeatureNormalization

    (x, y), (xt, yt) = splits["train"][:2], splits["test"][:2]
    normalization = DPFeatureNormalization(noise_multiplier=1e-9, seed=0)
    normalization.adapt(x)
    means = DPClassMeans(classes, 1e-9, seed=0)
    means.adapt(np.asarray(normalization(x)), y)
    predicted = np.argmax(np.asarray(means(normalization(xt))), 1)
    return _balanced([np.mean(predicted[yt == c] == c) for c in range(classes)])


LEARNING_CURVE_FRACTIONS = (0.25, 0.5)
LEARNING_CURVE_DRAWS = 2


def stratified_fraction(splits, fraction, seed):
    """``splits`` with a seeded ``fraction`` of each class's training examples (at least
    one per class); validation and test unchanged."""
    x, y = splits["train"][:2]
    rng = np.random.default_rng(seed)
    keep = np.concatenate([
        rng.choice(np.flatnonzero(y == c), max(1, round(fraction * np.sum(y == c))),
                   replace=False) for c in np.unique(y)])
    return {**splits, "train": (x[keep], y[keep])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--mode", choices=("grid", "class-means", "ceiling", "learning-curve"),
                        required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--epsilon", type=float, default=8.0)
    args = parser.parse_args(argv)
    splits, classes, _ = head_rule.load(args.task, args.data_dir)
    probe = _balanced(balanced_heads.non_private_balanced_best(splits, classes)["test_recall"])
    name = args.task
    if args.mode == "ceiling":
        score = noiseless_class_means(splits, classes)
        print(f"{name} probe {probe:.1f} noiseless class means {score:.1f} "
              f"({score - probe:+.1f})")
    elif args.mode == "learning-curve":
        cells = {f: [_balanced(balanced_heads.non_private_balanced_best(
            stratified_fraction(splits, f, seed), classes)["test_recall"])
            for seed in range(LEARNING_CURVE_DRAWS)] for f in LEARNING_CURVE_FRACTIONS}
        print(f"{name} probe {probe:.1f} " + " ".join(
            f"{f:g}: {np.mean(v):.1f} ({np.mean(v) - probe:+.1f})" for f, v in cells.items()),
            flush=True)
    elif args.mode == "class-means":
        scores = [_balanced(class_means_head.dp_class_means(
            splits, args.epsilon, classes)["test_recall"]) for _ in range(8)]
        print(f"{name} {args.epsilon:g} class means {np.mean(scores):.1f} +- "
              f"{np.std(scores) / np.sqrt(len(scores)):.1f} (gap {np.mean(scores) - probe:+.1f};"
              f" probe {probe:.1f})", np.round(scores, 1))
    else:
        means = {}
        for epochs, displacement in itertools.product(EPOCHS, DISPLACEMENTS):
            runs = [trained_head(splits, args.epsilon, classes, epochs, displacement)
                    for _ in range(3)]
            means[(epochs, displacement)] = np.mean([r[0] for r in runs])
            print(f"{name} {args.epsilon:g} epochs {epochs:g} D {displacement:g} steps "
                  f"{runs[0][1]}: {means[(epochs, displacement)]:.1f} gap "
                  f"{means[(epochs, displacement)] - probe:+.1f}", flush=True)
        best = max(means, key=means.get)
        print(f"BEST {name} {args.epsilon:g} {best} {means[best]:.1f} gap "
              f"{means[best] - probe:+.1f} (probe {probe:.1f}; default 50/2: "
              f"{means[(50.0, 2.0)] - probe:+.1f})")


if __name__ == "__main__":
    main()
