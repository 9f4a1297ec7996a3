"""Step time and peak memory: non-private vs exact DP vs fast (ghost) DP clipping.

Model: KerasHub GPT-2-style causal LM, 4 layers, width 256, 4 heads, vocabulary
8192, sequence length 128, float32, CPU, random tokens with a padding mask.
Every mode trains through the public path (``model.compile`` +
``train_on_batch``): non-private with ``keras.optimizers.Adam``, DP with
``keras_dp_lm.DPAdam(clipping="exact" | "fast")``.  Each (mode, batch size)
runs in its own process, so peak RSS (``resource.getrusage`` high-water mark)
is that mode's alone.

    .venv/bin/python benchmarks/bench_clipping.py            # full run, writes RESULTS.md
    .venv/bin/python benchmarks/bench_clipping.py --quick    # fewer steps, no file written

The largest batch under a memory cap is *estimated*: peak RSS is measured at a
few batch sizes per mode, a straight line is fitted, and solved for the cap.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import random_token_batch  # noqa: E402
from _results import run_worker  # noqa: E402
CONFIG = dict(num_layers=4, hidden_dim=256, num_heads=4, intermediate_dim=1024,
              vocabulary_size=8192, sequence_length=128)
# GPT-2's own width (768, 12 heads, MLP 3072) at two layers: where exact
# per-example norms cost a smaller share of the step (see ghost_flop_floor).
WIDE_CONFIG = dict(CONFIG, num_layers=2, hidden_dim=768, num_heads=12,
                   intermediate_dim=3072)


def ghost_flop_floor(config):
    """The least DP / non-private ratio of multiply-adds of exact per-example
    clipping of this GPT-2 that keeps no per-example gradient in memory (the
    package default: peak memory ~1.0x). Per example, the non-private step
    costs about 3 forward passes (the backward pass computes input and weight
    gradients); the DP step adds each layer's cheaper exact norm,
    ``min(T^2 (m + n), T m n)`` (ghost Grams, or the per-example gradient
    formed for its norm and dropped), the query / key / value layers sharing
    their input's Gram, plus the tied vocabulary projection's ghost norm
    ``T^2 (d + V)``; the clipped sum by book-keeping costs what the
    non-private weight gradient costs. Keeping per-example gradients instead
    (they then replace the weight gradient) costs ~``m n`` per layer, but
    ``B m n`` floats of memory per layer.

    >>> round(ghost_flop_floor(CONFIG), 3), round(ghost_flop_floor(WIDE_CONFIG), 3)
    (1.192, 1.069)
    """
    T, d, V = config["sequence_length"], config["hidden_dim"], config["vocabulary_size"]
    f, L = config["intermediate_dim"], config["num_layers"]
    dense = [(d, d)] * 4 + [(d, f), (f, d)]   # query, key, value, output, MLP in / out
    forward = L * (sum(T * m * n for m, n in dense) + 2 * T * T * d) + T * d * V
    norms = sum(min(T * T * (m + n), T * m * n) for m, n in dense) - 2 * T * T * d
    extra = L * norms + T * T * (d + V)
    return 1.0 + extra / (3.0 * forward)


# ---------------------------------------------------------------------------
# Worker: one mode, one batch size, one process.


def _gpt2_and_tokens(batch, config=None):
    """The benchmark model (seeded; ``CONFIG`` unless ``config`` is given) and a
    batch of random ``[B, T + 1]`` token ids with a random-length padding mask."""
    import keras
    import keras_hub

    config = config or CONFIG
    keras.utils.set_random_seed(0)
    T = config["sequence_length"]
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config["vocabulary_size"], num_layers=config["num_layers"],
        num_heads=config["num_heads"], hidden_dim=config["hidden_dim"],
        intermediate_dim=config["intermediate_dim"], max_sequence_length=T)
    lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    ids, mask = random_token_batch(batch, T, config["vocabulary_size"])
    return lm, ids, mask


def _worker(mode, batch, steps, warmup):
    import resource

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import keras
    import tensorflow as tf

    import keras_dp_lm as kdp
    from keras_dp_lm import clipping as fast_clipping

    lm, ids, mask = _gpt2_and_tokens(batch)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, sw = ids[:, 1:], mask[:, 1:].astype("float32")

    path = mode
    if mode == "nonprivate":
        optimizer = keras.optimizers.Adam(1e-4)
    elif mode in ("exact", "fast"):
        optimizer = kdp.DPAdam(1e-4, l2_norm_clip=1.0, noise_multiplier=1.0,
                               clipping=mode)
    if mode == "fast-step":
        optimizer = kdp.DPAdam(1e-4, l2_norm_clip=1.0, noise_multiplier=1.0, clipping="fast")
        path = ("minimal DP step: per_example_losses + fast_clipped_sum + "
                "DPAdam._apply_clipped_sum in one tf.function (no metrics)")
    lm.compile(optimizer=optimizer,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm(x)  # build
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    train = lambda: lm.train_on_batch(x, y, sample_weight=sw)  # noqa: E731
    if mode == "fast-step":
        from keras_dp_lm.training.losses import per_example_losses
        optimizer.build(lm.trainable_variables)
        data = tf.nest.map_structure(tf.convert_to_tensor, (x, y, sw))

        @tf.function
        def minimal_step(data):
            def loss_fn(part):
                px, py, psw = part
                return per_example_losses(lm, px, py, lm(px, training=True), psw)
            result = fast_clipping.fast_clipped_sum(lm, loss_fn, data, 1.0, method="fast")
            optimizer._apply_clipped_sum(optimizer.freeze_privacy_parameters(), result.grads,
                                         lm.trainable_variables, batch, 0)
            return tf.reduce_mean(result.losses)

        train = lambda: minimal_step(data).numpy()  # noqa: E731

    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        loss = train()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    coverage = None
    if mode.startswith("fast"):
        cov = fast_clipping.clipping_coverage(lm)
        coverage = {k: sum(1 for v in cov.values() if v == k) for k in set(cov.values())}
    print("RESULT " + json.dumps(dict(
        mode=mode, path=path, batch=batch, steps=steps, warmup=warmup,
        median_s=statistics.median(times), min_s=min(times), times=times,
        peak_rss_mb=peak, rss_after_build_mb=rss_built, loss=float(np.ravel(np.asarray(loss))[0]),
        coverage=coverage)), flush=True)


def _worker_ab(batch, rounds):
    """One process, alternating: non-private gradient vs fast clipped sum.

    Both are tf.functions over the same model, data and per-example loss, with
    no optimizer, so their ratio isolates the cost of the clipping itself from
    the machine's changing load and from the rest of the DP step."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from keras_dp_lm import clipping as fast_clipping

    lm, ids, mask = _gpt2_and_tokens(batch)
    ids, mask = tf.constant(ids), tf.constant(mask)

    def loss_fn(data):
        ids, mask = data
        logits = lm({"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, training=True)
        weights = tf.cast(mask[:, 1:], tf.float32)
        ce = keras.losses.sparse_categorical_crossentropy(ids[:, 1:], logits, from_logits=True)
        return tf.reduce_sum(ce * weights, 1) / tf.reduce_sum(weights, 1)

    def timed(suffix):
        @tf.function
        def nonprivate(data):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(data))
            return tape.gradient(loss, lm.trainable_variables)

        @tf.function
        def fast(data):
            return fast_clipping.fast_clipped_sum(lm, loss_fn, data, 1.0, method="fast").grads

        fns = {"nonprivate" + suffix: nonprivate, "fast" + suffix: fast}
        times = {name: [] for name in fns}
        for r in range(rounds + 1):
            for name, fn in fns.items():
                start = time.perf_counter()
                [g.numpy() for g in fn((ids, mask))]
                if r:
                    times[name].append(time.perf_counter() - start)
        return {name: statistics.median(t) for name, t in times.items()}

    result = timed("")
    # The same with the tied token embedding (input lookup + output projection)
    # frozen: what the exact norm of the vocabulary projection costs.
    lm.backbone.token_embedding.trainable = False
    result.update(timed("_frozen_embedding"))
    print("RESULT " + json.dumps(result), flush=True)


def _run_ab(batch, rounds):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ab",
           "--batch", str(batch), "--steps", str(rounds)]
    result = run_worker(cmd, "A/B worker")
    print(f"  gradient A/B B={batch}: {result}", flush=True)
    return result


def _run(mode, batch, steps, warmup):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode,
           "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    result = run_worker(cmd, f"worker {mode} B={batch}")
    print(f"  {mode:10s} B={batch:3d}: median {result['median_s']:.3f} s/step, "
          f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    return result


def _fit_line(points):
    """Least-squares (intercept, slope) of peak MB against batch size."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(m for _, m in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (m - my) for b, m in points) / sxx
    return my - slope * mx, slope


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["nonprivate", "exact", "fast", "fast-step", "ab"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--exact-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating processes per mode (non-private, fast)")
    parser.add_argument("--memory-batches", default="8,16,32",
                        help="batch sizes whose peak RSS is fitted (non-private and fast)")
    parser.add_argument("--memory-cap-mb", type=float, default=4096.0)
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps, no memory sweep, do not write RESULTS.md")
    args = parser.parse_args()
    if args.worker == "ab":
        _worker_ab(args.batch, args.steps)
        return
    if args.worker:
        _worker(args.worker, args.batch, args.steps, args.warmup)
        return

    steps, exact_steps = (3, 1) if args.quick else (args.steps, args.exact_steps)
    rounds = 1 if args.quick else args.rounds
    B = args.batch
    load_before = os.getloadavg()
    print(f"bench_clipping: GPT-2 {CONFIG}, batch {B}, load {load_before}", flush=True)
    # Non-private and fast alternate (each run a fresh process) so that a change
    # in the machine's load hits both alike; step times are pooled over rounds.
    runs = {"nonprivate": [], "fast": [], "fast-step": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(_run(mode, B, steps, args.warmup))
    results = {}
    for mode, rs in runs.items():
        pooled = [t for r in rs for t in r["times"]]
        results[mode] = dict(rs[0], times=pooled, steps=len(pooled),
                             median_s=statistics.median(pooled),
                             peak_rss_mb=max(r["peak_rss_mb"] for r in rs),
                             rss_after_build_mb=max(r["rss_after_build_mb"] for r in rs))
    results["exact"] = _run("exact", B, exact_steps, 1)
    ab = _run_ab(B, steps)
    load_after = os.getloadavg()
    if args.quick:
        return

    sweep = {"nonprivate": [], "fast": []}
    for mode in sweep:
        for b in [int(s) for s in args.memory_batches.split(",")]:
            r = results[mode] if b == B else _run(mode, b, 2, 1)
            sweep[mode].append((b, r["peak_rss_mb"]))
    fits = {m: _fit_line(p) for m, p in sweep.items()}
    max_batch = {m: int((args.memory_cap_mb - a) / s) if s > 0 else None
                 for m, (a, s) in fits.items()}

    base = results["nonprivate"]
    t0, m0 = base["median_s"], base["peak_rss_mb"]
    built0 = base["rss_after_build_mb"]
    rows = []
    for mode, label in (("nonprivate", "non-private (Adam)"),
                        ("fast", "DP, fast clipping, package DP step (`train_on_batch`)"),
                        ("fast-step", "DP, fast clipping, minimal DP step (no metrics pass)"),
                        ("exact", "DP, exact clipping (per-example loop)")):
        r = results[mode]
        rows.append(
            f"| {label} | {r['median_s']:.3f} | {r['median_s'] / t0:.2f}x | "
            f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / m0:.2f}x | "
            f"{r['peak_rss_mb'] - r['rss_after_build_mb']:.0f} | "
            f"{(r['peak_rss_mb'] - r['rss_after_build_mb']) / max(m0 - built0, 1):.2f}x | "
            f"{r['steps']} |")
    sweep_rows = [f"| {m} | " + ", ".join(f"B={b}: {mb:.0f} MB" for b, mb in pts)
                  + f" | {fits[m][0]:.0f} + {fits[m][1]:.1f}*B | {max_batch[m]} |"
                  for m, pts in sweep.items()]
    verdicts = []
    for mode, label in (("fast", "package DP step"), ("fast-step", "minimal DP step")):
        ft, fm = results[mode]["median_s"] / t0, results[mode]["peak_rss_mb"] / m0
        verdicts.append(
            f"- {label}: <= 1.10x step time {'met' if ft <= 1.10 else 'NOT met'} ({ft:.2f}x); "
            f"<= 1.10x peak memory {'met' if fm <= 1.10 else 'NOT met'} ({fm:.2f}x of "
            "whole-process RSS)")
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false")
    verdict = (f"Targets for fast DP (issue 15), oneDNN "
               f"{'on (TensorFlow default)' if onednn else 'off'}:\n") + "\n".join(verdicts)
    md = f"""## Per-example clipping: non-private vs exact vs fast DP

Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (1/5/15-min load
average {'/'.join(f'{v:.1f}' for v in load_before)} before, {'/'.join(f'{v:.1f}' for v in load_after)} after: absolute times are noisy, ratios less so),
Python {platform.python_version()}, {platform.platform()}. Date: {datetime.datetime.now().isoformat(timespec='minutes')}.
Command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`

Model: KerasHub `GPT2Backbone` + `GPT2CausalLM(preprocessor=None)`, {CONFIG['num_layers']} layers,
width {CONFIG['hidden_dim']}, {CONFIG['num_heads']} heads, MLP {CONFIG['intermediate_dim']},
vocabulary {CONFIG['vocabulary_size']} (tied input/output embedding), sequence {CONFIG['sequence_length']},
batch {B}, float32, CPU, dropout 0.1, random tokens with random padding. Each mode in its own
process, via `compile` + `train_on_batch`; DP modes use `keras_dp_lm.DPAdam(l2_norm_clip=1,
noise_multiplier=1, clipping=...)`. Non-private and both fast modes: {rounds} alternating processes each,
median of all their {steps * rounds} steps (after {args.warmup} warm-up steps per process);
exact: {exact_steps} steps after 1 warm-up. Peak = `ru_maxrss` of the process (includes the TensorFlow
runtime and the model); "training" = peak minus RSS after building the model.
Fast path used: {results['fast']['path']}; coverage {results['fast']['coverage']}.

| mode | s/step | time vs non-private | peak RSS MB | memory vs non-private | training MB | training memory vs non-private | steps |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{verdict}

Clipping cost alone (one process, {steps} alternating rounds, median): the gradient of the summed
per-example losses takes {ab['nonprivate']:.3f} s, `fast_clipped_sum(method="fast")` (per-example norms +
clipped sum) {ab['fast']:.3f} s: **{ab['fast'] / ab['nonprivate']:.2f}x**; with the tied token
embedding frozen {ab['nonprivate_frozen_embedding']:.3f} s and {ab['fast_frozen_embedding']:.3f} s:
**{ab['fast_frozen_embedding'] / ab['nonprivate_frozen_embedding']:.2f}x**, so the exact per-example norm of the
tied vocabulary projection (a [T, T] Gram matrix of logit gradients over all {CONFIG['vocabulary_size']}
tokens per example) is {100 * (1 - (ab['fast_frozen_embedding'] - ab['nonprivate_frozen_embedding']) / (ab['fast'] - ab['nonprivate'])):.0f}% of the clipping overhead. Beyond that, a DP step draws
noise for every parameter (`DPAdam._apply_clipped_sum`, ~0.05 s here), and the package DP step
(`keras_dp_lm.training.dp_train_step`) computes the compiled metrics (KerasHub tasks always
compile them, `weighted_metrics="auto"`) from the fast path's batched outputs, which keeps the
logits alive until the metrics are done: that is the gap between the two fast rows.

Largest batch under a {args.memory_cap_mb:.0f} MB RSS cap, **estimated** by fitting a line to
peak RSS measured at a few batch sizes (2 steps each) and solving for the cap (not run at that size):

| mode | measured peak RSS | fit | estimated max batch |
|---|---|---|---|
{chr(10).join(sweep_rows)}
"""
    sys.path.insert(0, HERE)
    from _results import write_section
    write_section("clipping", md)
    print(md)


if __name__ == "__main__":
    main()
