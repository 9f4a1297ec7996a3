"""Has the DP step got slower? This tree's fit step vs another revision's, as ratios to non-private.

Each worker process imports keras_dp_lm from one tree, builds the benchmark
GPT-2 (4 x 256, T=128, |V|=8192, the model of ``bench_clipping.py``) twice,
non-private (``keras.optimizers.Adam``) and DP (``kdp.DPAdam``, default
``clipping="auto"``), and alternates their ``train_on_batch`` steps, so the
ratio DP / non-private in one process is insensitive to the machine's changing
load. Processes alternate between the two trees; the regression is the ratio
of the two trees' DP / non-private ratios.

    .venv/bin/python benchmarks/bench_regression.py --base f75edad   # writes RESULTS.md

With ``--first-step`` it times instead each model's first ``train_on_batch``
(tracing the step, plus the DP step's independence probe, plus one step), every
model in a fresh process, and writes its own section of RESULTS.md.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _first_step_worker(tree, batch, dtype_policy, which):
    """Time one model's first ``train_on_batch`` in a fresh process: tracing the
    step (and, for DP, the independence probe's pass) plus one step."""
    sys.path.insert(0, tree)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    keras.config.set_dtype_policy(dtype_policy)

    import keras_dp_lm as kdp
    from bench_clipping import _gpt2_and_tokens

    if not os.path.abspath(kdp.__file__).startswith(os.path.abspath(tree)):
        raise RuntimeError(f"imported {kdp.__file__}, not the tree {tree}")
    lm, ids, mask = _gpt2_and_tokens(batch)
    optimizer = (keras.optimizers.Adam(1e-4) if which == "nonprivate" else
                 kdp.DPAdam(1e-4, l2_norm_clip=1.0, noise_multiplier=1.0))
    lm.compile(optimizer=optimizer,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, sw = ids[:, 1:], mask[:, 1:].astype("float32")
    w0, c0 = time.perf_counter(), time.process_time()
    lm.train_on_batch(x, y, sample_weight=sw)
    print("RESULT " + json.dumps({"wall": time.perf_counter() - w0,
                                  "cpu": time.process_time() - c0}), flush=True)


def _worker(tree, batch, steps, dtype_policy):
    sys.path.insert(0, tree)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    keras.config.set_dtype_policy(dtype_policy)

    import keras_dp_lm as kdp
    from bench_clipping import _gpt2_and_tokens

    if not os.path.abspath(kdp.__file__).startswith(os.path.abspath(tree)):
        raise RuntimeError(f"imported {kdp.__file__}, not the tree {tree}")
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models = {}
    for name in ("nonprivate", "dp"):
        lm, ids, mask = _gpt2_and_tokens(batch)
        optimizer = (keras.optimizers.Adam(1e-4) if name == "nonprivate" else
                     kdp.DPAdam(1e-4, l2_norm_clip=1.0, noise_multiplier=1.0))
        lm.compile(optimizer=optimizer, loss=sce)
        models[name] = lm
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, sw = ids[:, 1:], mask[:, 1:].astype("float32")
    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    for step in range(2 + steps):
        for name, lm in models.items():
            w0, c0 = time.perf_counter(), time.process_time()
            lm.train_on_batch(x, y, sample_weight=sw)
            if step >= 2:
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
    print("RESULT " + json.dumps({
        "wall": {k: statistics.median(v) for k, v in wall.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()}}), flush=True)


def _run(tree, batch, steps, dtype_policy, first_step=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tree,
           "--batch", str(batch), "--steps", str(steps), "--dtype-policy", dtype_policy]
    if first_step:
        cmd += ["--first-step", first_step]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={**os.environ, "PYTHONPATH": HERE})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"worker for {tree} failed (exit {proc.returncode})")


def _write(section, name="regression"):
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{section}\n{end}"
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    open(path, "w").write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--base", default="f75edad", help="revision to compare with")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype-policy", default="float32",
                        help="Keras dtype policy of both models, e.g. mixed_bfloat16")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--first-step", nargs="?", const="both",
                        choices=("both", "dp", "nonprivate"),
                        help="time the first train_on_batch (trace + one step), each "
                             "model in a fresh process, instead of steady steps")
    args = parser.parse_args()
    if args.worker:
        if args.first_step:
            _first_step_worker(args.worker, args.batch, args.dtype_policy, args.first_step)
        else:
            _worker(args.worker, args.batch, args.steps, args.dtype_policy)
        return
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "keras_dp_lm"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "--detach", "-f", base_tree, args.base],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            results = {"base": [], "head": []}
            for r in range(args.rounds):
                for name, tree in (("base", base_tree), ("head", ROOT)):
                    if args.first_step:
                        result = {clock: {} for clock in ("wall", "cpu")}
                        for which in ("nonprivate", "dp"):
                            one = _run(tree, args.batch, args.steps, args.dtype_policy,
                                       first_step=which)
                            for clock in result:
                                result[clock][which] = one[clock]
                    else:
                        result = _run(tree, args.batch, args.steps, args.dtype_policy)
                    results[name].append(result)
                    print(f"round {r + 1} {name}: {result}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=ROOT,
                           capture_output=True)
    if args.first_step:
        _first_step_report(args, head, dirty, results)
        return

    def ratio(name, clock):
        return statistics.median(r[clock]["dp"] / r[clock]["nonprivate"] for r in results[name])

    rows = [f"| {rev} | {clock} | {nonprivate:.3f} | {dp:.3f} | {ratio(name, clock):.3f}x |"
            for rev, name, clock, nonprivate, dp in _medians(args, head, dirty, results,
                                                             ("cpu", "wall"))]
    change = {c: ratio("head", c) / ratio("base", c) for c in ("cpu", "wall")}
    section = "\n".join([
        "## Regression check: the DP step now vs before this round",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {datetime.date.today()} (CPU shared with other jobs)",
        f"- command: `python benchmarks/bench_regression.py --base {args.base}"
        + (f" --dtype-policy {args.dtype_policy}" if args.dtype_policy != "float32" else "")
        + "`",
        f"- model: KerasHub GPT-2 4 x 256, T=128, |V|=8192, batch {args.batch}, "
        f"{args.dtype_policy}; "
        "`train_on_batch` through fit's step, `DPAdam` default `clipping=\"auto\"` (all "
        "variables on fast rules) vs `keras.optimizers.Adam`, alternating step by step in "
        f"one process; median of {args.steps} steps after 2 warm-up, {args.rounds} "
        "processes per tree, trees alternating; oneDNN on (TensorFlow's default).",
        "",
        "| revision | clock | non-private s/step | DP s/step | DP / non-private |",
        "|---|---|---:|---:|---:|",
        *rows,
        "",
        f"DP / non-private ratio, now vs {args.base}: **{change['cpu']:.3f}x** (process CPU "
        f"time), **{change['wall']:.3f}x** (wall; noisier on a shared machine). Target: "
        "<= 1.03x.",
    ])
    print(section)
    if not args.no_write:
        _write(section)


def _medians(args, head, dirty, results, clocks):
    """``(revision, tree, clock, non-private median, DP median)`` per clock and tree."""
    revisions = (("base", args.base), ("head", head + (" + uncommitted" if dirty else "")))
    return [(rev, name, clock,
             statistics.median(r[clock]["nonprivate"] for r in results[name]),
             statistics.median(r[clock]["dp"] for r in results[name]))
            for clock in clocks for name, rev in revisions]


def _first_step_report(args, head, dirty, results):
    rows = [f"| {rev} | {clock} | {nonprivate:.1f} | {dp:.1f} | {dp / nonprivate:.2f}x |"
            for rev, _, clock, nonprivate, dp in _medians(args, head, dirty, results,
                                                          ("wall", "cpu"))]
    section = "\n".join([
        "## First step: tracing the DP step vs non-private",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {datetime.date.today()} (CPU shared with other jobs)",
        f"- command: `python benchmarks/bench_regression.py --first-step --base {args.base}`",
        f"- model: KerasHub GPT-2 4 x 256, T=128, |V|=8192, batch {args.batch}, "
        f"{args.dtype_policy}; the first `train_on_batch` of a compiled model (the step's "
        "trace and graph optimisation, for DP also the independence probe's own pass, "
        "then one step), each model in a fresh process; median of "
        f"{args.rounds} processes per tree and model, trees alternating.",
        "",
        "| revision | clock | non-private first step (s) | DP first step (s) | DP / non-private |",
        "|---|---|---:|---:|---:|",
        *rows,
    ])
    print(section)
    if not args.no_write:
        _write(section, name="first_step")


if __name__ == "__main__":
    main()
