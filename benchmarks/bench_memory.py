"""Where the DP LoRA step's extra peak memory goes on SmolLM2-135M (issue 16).

``python benchmarks/bench_memory.py`` runs, each in a fresh process, the SmolLM2-135M
LoRA (rank 8, batch 16, sequence 64) train step of ``bench_dp_step.py``:

* ``nonprivate`` / ``dp``: 3 steps; peak RSS, as the LoRA rows of ``bench_dp_step.py``;
* ``dp, probe skipped``: the same DP step with the independence probe marked as passed
  instead of run (a diagnostic only: the package never skips it), which shows
  what the probe's first call costs on top of the step;
* ``recompiles``: ``compile`` + ``train_on_batch`` three times on one model, a new
  optimizer each time (one process with plain Adam, one with DPAdam): the RSS each
  recompile leaves behind (after ``gc`` and ``malloc_trim``), since every compile
  traces new functions.

It writes the ``memory`` section of ``benchmarks/RESULTS.md``.
"""

import argparse
import ctypes
import gc
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _results import machine_line  # noqa: E402
from _results import run_worker  # noqa: E402
from _results import write_section  # noqa: E402

MODEL, BATCH, LORA, STEPS, RECOMPILES = "smollm2", 16, 8, 3, 3


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _released_rss_mb():
    """RSS after a garbage collection and glibc's ``malloc_trim`` (memory that is
    only cached by the allocator does not count)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _rss_mb()


def _skip_probe():
    """Mark the probe as passed instead of running it (diagnostic only)."""
    from keras_dp_lm.training import refusals
    from keras_dp_lm.training import probing

    def passed(model, data, spec=None):
        state = refusals.probe_state(model)
        state.independence_checked.assign(1)
        state.probed_before_step = True
    probing._probe_batch = passed


def _steps(side):
    from bench_dp_step import _train_step

    out = dict(side=side)
    if side == "dp-no-probe":
        _skip_probe()
    elif side == "dp":
        _record_after_probe(out)
    step = _train_step(MODEL, BATCH, False, side != "nonprivate", LORA)
    out["built_mb"] = _released_rss_mb()
    for _ in range(STEPS):
        step()
    out["peak_rss_mb"] = _peak_mb()
    return out


def _record_after_probe(out):
    """Record the peak RSS of the probe's call and the RSS it leaves behind."""
    from keras_dp_lm.training import probing

    probe = probing._probe_batch

    def recorded(*args, **kwargs):
        result = probe(*args, **kwargs)
        out.update(probe_peak_mb=_peak_mb(), after_probe_mb=_released_rss_mb())
        return result
    probing._probe_batch = recorded


def _recompiles(side):
    import keras
    import tensorflow as tf

    import keras_dp_lm as kdp
    from bench_dp_step import _model_and_batch

    lm, data = _model_and_batch(MODEL, BATCH, LORA)
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    lm(tensors[0])
    rss = [_released_rss_mb()]
    for _ in range(RECOMPILES):
        optimizer = (kdp.DPAdam(1e-4, l2_norm_clip=0.1, noise_multiplier=1.0,
                                expected_batch_size=float(BATCH))
                     if side == "dp" else keras.optimizers.Adam(1e-4))
        lm.compile(optimizer=optimizer, weighted_metrics=[],
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        lm.train_on_batch(*tensors)
        rss.append(_released_rss_mb())
    return dict(side=side, rss_mb=rss)


def _table(results, recompiles):
    base = results["nonprivate"]["peak_rss_mb"]
    dp = results["dp"]
    rows = [f"| {name} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / base:.2f}x |"
            for name, r in (("non-private LoRA", results["nonprivate"]),
                            ("DP LoRA (the package)", results["dp"]),
                            ("DP LoRA, probe skipped (diagnostic)", results["dp-no-probe"]))]
    growth = []
    for side, r in recompiles.items():
        steps = [b - a for a, b in zip(r["rss_mb"], r["rss_mb"][1:])]
        growth.append(f"| {side} | {r['rss_mb'][0]:.0f} | "
                      + " / ".join(f"+{s:.0f}" for s in steps) + " |")
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1 (default)")
    return f"""## Where the DP LoRA step's memory goes (issue 16)

- machine: {machine_line()}; oneDNN: TF_ENABLE_ONEDNN_OPTS={onednn}
- command: `python benchmarks/bench_memory.py`
- SmolLM2-135M, `enable_lora({LORA})`, batch {BATCH}, sequence 64, the step of
  `bench_dp_step.py`; each row one fresh process, {STEPS} steps, peak RSS (`ru_maxrss`)

| run | peak RSS MB | vs non-private |
|---|---:|---:|
{chr(10).join(rows)}

The independence probe's one call before the first step peaks at {dp['probe_peak_mb']:.0f} MB;
after it returns, and after `gc` and `malloc_trim`, RSS stays at {dp['after_probe_mb']:.0f} MB,
{dp['after_probe_mb'] - dp['built_mb']:.0f} MB above the built model ({dp['built_mb']:.0f} MB), and the first
step then adds its own working set on top. Without the probe the DP step is
{results['dp-no-probe']['peak_rss_mb'] / base:.2f}x non-private.

RSS left behind by each `compile` + `train_on_batch` on one model (after `gc` and
`malloc_trim`; TensorFlow keeps per-function state of every traced function):

| optimizer | RSS after building, MB | growth per recompile, MB |
|---|---:|---|
{chr(10).join(growth)}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["nonprivate", "dp", "dp-no-probe"])
    parser.add_argument("--recompiles", choices=["plain", "dp"])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.worker:
        print("RESULT " + json.dumps(_steps(args.worker)), flush=True)
        return
    if args.recompiles:
        print("RESULT " + json.dumps(_recompiles(args.recompiles)), flush=True)
        return
    me = [sys.executable, os.path.abspath(__file__)]
    results = {side: run_worker(me + ["--worker", side], f"memory worker {side}")
               for side in ("nonprivate", "dp", "dp-no-probe")}
    recompiles = {side: run_worker(me + ["--recompiles", side], f"recompiles {side}")
                  for side in ("plain", "dp")}
    md = _table(results, recompiles)
    print(md)
    if not args.no_write:
        write_section("memory", md)


if __name__ == "__main__":
    main()
