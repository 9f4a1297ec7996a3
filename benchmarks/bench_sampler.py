"""Generation speed of DPSampler vs KerasHub's RandomSampler (issue 7).

Same GPT-2 weights (4 layers x 256, byte-level BPE |V|=8192, locally
trained tokenizer, random weights), batch of 8 prompts, ``max_length=128``,
``stop_token_ids=None`` so both samplers produce every position, XLA
(``jit_compile=True``). Each sampler gets its own model instance (identical
weights) so the compiled generate functions stay warm; runs alternate between
the two to spread machine-load drift evenly; the warm-up (compilation) calls
are excluded; the median of ``--runs`` timed calls is reported.

Writes the section ``sampler`` of benchmarks/RESULTS.md (unless ``--no-results``).

    python benchmarks/bench_sampler.py            # ~2-3 min on 2 CPU cores
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import keras_dp_lm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

PROMPTS = ["To be, or not to be", "Shall I compare thee", "Now is the winter",
           "Friends, Romans, countrymen", "O Romeo, Romeo", "All the world's a stage",
           "If music be the food", "Double, double toil"]


def build(args, sampler):
    from keras_dp_lm import testing

    lm = testing.tiny_gpt2_causal_lm(
        vocabulary_size=args.vocabulary_size, num_layers=args.num_layers,
        hidden_dim=args.hidden_dim, num_heads=args.num_heads,
        intermediate_dim=4 * args.hidden_dim, sequence_length=args.max_length,
        max_sequence_length=args.max_length, seed=0)
    lm.compile(sampler=sampler, jit_compile=True)
    return lm


def sampler_only_seconds(sampler, batch_size, vocabulary_size, steps, runs):
    """Median process CPU time of ``steps`` sampler steps alone (no model), one XLA loop."""
    import numpy as np
    import tensorflow as tf

    logits = tf.constant(np.random.default_rng(0).normal(
        size=(batch_size, vocabulary_size)).astype("float32"))

    @tf.function(jit_compile=True)
    def loop(logits):
        def body(i, acc):
            token = sampler.get_next_token(sampler.compute_probabilities(logits))
            return i + 1, acc + tf.reduce_sum(token)
        return tf.while_loop(lambda i, acc: i < steps, body, (tf.constant(0), tf.constant(0)))

    loop(logits)   # compile
    times = []
    for _ in range(runs):
        start = time.process_time()
        loop(logits)[1].numpy()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--vocabulary-size", type=int, default=8192)
    parser.add_argument("--lambda", dest="lambda_", type=float, default=0.9)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args(argv)

    import keras_hub

    from keras_dp_lm import samplers

    prompts = (PROMPTS * (args.batch_size // len(PROMPTS) + 1))[: args.batch_size]
    models = {
        "RandomSampler (KerasHub)": build(args, keras_hub.samplers.RandomSampler(seed=0)),
        f"DPSampler(lambda_={args.lambda_:g})": build(
            args, samplers.DPSampler(args.lambda_, seed=0)),
    }
    names = list(models)
    ref, dp = models[names[0]], models[names[1]]
    assert all((a == b).all() for a, b in zip(ref.get_weights(), dp.get_weights()))
    vocabulary_size = samplers.vocabulary_size_of(dp)

    def timed(lm):
        wall, cpu = time.perf_counter(), time.process_time()
        lm.generate(prompts, max_length=args.max_length, stop_token_ids=None)
        return time.perf_counter() - wall, time.process_time() - cpu

    compile_seconds = {name: timed(models[name])[0] for name in names}   # warm-up
    for name in names:                                                    # 2nd warm-up
        timed(models[name])
    times = {name: [] for name in names}
    cpu_times = {name: [] for name in names}
    for run in range(args.runs):
        order = names if run % 2 == 0 else names[::-1]
        for name in order:
            wall, cpu = timed(models[name])
            times[name].append(wall)
            cpu_times[name].append(cpu)

    med = {name: statistics.median(t) for name, t in times.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu_times.items()}
    alone = {}
    for name, sampler in ((names[0], keras_hub.samplers.RandomSampler(seed=1)),
                          (names[1], samplers.DPSampler(args.lambda_, seed=1))):
        alone[name] = sampler_only_seconds(sampler, args.batch_size, vocabulary_size,
                                           args.max_length, 3 * args.runs)
    ratio = med[names[1]] / med[names[0]]
    prompt_len = int(ref.preprocessor.generate_preprocess(
        prompts, sequence_length=args.max_length)["padding_mask"].numpy().sum(-1).min())
    new_tokens = args.max_length - prompt_len
    eps_tok = samplers.epsilon_per_token(args.lambda_, vocabulary_size)

    from _results import machine_line
    command = "python benchmarks/bench_sampler.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    lines = [
        "## DP decoding: DPSampler vs RandomSampler generate time (issue 7)",
        "",
        f"- machine: {machine_line()} (CPU shared with other jobs)",
        f"- command: `{command.strip()}`",
        f"- model: KerasHub GPT2CausalLM {args.num_layers} layers x {args.hidden_dim}, "
        f"|V|={vocabulary_size}, random weights; batch {args.batch_size}, "
        f"max_length {args.max_length} (stop_token_ids=None: up to {new_tokens} sampled "
        f"positions per prompt), jit_compile=True",
        f"- median of {args.runs} timed `generate()` calls per sampler, alternating, "
        f"after 2 warm-up calls (first call incl. XLA compile: "
        + ", ".join(f"{n} {compile_seconds[n]:.1f} s" for n in names) + ")",
        "",
        "| sampler | median wall s / generate | min | max | wall ratio "
        "| median CPU s / generate | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        t = times[name]
        lines.append(f"| {name} | {med[name]:.3f} | {min(t):.3f} | {max(t):.3f} | "
                     f"{med[name] / med[names[0]]:.3f}x | {cpu_med[name]:.3f} | "
                     f"{cpu_med[name] / cpu_med[names[0]]:.3f}x |")
    extra = alone[names[1]] - alone[names[0]]
    lines += [
        "",
        f"Sampler alone ({args.max_length} steps on fixed logits [{args.batch_size}, "
        f"{vocabulary_size}], one XLA loop, median process CPU time of {3 * args.runs}): "
        + ", ".join(f"{n} {1e3 * alone[n]:.1f} ms" for n in names)
        + f"; difference {1e3 * extra:+.1f} ms per generate call = "
        f"{100 * extra / cpu_med[names[0]]:+.2f}% of the median generate CPU time. "
        "CPU time (process_time) is less disturbed than wall time by the other jobs "
        "sharing this machine.",
    ]
    lines += [
        "",
        f"DPSampler / RandomSampler = **{ratio:.3f}x** wall, "
        f"**{cpu_med[names[1]] / cpu_med[names[0]]:.3f}x** CPU (target <= 1.05x). "
        f"Privacy of this setting: {eps_tok:.2f} epsilon per token, "
        f"{new_tokens * eps_tok:.0f} per {new_tokens}-token sequence.",
    ]
    utility = HERE / "results" / "dp_decoding_utility.md"
    if utility.exists():
        lines += ["", "Utility (from `benchmarks/dp_decoding_utility.py`, its last run):", ""]
        # Its tables with their headings and notes (not only the "|" lines, which
        # would merge its several tables into one), minus its own "## " title.
        lines += [("#" + l if l.startswith("### ") else l)
                  for l in utility.read_text().splitlines() if not l.startswith("## ")]
    md = "\n".join(lines)
    print(md)
    if not args.no_results:
        from _results import write_section
        write_section("sampler", md)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
