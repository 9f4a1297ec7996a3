"""DP training of a KerasHub causal LM loaded from a saved preset directory.

The same code fine-tunes any ``GPT2CausalLM`` preset you have on disk; here a tiny
GPT-2 (byte-level BPE trained on the spot) is saved first with
``keras_dp_lm.testing.save_tiny_gpt2_preset``, so everything runs offline.

    python examples/causal_lm_from_preset_dp.py
    python examples/causal_lm_from_preset_dp.py --preset /path/to/preset --steps 500
    python examples/causal_lm_from_preset_dp.py --steps 3 --batch-size 8   # smoke run

Fine-tunes on Shakespeare lines with DPAdam under a PrivacyAccountant (the noise is
calibrated to ``--target-epsilon``), then saves the private model as a new preset and
prints held-out perplexity before/after, epsilon and a sample.
"""

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None,
                   help="a saved GPT2CausalLM preset directory (default: save a tiny one)")
    p.add_argument("--output-preset", default=None,
                   help="where to save the DP model (default: in --work-dir)")
    p.add_argument("--work-dir", default=None,
                   help="for the tiny preset and outputs (default: a new temporary folder)")
    p.add_argument("--play", default="hamlet")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sequence-length", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--l2-norm-clip", type=float, default=1.0)
    p.add_argument("--target-epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-6,
                   help="well below 1/N, as in the README and docs/guides/choosing-parameters.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)

    import keras_hub
    import tensorflow as tf

    import keras_dp_lm as kdp
    from keras_dp_lm import accounting, corpora, evaluation, testing
    from keras_dp_lm.samplers import DPSampler

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kdp_preset_"))
    work.mkdir(parents=True, exist_ok=True)
    preset = args.preset
    if preset is None:
        preset = work / "tiny_gpt2"
        testing.save_tiny_gpt2_preset(preset, sequence_length=args.sequence_length, seed=0)
        print(f"saved a tiny GPT-2 preset to {preset}")
    lm = keras_hub.models.GPT2CausalLM.from_preset(str(preset))
    lm.preprocessor.sequence_length = args.sequence_length

    records = corpora.text_records(corpora.load_shakespeare_plays(args.data_dir)[args.play],
                                   max_chars=120, min_chars=8)
    rng = np.random.default_rng(args.seed)
    rng.shuffle(records)
    heldout, train = records[:200], records[200:]
    if len(train) < 2 * args.batch_size:
        raise ValueError("not enough training records for this batch size")

    def ppl():
        ll, n = evaluation.sequence_log_likelihood(lm, heldout, return_token_counts=True)
        return math.exp(-ll.sum() / n.sum())

    before = ppl()
    q = args.batch_size / len(train)
    sigma = accounting.calibrate_noise_multiplier(args.target_epsilon, args.delta, q,
                                                  args.steps)
    lm.compile(optimizer=kdp.DPAdam(learning_rate=args.learning_rate,
                                    l2_norm_clip=args.l2_norm_clip,
                                    noise_multiplier=sigma),
               weighted_metrics=[])
    ds = (tf.data.Dataset.from_tensor_slices(train).shuffle(len(train), seed=args.seed)
          .repeat().batch(args.batch_size, drop_remainder=True))
    accountant = kdp.PrivacyAccountant(
        target_epsilon=args.target_epsilon, delta=args.delta, dataset_size=len(train),
        batch_size=args.batch_size, sampling="shuffle")
    start = time.time()
    lm.fit(ds, steps_per_epoch=args.steps, epochs=1, callbacks=[accountant],
           verbose=args.verbose)
    seconds = time.time() - start
    report = accountant.report()
    after = ppl()
    out = Path(args.output_preset) if args.output_preset else work / "tiny_gpt2_dp"
    lm.save_to_preset(str(out))
    lm.compile(sampler=DPSampler(lambda_=0.7))  # private decoding (see keras_dp_lm/samplers)
    sample = lm.generate("HAMLET.", max_length=24)
    print(f"held-out perplexity {before:.1f} -> {after:.1f} after {report['dp_updates']} "
          f"DP steps ({seconds:.0f} s); noise multiplier {sigma:.3f}")
    print(f"epsilon = {report['epsilon']:.3f} at delta = {report['delta']:g} "
          f"(target {args.target_epsilon})")
    print(f"DP model saved as a preset: {out}")
    print(f"sample: {sample!r}")
    return {"perplexity_before": before, "perplexity_after": after,
            "epsilon": report["epsilon"], "dp_updates": report["dp_updates"],
            "output_preset": str(out)}


if __name__ == "__main__":
    main()
