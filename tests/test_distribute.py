"""Multi-replica DP: noise once per logical batch, correct across replicas and accumulation.

Each case runs in a subprocess because logical devices must be configured before
TensorFlow initialises.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = str(Path(__file__).with_name("distribute_worker.py"))


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _parse(stdout, stderr):
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError("worker printed no result:\n" + stderr[-3000:])


def run_worker(mode, timeout=600, **args):
    proc = subprocess.run([sys.executable, WORKER, mode, json.dumps(args)],
                          capture_output=True, text=True, env=_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _parse(proc.stdout, proc.stderr)


# Every MirroredStrategy case, run in one subprocess (one TensorFlow start-up).
JOBS = {
    "noise_1": ("noise", dict(replicas=1, sigma=1.3, clip=0.8, batch=16)),
    "noise_2": ("noise", dict(replicas=2, sigma=1.3, clip=0.8, batch=16)),
    "noise_2_acc4": ("noise", dict(replicas=2, sigma=0.9, clip=1.5, batch=32,
                                   accumulation=4)),
    "single": ("train", dict(replicas=1, steps=3, batch=8)),
    "mirrored": ("train", dict(replicas=2, steps=3, batch=8)),
    "mirrored_acc2": ("train", dict(replicas=2, steps=3, batch=8, accumulation=2)),
    "mirrored_jit": ("train", dict(replicas=2, steps=3, batch=8, jit=True)),
    "plain": ("train", dict(replicas=1, steps=8, batch=4)),
    "jit_spe4": ("train", dict(replicas=1, steps=8, batch=4, jit=True, spe=4)),
    "jit_spe4_acc2": ("train", dict(replicas=1, steps=8, batch=4, jit=True, spe=4,
                                    accumulation=2)),
    "poisson_1": ("poisson_fit", dict(replicas=1, steps=4, seed=3)),
    "poisson_2": ("poisson_fit", dict(replicas=2, steps=4, seed=3)),
}


@pytest.fixture(scope="module")
def results():
    return run_worker("jobs", **JOBS)


@pytest.mark.parametrize("name", ["noise_1", "noise_2"])
def test_noise_std_is_sigma_c_over_global_batch_for_any_replica_count(results, name):
    out = results[name]
    assert out["updates"] == 1 and out["divisor"] == 16.0
    # Identical draws on the replicas would give sqrt(2) times the std, sigma*C
    # per replica as well: both fail this 5% band.
    assert abs(out["std"] / out["expected"] - 1) < 0.05


def test_noise_std_with_accumulation_on_two_replicas(results):
    out = results["noise_2_acc4"]
    assert out["updates"] == 1 and out["divisor"] == 32.0
    assert abs(out["std"] / out["expected"] - 1) < 0.05


def _max_rel(a, b):
    a = np.concatenate([np.ravel(w) for w in a])
    b = np.concatenate([np.ravel(w) for w in b])
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_two_replicas_and_accumulation_match_single_device_at_zero_noise(results):
    single = results["single"]
    for name in ("mirrored", "mirrored_acc2", "mirrored_jit"):
        assert results[name]["updates"] == 3
        assert _max_rel(results[name]["weights"], single["weights"]) < 1e-5


def test_fit_on_poisson_and_user_batches_on_two_replicas_matches_one_device(results):
    """``fit`` under MirroredStrategy on bucket-padded Poisson batches (the rate
    travels one per row, replicas may get uneven shares) and on user batches
    (``num_replicas=2`` keeps a user's rows on one replica) trains exactly as
    one device and records the same ledger; a user batch that the split would
    cut apart is refused."""
    single, mirrored = results["poisson_1"], results["poisson_2"]
    for unit, rate, cap in (("example", 0.2, 48), ("user", 0.25, 24)):
        one, two = single[unit], mirrored[unit]
        assert one["updates"] == two["updates"] == 4
        assert one["unit"] == two["unit"] == unit
        assert one["rows"] == two["rows"]
        (sigma, q, max_real, updates), = two["rows"]
        assert (sigma, q, updates) == (0.0, rate, 4.0) and 0 < max_real <= cap
        assert _max_rel(two["weights"], one["weights"]) < 1e-5
    assert "num_replicas" in mirrored["uneven"]


def test_jit_compile_and_steps_per_execution(results):
    plain, compiled, accumulated = (results[k] for k in ("plain", "jit_spe4",
                                                         "jit_spe4_acc2"))
    assert compiled["updates"] == accumulated["updates"] == 8
    assert _max_rel(compiled["weights"], plain["weights"]) < 1e-5
    assert _max_rel(accumulated["weights"], plain["weights"]) < 1e-5


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_multi_worker_mirrored_matches_single_process():
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    args = json.dumps({"steps": 3, "batch": 8})
    procs = []
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        procs.append(subprocess.Popen([sys.executable, WORKER, "multiworker", args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=_env(TF_CONFIG=tf_config)))
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        outputs.append(_parse(stdout, stderr))
    single = run_worker("single_adam", steps=3, batch=8)
    for out in outputs:
        assert out["replicas"] == 2 and out["updates"] == 3
        assert _max_rel(out["weights"], single["weights"]) < 1e-5
