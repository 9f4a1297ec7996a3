"""Scratch: levers for a DP head on small tasks, in a numpy simulation (issue 38).

Not part of the suite and not a test. A numpy re-run of the README path's DP head
(the package's ``DPFeatureNormalization``, then DP-Adam on Poisson batches with
per-example clipping at 0.1 and the recipe's noise, in numpy), fast enough to sweep levers
over every record-level task of the utility suite. Checked against the package on
``milton_work_600`` at epsilon 3: 71.1 here, 70.5 through Keras
(``utility_suite.py``'s ``head_norm`` row). Whatever it suggests must be rerun
through the package (``utility_suite.py``) before it counts.

Modes (3 seeds per cell; gaps to the stored best non-private head of the utility
suite's stored rows, ``SUITE_ROWS`` in ``benchmarks/results/``):

* ``rate``: the head's displacement (rate x steps) 1 / 2 / 4 / 8 at 100 steps, and
  ``min_steps`` 50 / 300 (batch resized for the same 50 epochs of compute).
* ``whiten``: whitening the unit features with a covariance from the task's own
  training features (an oracle, not private) or from public features of other
  corpora (the suite's other caches, a different text family), shrinkage 0.1 / 1.

    python benchmarks/variants/head_levers.py --data-dir data --mode rate
"""

import argparse
import glob
import json
import os
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]

import utility_tasks  # noqa: E402

# The utility suite's stored rows (``utility_suite.py --output``), read in this order
# (a later file's non-private row of a task replaces an earlier one's).
SUITE_ROWS = tuple(BENCHMARKS / "results" / name for name in (
    "utility_suite.json", "feature_normalization_development.json",
    "utility_heldout_feature_normalization.json"))

RATE_VARIANTS = (("D2 s100", 2, 100), ("D1 s100", 1, 100), ("D4 s100", 4, 100),
                 ("D8 s100", 8, 100), ("D2 s300", 2, 300), ("D4 s300", 4, 300),
                 ("D4 s50", 4, 50))
SEEDS = 3


def _unit(x):
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _normalized(splits, seed):
    """The package's ``DPFeatureNormalization`` (its DP mean seeded, as in a
    benchmark only), applied to every split."""
    from keras_dp_lm.data import DPFeatureNormalization

    layer = DPFeatureNormalization(seed=seed)
    layer.adapt(splits["train"][0])
    return {s: (np.asarray(layer(v[0]), "float64"), v[1]) for s, v in splits.items()}


def _dp_adam_head(x, y, classes, recipe, rate, rng, clip=0.1):
    """DP-Adam (Keras defaults) on a linear head with a bias, Poisson batches."""
    n = len(x)
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros((xb.shape[1], classes))
    m, v = np.zeros_like(w), np.zeros_like(w)
    q, batch = recipe.sampling_rate, recipe.sampling_rate * n
    for t in range(1, recipe.steps + 1):
        idx = np.nonzero(rng.random(n) < q)[0]
        xs = xb[idx]
        z = xs @ w
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(idx)), y[idx]] -= 1
        scale = np.minimum(1, clip / np.maximum(
            np.linalg.norm(p, axis=1) * np.linalg.norm(xs, axis=1), 1e-12))
        g = (xs.T @ (p * scale[:, None])
             + rng.normal(0, recipe.noise_multiplier * clip, w.shape)) / batch
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= rate * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-7)
    return w


def _accuracy(w, x, y):
    return float(np.mean(np.argmax(np.hstack([x, np.ones((len(x), 1))]) @ w, 1) == y))


def _recipe(n, classes, epsilon, min_steps=100):
    from keras_dp_lm.data import DPFeatureNormalization
    from keras_dp_lm.recipes import suggest_recipe

    return suggest_recipe(n, epsilon, 1e-6, epochs=50.0, min_steps=min_steps,
                          num_parameters=385 * classes, trainable="head",
                          extra_events=[DPFeatureNormalization().dp_event()])


def _gap(splits, classes, recipe, displacement, non_private):
    accs = []
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        sp = _normalized(splits, seed)
        w = _dp_adam_head(*sp["train"], classes, recipe, displacement / recipe.steps, rng)
        accs.append(_accuracy(w, *sp["test"]))
    return 100 * (np.mean(accs) - non_private)


def _family(source):
    found = {key for key in ("fortunes", "kjv", "rotten", "milton") if key in source}
    return found | ({"shakespeare"} if "shakespeare" in source or "folio" in source else set())


def _whitener(x, shrinkage):
    xu = _unit(x)
    values, vectors = np.linalg.eigh(np.cov((xu - xu.mean(0)).T))
    values = values + shrinkage * values.mean()
    return lambda a: _unit(a) @ vectors @ np.diag(values ** -0.5) @ vectors.T


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--mode", choices=("rate", "whiten"), default="rate")
    parser.add_argument("--tasks", nargs="*")
    args = parser.parse_args(argv)
    non_private = {}
    for path in SUITE_ROWS:
        for row in json.loads(path.read_text()):
            if "non_private" in row:
                non_private[row["task"]] = row["non_private"]["test"]
    tasks = args.tasks or [t for t in non_private if t not in utility_tasks.USER_LEVEL_TASKS]
    gaps = {}
    for name in tasks:
        splits = utility_tasks.load_task(name, args.data_dir)
        y = splits["train"][1]
        classes = int(max(y.max(), splits["test"][1].max())) + 1
        source = utility_tasks._SOURCES[name][0]  # noqa: SLF001 - the task's corpus
        for eps in (3.0, 8.0):
            if args.mode == "rate":
                recipes = {s: _recipe(len(y), classes, eps, s) for _, _, s in RATE_VARIANTS}
                cells = {label: _gap(splits, classes, recipes[s], d, non_private[name])
                         for label, d, s in RATE_VARIANTS}
            else:
                public = np.concatenate([
                    np.load(f)["train_x"] for f in sorted(glob.glob(
                        os.path.join(args.data_dir, "utility_suite", "*_minilm_mean.npz")))
                    if not _family(os.path.basename(f)) & _family(source)])
                recipe = _recipe(len(y), classes, eps)
                cells = {"base": _gap(splits, classes, recipe, 2, non_private[name])}
                for label, features in (("oracle", splits["train"][0]), ("public", public)):
                    for shrinkage in (0.1, 1.0):
                        white = _whitener(features, shrinkage)
                        cells[f"{label} s{shrinkage:g}"] = _gap(
                            {s: (white(v[0]), v[1]) for s, v in splits.items()},
                            classes, recipe, 2, non_private[name])
            gaps.update({(name, eps, k): g for k, g in cells.items()})
            print(name, len(y), eps, " ".join(f"{k}:{g:+.1f}" for k, g in cells.items()),
                  flush=True)
    for eps in (3.0, 8.0):
        for label in sorted({k for (_, e, k) in gaps if e == eps}):
            row = [gaps[(t, eps, label)] for t in tasks]
            print(f"eps {eps:g} {label}: mean {np.mean(row):+.2f}, within 3 points on "
                  f"{sum(g >= -3 for g in row)} of {len(row)}, worst {min(row):+.1f}")


if __name__ == "__main__":
    main()
