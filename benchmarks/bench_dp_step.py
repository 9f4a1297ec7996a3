"""The DP train step against the non-private one, per model size, with and without XLA.

For each configuration (model, batch, ``jit_compile``) one process builds the
same KerasHub causal LM twice from one seed, compiles one copy with
``keras.optimizers.Adam`` and the other with ``keras_dp_lm.DPAdam`` (fast
clipping, clip 0.1, noise 1.0, Poisson-style ``expected_batch_size``), and then
alternates one train step of each (Keras's own ``train_function``, the step
``fit`` runs) for ``--rounds`` rounds after ``--warmup`` warm-up steps. The
ratio is the median over rounds of (DP step / non-private step) in process CPU
time, so a change in the machine's load hits both sides of a ratio alike.
Every slot of a batch is a real example (the DP ratio at the same batch).

Models:

* ``demo``: the demo's ``tiny`` Llama (``demo/run.py`` ``MODEL_SIZES``), 2 layers x 64,
  vocabulary 512, sequence 48, at the demo's batch sizes (64; 512; 1037, the
  demo recipe's padded cap);
* ``gpt2``: KerasHub GPT-2 4 layers x 256, vocabulary 8192, sequence 128, batch 32
  (the model of ``bench_clipping.py``);
* ``gpt2-wide``: the same at GPT-2's own width (2 layers x 768, 12 heads, MLP
  3072), batch 16: the GPT-2 rows also show the FLOP floor of exact per-example
  clipping without kept per-example gradients
  (``bench_clipping.ghost_flop_floor``), which falls with the width;
* ``gpt2`` with LoRA (issue 16): the same model after ``backbone.enable_lora(8)``
  (query / value adapters and their layers' biases trainable, everything else
  frozen), DP LoRA against non-private LoRA; these rows also measure peak RSS,
  each side in its own process (``ru_maxrss`` after the warm-up and rounds);
* ``bf16`` rows: the same under Keras's ``mixed_bfloat16`` policy on both sides
  (this CPU has no fast bfloat16 path: the ratio, not the speed, is the point);
* ``bert``: a KerasHub ``BertTextClassifier`` (4 layers x 256, vocabulary 8192,
  sequence 128, 2 classes, random weights), batch 32, also under XLA and bf16;
* ``smollm2``: the real pretrained SmolLM2-135M (``make data`` fetches it; read with
  ``keras_dp_lm.models.load_gguf_causal_lm``), LoRA rank 8, sequence 64.

oneDNN is left as TensorFlow sets it (on unless ``TF_ENABLE_ONEDNN_OPTS=0``); the
section states which.

    .venv/bin/python benchmarks/bench_dp_step.py            # all rows, writes RESULTS.md
    .venv/bin/python benchmarks/bench_dp_step.py --quick    # 2 rows, 2 rounds, no file
    .venv/bin/python benchmarks/bench_dp_step.py --lora 8   # the LoRA rows only, no file
    .venv/bin/python benchmarks/bench_dp_step.py --users    # user-level rows, own section
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import random_token_batch  # noqa: E402
from _results import run_worker  # noqa: E402
ROOT = os.path.dirname(HERE)
CONFIGS = [  # (model, batch, jit_compile, LoRA rank or 0, dtype policy)
    ("demo", 64, False, 0, "float32"), ("demo", 512, False, 0, "float32"),
    ("demo", 1037, False, 0, "float32"), ("demo", 512, True, 0, "float32"),
    ("gpt2", 32, False, 0, "float32"), ("gpt2", 32, True, 0, "float32"),
    ("gpt2-wide", 16, False, 0, "float32"), ("gpt2-wide", 16, True, 0, "float32"),
    ("gpt2", 32, False, 8, "float32"), ("gpt2", 32, True, 8, "float32"),
    ("gpt2", 32, False, 0, "mixed_bfloat16"), ("gpt2", 32, False, 8, "mixed_bfloat16"),
    ("smollm2", 16, False, 8, "float32"),
    ("demo", 512, False, 0, "mixed_bfloat16"),
    ("bert", 32, False, 0, "float32"), ("bert", 32, True, 0, "float32"),
    ("bert", 32, False, 0, "mixed_bfloat16"),
]


def _model_and_batch(model, batch, lora=0):
    """A seeded KerasHub causal LM and one batch ``(x, y, sample_weight)``."""
    import keras
    import keras_hub
    import numpy as np

    if model in ("gpt2", "gpt2-wide"):  # bench_clipping.py's models and tokens
        from bench_clipping import WIDE_CONFIG
        from bench_clipping import _gpt2_and_tokens

        lm, ids, mask = _gpt2_and_tokens(batch, WIDE_CONFIG if model == "gpt2-wide" else None)
    elif model == "smollm2":
        from keras_dp_lm import models

        keras.utils.set_random_seed(0)
        lm = models.load_gguf_causal_lm(models.smollm2_path(), sequence_length=64)
        lm.preprocessor = None
        ids, mask = random_token_batch(batch, 64, lm.backbone.vocabulary_size)
    elif model == "bert":
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
            intermediate_dim=1024, max_sequence_length=128)
        classifier = keras_hub.models.BertTextClassifier(backbone, num_classes=2,
                                                         preprocessor=None)
        ids, mask = random_token_batch(batch, 128, 8192)
        x = {"token_ids": ids[:, :-1], "segment_ids": 0 * ids[:, :-1],
             "padding_mask": mask[:, :-1]}
        labels = ids[:, -1] % 2
        return classifier, (x, labels, np.ones(batch, "float32"))
    elif model == "demo":
        sys.path.insert(0, ROOT)
        from demo.run import MODEL_SIZES

        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=512, dropout=0.0,
                                                  **MODEL_SIZES["tiny"])
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        ids, mask = random_token_batch(batch, 48, 512)
    else:
        raise ValueError(f"unknown model {model!r}")
    if lora:
        lm.backbone.enable_lora(lora)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return lm, (x, ids[:, 1:], mask[:, 1:].astype("float32"))


def _train_step(model, batch, jit, private, lora=0, policy="float32", examples_per_user=0):
    """A zero-argument callable running one compiled train step. With
    ``examples_per_user`` the DP side trains at the user level (every slot real)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dp_lm as kdp

    keras.mixed_precision.set_global_policy(policy)
    lm, data = _model_and_batch(model, batch, lora)
    if private:
        units = batch // examples_per_user if examples_per_user else batch
        optimizer = kdp.DPAdam(1e-4, l2_norm_clip=0.1, noise_multiplier=1.0,
                               clipping="fast", expected_batch_size=float(units), seed=0)
        if examples_per_user:
            x, y, sample_weight = data
            data = (x, y, kdp.data.attach_real_slots(
                sample_weight, np.ones((units, examples_per_user), "float32"), 0.01))
    else:
        optimizer = keras.optimizers.Adam(1e-4)
    lm.compile(optimizer=optimizer, weighted_metrics=[], jit_compile=jit,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm(data[0])
    lm.make_train_function()
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    return lambda: lm.train_function(iter([tensors]))


def _worker(model, batch, jit, rounds, warmup, lora, only=None, policy="float32",
            examples_per_user=0):
    """Alternate the two steps (or run ``only`` one, for its peak RSS)."""
    import resource

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sides = [only] if only else ["nonprivate", "dp"]
    steps = {name: _train_step(model, batch, jit, name == "dp", lora, policy,
                               examples_per_user)
             for name in sides}
    built_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    first = {}
    for name, step in steps.items():
        start = time.perf_counter()
        for _ in range(warmup):
            step()
        first[name] = time.perf_counter() - start
    cpu = {name: [] for name in steps}
    wall = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    out = dict(model=model, batch=batch, jit=jit, lora=lora, policy=policy, rounds=rounds,
               examples_per_user=examples_per_user,
               warmup_s=first,
               cpu_s={k: statistics.median(v) for k, v in cpu.items()},
               wall_s={k: statistics.median(v) for k, v in wall.items()},
               peak_rss_mb=peak_mb, rss_after_build_mb=built_mb)
    if not only:
        ratios = [d / n for d, n in zip(cpu["dp"], cpu["nonprivate"])]
        out.update(ratio=statistics.median(ratios), ratio_min=min(ratios),
                   ratio_max=max(ratios))
    print("RESULT " + json.dumps(out), flush=True)


def _run(model, batch, jit, lora, policy, rounds, warmup, examples_per_user=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, "--batch",
           str(batch), "--rounds", str(rounds), "--warmup", str(warmup),
           "--lora", str(lora), "--policy", policy,
           "--examples-per-user", str(examples_per_user)] + (["--jit"] if jit else [])
    what = (f"worker {model} B={batch} jit={jit} lora={lora} {policy} "
            f"examples_per_user={examples_per_user}")
    result = run_worker(cmd, what)
    line = (f"  {model} B={batch} jit={jit} lora={lora} {policy}: DP / non-private CPU "
            f"{result['ratio']:.2f}x")
    if lora:   # peak memory, each side alone in its own process
        result["peak"] = {side: run_worker(cmd + ["--only", side], f"{what} {side}")
                          for side in ("nonprivate", "dp")}
        line += f", peak RSS {_peak_ratio(result):.2f}x"
    print(line, flush=True)
    return result


USER_CONFIGS = [("demo", 512, 4), ("gpt2", 32, 4)]  # (model, rows, examples per user)


def _user_level(rounds, warmup):
    """User-level DP step vs the non-private step on the same rows."""
    results = [_run(m, b, False, 0, "float32", rounds, warmup, examples_per_user=k)
               for m, b, k in USER_CONFIGS]
    rows = [f"| {r['model']} | {r['batch']} | {r['examples_per_user']} | "
            f"{r['batch'] // r['examples_per_user']} | "
            f"{r['cpu_s']['nonprivate']:.3f} | {r['cpu_s']['dp']:.3f} | "
            f"**{r['ratio']:.2f}x** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
            for r in results]
    from _results import machine_line
    from _results import write_section

    md = f"""## User-level DP train step vs non-private (issue 16, item 5)

- machine: {machine_line()}
- command: `python benchmarks/bench_dp_step.py --users`
- as the section above (same models, `train_function`, {warmup} warm-up steps, {rounds}
  alternating rounds, median DP / non-private process CPU time), but the DP side trains
  on user batches (`attach_real_slots` with a `[users, examples_per_user]` mask, every
  slot real): each user's mean gradient clipped as one unit (fast clipping regroups
  the rows by user), `expected_batch_size` = users; the non-private side trains on the
  same rows as examples. No target is set for these rows.

| model | rows | examples per user | users | non-private CPU s/step | DP CPU s/step | DP / non-private CPU |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}
"""
    write_section("dp_step_users", md)
    print(md)


def _verdict(ratio, target):
    if target is None:
        return "none set"
    return f"<= {target:g}x {'met' if ratio <= target else 'NOT met'}"


def _peak_ratio(result):
    return result["peak"]["dp"]["peak_rss_mb"] / result["peak"]["nonprivate"]["peak_rss_mb"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["demo", "gpt2", "gpt2-wide", "bert", "smollm2"])
    parser.add_argument("--policy", default="float32", choices=["float32", "mixed_bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: no LoRA)")
    parser.add_argument("--only", choices=["nonprivate", "dp"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--examples-per-user", type=int, default=0,
                        help="worker: the DP side trains at the user level")
    parser.add_argument("--users", action="store_true",
                        help="the user-level rows only (their own RESULTS.md section)")
    parser.add_argument("--quick", action="store_true",
                        help="two rows, two rounds, do not write RESULTS.md")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.batch, args.jit, args.rounds, args.warmup, args.lora,
                args.only, args.policy, args.examples_per_user)
        return
    if args.users:
        _user_level(args.rounds, args.warmup)
        return

    configs = CONFIGS[:1] + CONFIGS[4:5] if args.quick else CONFIGS
    if args.lora:   # only the LoRA rows, at this rank (no file written)
        configs = [(m, b, j, args.lora, p) for m, b, j, lora, p in CONFIGS if lora]
    rounds = 2 if args.quick else args.rounds
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false")
    load_before = os.getloadavg()
    results = [_run(m, b, j, lora, p, rounds, args.warmup) for m, b, j, lora, p in configs]
    load_after = os.getloadavg()
    if args.quick or args.lora:
        return
    targets = {"demo": 1.3, "gpt2": 1.10, "gpt2-wide": 1.10,
               "lora": 1.15}   # bert: no target set
    names = {"demo": "demo", "gpt2": "gpt2", "gpt2-wide": "gpt2 2 x 768",
             "bert": "BERT classifier", "smollm2": "SmolLM2-135M"}
    from bench_clipping import CONFIG
    from bench_clipping import WIDE_CONFIG
    from bench_clipping import ghost_flop_floor
    floors = {"gpt2": ghost_flop_floor(CONFIG), "gpt2-wide": ghost_flop_floor(WIDE_CONFIG)}
    rows = []
    for r in results:
        target = targets.get("lora" if r["lora"] else r["model"])
        model = names[r["model"]] + (f" LoRA r={r['lora']}" if r["lora"] else "")
        if r["policy"] != "float32":
            model += " bf16"
        memory = (f"{_peak_ratio(r):.2f}x ({r['peak']['nonprivate']['peak_rss_mb']:.0f} / "
                  f"{r['peak']['dp']['peak_rss_mb']:.0f} MB), <= 1.1x "
                  f"{'met' if _peak_ratio(r) <= 1.10 else 'NOT met'}" if r["lora"] else "")
        floor = (f"{floors[r['model']]:.2f}x" if r["model"] in floors and not r["lora"]
                 and r["policy"] == "float32" else "")
        rows.append(
            f"| {model} | {r['batch']} | {'XLA' if r['jit'] else 'no'} | "
            f"{r['cpu_s']['nonprivate']:.3f} | {r['cpu_s']['dp']:.3f} | "
            f"**{r['ratio']:.2f}x** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['wall_s']['dp'] / r['wall_s']['nonprivate']:.2f}x | "
            f"{_verdict(r['ratio'], target)} | {floor} | {memory} |")
    from _results import machine_line
    from _results import write_section

    md = f"""## DP train step vs non-private, per model size, with XLA and with LoRA (issues 15, 16)

- machine: {machine_line()}; 1-min load {load_before[0]:.1f} before, {load_after[0]:.1f} after
- oneDNN: {'on (TensorFlow default)' if onednn else 'off (TF_ENABLE_ONEDNN_OPTS=0)'}
- command: `python benchmarks/bench_dp_step.py`
- each row one process: the model built twice from one seed, `compile(Adam)` vs
  `compile(DPAdam(clip 0.1, noise 1.0, clipping="fast"))` with the same `jit_compile`,
  Keras's `train_function` (the step `fit` runs) alternating, {args.warmup} warm-up steps
  each, then {rounds} rounds; ratio = median over rounds of DP / non-private process CPU
  time (min-max over rounds in brackets); every slot a real example
- demo = the demo's `tiny` Llama (2 x 64, vocabulary 512, sequence 48); gpt2 = GPT-2
  4 x 256, vocabulary 8192, sequence 128; BERT classifier = KerasHub BertTextClassifier
  4 x 256, vocabulary 8192, sequence 128, 2 classes; SmolLM2-135M = the real pretrained model
  (30 x 576, vocabulary 49,152, read from its GGUF file), sequence 64; LoRA rows:
  `backbone.enable_lora(8)`, DP LoRA vs non-private LoRA (targets: time <= 1.15x, peak
  RSS <= 1.10x, each side's peak RSS measured alone in its own process); bf16 rows:
  `mixed_bfloat16` on both sides (no fast bfloat16 kernels on this CPU: compare the
  ratios, not the seconds); gpt2 2 x 768 = the same GPT-2 at its own width (768,
  12 heads, MLP 3072), 2 layers
- FLOP floor: the least DP / non-private ratio of multiply-adds of exact per-example
  clipping that keeps no per-example gradient in memory, as the package does by default
  (`bench_clipping.ghost_flop_floor`: each layer's cheaper exact norm, ghost Grams or a
  per-example gradient formed and dropped, over a non-private step of 3 forward passes).
  At 4 x 256 and sequence 128 it is above the 1.10x time target, so that target needs
  per-example gradients kept in memory (measured before: 1.11-1.14x time at 1.15-1.17x
  peak memory, over the 1.10x memory target); at GPT-2's width (768) it is below

| model | batch | XLA | non-private CPU s/step | DP CPU s/step | DP / non-private CPU | wall ratio | target | FLOP floor | LoRA peak RSS DP / non-private |
|---|---:|---|---:|---:|---:|---:|---|---:|---|
{chr(10).join(rows)}
"""
    write_section("dp_step", md)
    print(md)


if __name__ == "__main__":
    main()
