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
  (the model of ``bench_clipping.py``).

oneDNN is left as TensorFlow sets it (on unless ``TF_ENABLE_ONEDNN_OPTS=0``); the
section states which.

    .venv/bin/python benchmarks/bench_dp_step.py            # all rows, writes RESULTS.md
    .venv/bin/python benchmarks/bench_dp_step.py --quick    # 2 rows, 2 rounds, no file
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
CONFIGS = [  # (model, batch, jit_compile)
    ("demo", 64, False), ("demo", 512, False), ("demo", 1037, False), ("demo", 512, True),
    ("gpt2", 32, False), ("gpt2", 32, True),
]


def _model_and_batch(model, batch):
    """A seeded KerasHub causal LM and one batch ``(x, y, sample_weight)``."""
    import keras
    import keras_hub

    if model == "gpt2":  # bench_clipping.py's model and tokens
        from bench_clipping import _gpt2_and_tokens

        lm, ids, mask = _gpt2_and_tokens(batch)
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
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return lm, (x, ids[:, 1:], mask[:, 1:].astype("float32"))


def _train_step(model, batch, jit, private):
    """A zero-argument callable running one compiled train step."""
    import keras
    import tensorflow as tf

    import keras_dp_lm as kdp

    lm, data = _model_and_batch(model, batch)
    if private:
        optimizer = kdp.DPAdam(1e-4, l2_norm_clip=0.1, noise_multiplier=1.0,
                               clipping="fast", expected_batch_size=float(batch), seed=0)
    else:
        optimizer = keras.optimizers.Adam(1e-4)
    lm.compile(optimizer=optimizer, weighted_metrics=[], jit_compile=jit,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm(data[0])
    lm.make_train_function()
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    return lambda: lm.train_function(iter([tensors]))


def _worker(model, batch, jit, rounds, warmup):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    steps = {"nonprivate": _train_step(model, batch, jit, False),
             "dp": _train_step(model, batch, jit, True)}
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
    ratios = [d / n for d, n in zip(cpu["dp"], cpu["nonprivate"])]
    print("RESULT " + json.dumps(dict(
        model=model, batch=batch, jit=jit, rounds=rounds, warmup_s=first,
        cpu_s={k: statistics.median(v) for k, v in cpu.items()},
        wall_s={k: statistics.median(v) for k, v in wall.items()},
        ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))),
        flush=True)


def _run(model, batch, jit, rounds, warmup):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, "--batch",
           str(batch), "--rounds", str(rounds), "--warmup", str(warmup)] + (
               ["--jit"] if jit else [])
    result = run_worker(cmd, f"worker {model} B={batch} jit={jit}")
    print(f"  {model} B={batch} jit={jit}: DP / non-private CPU {result['ratio']:.2f}x",
          flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["demo", "gpt2"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="two rows, two rounds, do not write RESULTS.md")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.batch, args.jit, args.rounds, args.warmup)
        return

    configs = CONFIGS[:1] + CONFIGS[4:5] if args.quick else CONFIGS
    rounds = 2 if args.quick else args.rounds
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false")
    load_before = os.getloadavg()
    results = [_run(m, b, j, rounds, args.warmup) for m, b, j in configs]
    load_after = os.getloadavg()
    if args.quick:
        return
    targets = {"demo": 1.3, "gpt2": 1.10}
    rows = []
    for r in results:
        target = targets[r["model"]]
        rows.append(
            f"| {r['model']} | {r['batch']} | {'XLA' if r['jit'] else 'no'} | "
            f"{r['cpu_s']['nonprivate']:.3f} | {r['cpu_s']['dp']:.3f} | "
            f"**{r['ratio']:.2f}x** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['wall_s']['dp'] / r['wall_s']['nonprivate']:.2f}x | "
            f"<= {target:g}x {'met' if r['ratio'] <= target else 'NOT met'} |")
    from _results import machine_line
    from _results import write_section

    md = f"""## DP train step vs non-private, per model size and with XLA (issue 15)

- machine: {machine_line()}; 1-min load {load_before[0]:.1f} before, {load_after[0]:.1f} after
- oneDNN: {'on (TensorFlow default)' if onednn else 'off (TF_ENABLE_ONEDNN_OPTS=0)'}
- command: `python benchmarks/bench_dp_step.py`
- each row one process: the model built twice from one seed, `compile(Adam)` vs
  `compile(DPAdam(clip 0.1, noise 1.0, clipping="fast"))` with the same `jit_compile`,
  Keras's `train_function` (the step `fit` runs) alternating, {args.warmup} warm-up steps
  each, then {rounds} rounds; ratio = median over rounds of DP / non-private process CPU
  time (min-max over rounds in brackets); every slot a real example
- demo = the demo's `tiny` Llama (2 x 64, vocabulary 512, sequence 48); gpt2 = GPT-2
  4 x 256, vocabulary 8192, sequence 128

| model | batch | XLA | non-private CPU s/step | DP CPU s/step | DP / non-private CPU | wall ratio | target |
|---|---:|---|---:|---:|---:|---:|---|
{chr(10).join(rows)}
"""
    write_section("dp_step", md)
    print(md)


if __name__ == "__main__":
    main()
