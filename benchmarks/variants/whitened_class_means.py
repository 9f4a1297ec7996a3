"""Diagnostic: the class-means head on publicly whitened features (issue 52).

Not part of the suite and not a test. The class-means head (``DPClassMeans``) meets
issue 52's epsilon-8 bar on the small multi-class tasks where the trained head misses
(``fortunes_5f``, ``milton_work_600``), and loses 4-7 points where the non-private
probe exploits the features' covariance (``shakespeare_play_1500``,
``shakespeare_genre_2000``, ``kjv_division_1000``, ``fortunes_4c``): a class mean
measures distance in the encoder's raw geometry. MiniLM's mean-pooled features are
anisotropic (a few directions carry most of the variance whatever the text), and that
part of the geometry is a property of the encoder, not of the private data: it can be
estimated on *public* text. This script whitens the features with a covariance of
public features (the suite's caches of the other text families: never the task's own
family), a fixed public linear map applied before the private releases, and asks:

* ``ceiling`` (no noise, no privacy): balanced accuracy of the nearest class mean on
  the features as the README path normalises them, against the same on whitened
  features (shrinkage ``s``: eigenvalues + s x their mean; ``--transform abtt``: the
  top 1-8 public principal directions projected out instead), and against a linear
  discriminant with the task's own within-class covariance (an oracle);
* ``dp``: the package's path (``class_means_head.dp_class_means``: the normalization's
  release and ``DPClassMeans``, total epsilon 3 and 8) on raw and on whitened features;
* ``trained``: the README's trained head (``imbalanced.dp_head_priors``) on raw and on
  whitened features;
* ``dp-lda``: a numpy simulation of a DP linear discriminant whose within-class
  covariance comes from one more Gaussian release (of the second moment), against the
  class means alone at the same total epsilon; ``dp-lda-lowrank``: the same with the
  covariance released only in the top principal directions of the public features.

``--center public`` subtracts the public mean with the whitening; ``--center task``
leaves the centring to ``DPFeatureNormalization`` (the task's DP mean); ``--power
0.25`` whitens half-way (the covariance's power -1/4). Results and
their reading: ``benchmarks/results/whitened_class_means.md`` (nothing adopted).
Gaps to the non-private probe picked on validation balanced accuracy (stored rows of
``class_means_head.py``; computed when a task has none).

    python benchmarks/variants/whitened_class_means.py --data-dir data --mode ceiling
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

import balanced_heads  # noqa: E402
import class_means_head  # noqa: E402
import head_rule  # noqa: E402
import utility_tasks  # noqa: E402
from head_levers import _family as family  # noqa: E402 - the same families there
from head_levers import _unit  # noqa: E402

STORED = tuple(BENCHMARKS / "results" / name for name in (
    "class_means_head.json", "class_means_head_development.json", "head_rule.json",
    "head_rule_second_round.json"))
SHRINKAGES = [0.03, 0.1, 0.3, 1.0]
def source_of(name):
    """The feature cache a task reads (a held-out unbalanced task: its suite source's)."""
    rule_tasks = {**head_rule.HELD_OUT, **head_rule.SECOND_ROUND}
    if name in rule_tasks:
        name = rule_tasks[name][0]
    if name in class_means_head.HELD_OUT:
        name = class_means_head.HELD_OUT[name][0]
    elif name not in utility_tasks.TASKS:
        import imbalanced

        name = imbalanced.TASKS.get(name, imbalanced.HELD_OUT.get(name))[0]
    return utility_tasks._SOURCES[name][0]  # noqa: SLF001 - the task's corpus


def public_features(data_dir, source):
    """Training features of every cached source of another text family."""
    mine = family(source)
    paths = sorted(glob.glob(os.path.join(data_dir, "utility_suite", "*_minilm_mean.npz")))
    return np.concatenate([np.load(p)["train_x"] for p in paths
                           if not family(os.path.basename(p)) & mine])


def whitener(public, shrinkage):
    """``(W, b)`` with ``unit(x) @ W + b`` the public-whitened feature: centred at the
    public mean, eigenvalues of the public covariance + shrinkage x their mean."""
    u = _unit(public.astype("float64"))
    mean = u.mean(0)
    values, vectors = np.linalg.eigh(np.cov((u - mean).T))
    values = np.maximum(values, 0) + shrinkage * values.mean()
    w = vectors @ np.diag(values ** -TRANSFORM["power"]) @ vectors.T
    return w, -mean @ w


def all_but_the_top(public, components):
    """``(W, b)`` projecting out the top ``components`` principal directions of the
    public features (Mu & Viswanath 2018's post-processing), centred at their mean."""
    u = _unit(public.astype("float64"))
    mean = u.mean(0)
    _, vectors = np.linalg.eigh(np.cov((u - mean).T))
    top = vectors[:, -int(components):]
    w = np.eye(len(mean)) - top @ top.T
    return w, -mean @ w


TRANSFORM = {"map": whitener, "power": 0.5}


def _balanced(predicted, y, classes):
    return float(np.mean([np.mean(predicted[y == c] == c) for c in range(classes)
                          if np.any(y == c)]))


def nearest_mean(train, test, classes, covariance_shrinkage=None):
    """Non-private nearest class mean on centred unit features; with a shrinkage, a
    linear discriminant with the task's own within-class covariance instead."""
    (x, y), (xt, yt) = train, test
    mean = _unit(x).mean(0)
    u, ut = _unit(_unit(x) - mean), _unit(_unit(xt) - mean)
    mu = np.stack([u[y == c].mean(0) for c in range(classes)])
    if covariance_shrinkage is None:
        scores = ut @ mu.T - 0.5 * (mu * mu).sum(1)
    else:
        within = np.cov((u - mu[y]).T)
        within += covariance_shrinkage * np.trace(within) / len(within) * np.eye(len(within))
        solved = np.linalg.solve(within, mu.T)
        scores = ut @ solved - 0.5 * (mu.T * solved).sum(0)
    return _balanced(np.argmax(scores, 1), yt, classes)


def probe(name, splits, classes):
    for path in STORED:
        for row in json.loads(path.read_text()) if path.exists() else ():
            if row["task"] == name:
                return float(np.mean(row["non_private_balanced"]["test_recall"]))
    return float(np.mean(balanced_heads.non_private_balanced_best(
        splits, classes)["test_recall"]))


CENTER = {"public": True}


def whiten(splits, w, b):
    """``unit(x) @ w + b``, or ``unit(x) @ w`` (the task's own centring left to the
    normalization) when ``CENTER["public"]`` is off."""
    b = b if CENTER["public"] else 0.0
    return {s: (_unit(v[0]) @ w + b, *v[1:]) for s, v in splits.items()}


def ceiling_cells(splits, classes, public):
    train, test = splits["train"][:2], splits["test"][:2]
    cells = {"raw": nearest_mean(train, test, classes)}
    for s in SHRINKAGES:
        white = whiten(splits, *TRANSFORM["map"](public, s))
        cells[f"white s{s:g}"] = nearest_mean(white["train"][:2], white["test"][:2], classes)
    for s in (0.1, 1.0):
        cells[f"oracle LDA s{s:g}"] = nearest_mean(train, test, classes, s)
    return cells


def head_cells(splits, classes, public, repeats, shrinkages, head, prefix=""):
    """Mean balanced accuracy of ``head(splits, epsilon, classes)`` (a benchmark
    function returning ``test_recall``) over ``repeats``, on raw and on whitened
    features, total epsilon 3 and 8."""
    cells = {}
    for eps in (3.0, 8.0):
        variants = {"raw": splits}
        variants.update({f"white s{s:g}": whiten(splits, *TRANSFORM["map"](public, s))
                         for s in shrinkages})
        for label, data in variants.items():
            runs = [head(data, eps, classes) for _ in range(repeats)]
            cells[f"{prefix}{label} eps{eps:g}"] = float(np.mean(
                [np.mean(r["test_recall"]) for r in runs]))
    return cells


def dp_cells(splits, classes, public, repeats, shrinkages):
    """The class means (``class_means_head.dp_class_means``)."""
    return head_cells(splits, classes, public, repeats, shrinkages,
                      class_means_head.dp_class_means)


def trained_cells(splits, classes, public, repeats, shrinkages):
    """The README path's trained head (``imbalanced.dp_head_priors``)."""
    import imbalanced

    def trained(data, eps, classes):
        return imbalanced.dp_head_priors(data, eps, 1.0, True, classes=classes)

    return head_cells(splits, classes, public, repeats, shrinkages, trained, "trained ")


def _normalized_release_inputs(x, xt, classes, eps):
    """The normalization's release (the package's layer), its output scaled to norm at
    most 1 as ``DPClassMeans`` sees it, and the noise (in units of the sensitivity)
    that composes with it to ``eps``: ``(norm, u, u_test, sigma)``."""
    from keras_dp_lm.data import DPClassMeans
    from keras_dp_lm.data import DPFeatureNormalization
    from keras_dp_lm.data.feature_normalization import HEAD_FEATURE_NORM
    from keras_dp_lm.data.releases import COUNT_NOISE_SCALE

    norm = DPFeatureNormalization()
    norm.adapt(x)
    u, ut = (np.asarray(norm(a), "float64") for a in (x, xt))
    u, ut = (a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), HEAD_FEATURE_NORM)
             for a in (u, ut))
    sigma = DPClassMeans.for_budget(classes, eps, 1e-6, extra_events=[
        norm.dp_event()]).noise_multiplier / np.sqrt(1 + COUNT_NOISE_SCALE ** -2)
    return norm, u, ut, sigma


def _noised_means(u, onehot, noise, rng):
    """Released class sums and counts (count noise ``COUNT_NOISE_SCALE`` x): the means
    and the counts."""
    from keras_dp_lm.data.releases import COUNT_NOISE_SCALE

    sums = onehot.T @ u + rng.normal(0, noise, (onehot.shape[1], u.shape[1]))
    counts = np.maximum(onehot.sum(0) + rng.normal(0, COUNT_NOISE_SCALE * noise,
                                                    onehot.shape[1]), 1.0)
    return sums / counts[:, None], counts


def _discriminant(ut, mu, w, noise, counts):
    """``argmax_c u W mu_c - (mu_c W mu_c - tr(W) noise^2 / n_c^2) / 2``."""
    solved = w @ mu.T
    bias = 0.5 * ((mu.T * solved).sum(0) - np.trace(w) * noise ** 2 / counts ** 2)
    return np.argmax(ut @ solved - bias, 1)


def _noised_second_moment(z, noise, rng):
    upper = np.triu(z.T @ z + rng.normal(0, noise, (z.shape[1], z.shape[1])))
    return upper + np.triu(upper, 1).T


def dp_lda_cells(splits, classes, repeats, shrinkages, rng):
    """Simulated DP linear discriminant: one Gaussian release of the class sums,
    the counts and the second moment (upper triangle) of the normalised features,
    at the noise that makes it compose with the normalization to epsilon (its L2
    sensitivity: sqrt(2 + 1/k^2) in units of the noise, k the count noise scale),
    against the class means alone (sqrt(1 + 1/k^2)) at the same epsilon."""
    from keras_dp_lm.data.releases import COUNT_NOISE_SCALE

    (x, y), (xt, yt) = splits["train"][:2], splits["test"][:2]
    k2 = COUNT_NOISE_SCALE ** -2
    cells = {}
    for eps in (3.0, 8.0):
        for _ in range(repeats):
            _, u, ut, sigma = _normalized_release_inputs(x, xt, classes, eps)
            d = u.shape[1]
            onehot = np.eye(classes)[y]
            for label, joint in [("means", False)] + [(f"lda s{s:g}", s) for s in shrinkages]:
                noise = sigma * np.sqrt((2 if joint else 1) + k2)
                mu, counts = _noised_means(u, onehot, noise, rng)
                if joint:
                    n = counts.sum()
                    within = _noised_second_moment(u, noise, rng) / n \
                        - (mu.T * (counts / n)) @ mu \
                        + np.eye(d) * noise ** 2 * np.sum(1 / counts) / n
                    values, vectors = np.linalg.eigh(within)
                    values = np.maximum(values, 0) + joint * np.trace(within) / d
                    w = vectors @ np.diag(1 / values) @ vectors.T
                else:
                    w = np.eye(d)
                cells.setdefault(f"{label} eps{eps:g}", []).append(
                    _balanced(_discriminant(ut, mu, w, noise, counts), yt, classes))
    return {k: float(np.mean(v)) for k, v in cells.items()}


def dp_lowrank_lda_cells(splits, classes, public, repeats, ranks, rng):
    """As ``dp_lda_cells``, the covariance released only in the top ``rank``
    principal directions of the public features (normalised by the task's layer,
    post-processing): a ``rank x rank`` second moment instead of ``d x d``; the
    discriminant is that covariance's inverse in the subspace and a released
    isotropic spread (the trace left over, over ``d - rank``) outside it."""
    from keras_dp_lm.data.releases import COUNT_NOISE_SCALE

    (x, y), (xt, yt) = splits["train"][:2], splits["test"][:2]
    k2 = COUNT_NOISE_SCALE ** -2
    cells = {}
    for eps in (3.0, 8.0):
        for _ in range(repeats):
            norm, u, ut, sigma = _normalized_release_inputs(x, xt, classes, eps)
            pub = np.asarray(norm(public), "float64")
            pub /= np.maximum(np.linalg.norm(pub, axis=1, keepdims=True), 1e-12)
            _, vectors = np.linalg.eigh(np.cov((pub - pub.mean(0)).T))
            d = u.shape[1]
            onehot = np.eye(classes)[y]
            for label, rank in [("means", 0)] + [(f"lda rank {r}", r) for r in ranks]:
                noise = sigma * np.sqrt((2 if rank else 1) + k2)
                mu, counts = _noised_means(u, onehot, noise, rng)
                w = np.eye(d)
                if rank:
                    basis = vectors[:, -rank:]
                    n, m = counts.sum(), mu @ basis
                    within = _noised_second_moment(u @ basis, noise, rng) / n \
                        - (m.T * (counts / n)) @ m \
                        + np.eye(rank) * noise ** 2 * np.sum(1 / counts) / n
                    total = 1.0 - float(np.sum(counts / n * (
                        (mu * mu).sum(1) - d * noise ** 2 / counts ** 2)))
                    outside = max((total - np.trace(within)) / (d - rank), 1e-6)
                    values, inner = np.linalg.eigh(within)
                    values = np.maximum(values, outside)
                    w = (basis @ inner @ np.diag(1 / values) @ inner.T @ basis.T
                         + (np.eye(d) - basis @ basis.T) / outside)
                cells.setdefault(f"{label} eps{eps:g}", []).append(
                    _balanced(_discriminant(ut, mu, w, noise, counts), yt, classes))
    return {k: float(np.mean(v)) for k, v in cells.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--mode", default="ceiling", choices=(
        "ceiling", "dp", "dp-lda", "dp-lda-lowrank", "trained"))
    parser.add_argument("--tasks", nargs="*", default=list(class_means_head.SMALL_SUITE)
                        + list(class_means_head.LARGE_SUITE))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shrinkages", nargs="*", type=float, default=[0.1, 1.0],
                        help="the shrinkages (dp-lda-lowrank: the ranks)")
    parser.add_argument("--center", choices=("public", "task"), default="public")
    parser.add_argument("--power", type=float, default=0.5,
                        help="the whitening's power of the covariance (0.5: full; 0.25: "
                        "half-way to the raw features)")
    parser.add_argument("--transform", choices=("whiten", "abtt"), default="whiten",
                        help="abtt: the top principal directions projected out, the "
                        "shrinkage values read as their number")
    args = parser.parse_args(argv)
    CENTER["public"] = args.center == "public"
    TRANSFORM["map"] = all_but_the_top if args.transform == "abtt" else whitener
    TRANSFORM["power"] = args.power
    if args.transform == "abtt":
        SHRINKAGES[:] = [1, 2, 4, 8]
    totals = {}
    for name in args.tasks:
        splits, classes, row = head_rule.load(name, args.data_dir)
        public = public_features(args.data_dir, source_of(name))
        reference = probe(name, splits, classes)
        if args.mode == "ceiling":
            cells = ceiling_cells(splits, classes, public)
        elif args.mode == "dp":
            cells = dp_cells(splits, classes, public, args.repeats, args.shrinkages)
        elif args.mode == "trained":
            cells = trained_cells(splits, classes, public, args.repeats, args.shrinkages)
        elif args.mode == "dp-lda-lowrank":
            cells = dp_lowrank_lda_cells(splits, classes, public, args.repeats,
                                         [int(r) for r in args.shrinkages],
                                         np.random.default_rng(0))
        else:
            cells = dp_lda_cells(splits, classes, args.repeats, args.shrinkages,
                                 np.random.default_rng(0))
        for label, value in cells.items():
            totals.setdefault(label, []).append(100 * (value - reference))
        print(f"{name} N {row['train_size']} smallest {row['smallest_class']} probe "
              f"{100 * reference:.1f} " + " ".join(
                  f"{k}:{100 * (v - reference):+.1f}" for k, v in cells.items()), flush=True)
    for label, gaps in totals.items():
        print(f"{label}: mean {np.mean(gaps):+.2f}, within 3 points on "
              f"{sum(g >= -3 for g in gaps)} of {len(gaps)}, worst {min(gaps):+.1f}")


if __name__ == "__main__":
    main()
