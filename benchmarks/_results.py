"""Shared helper: each benchmark owns one marked section of benchmarks/RESULTS.md."""

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# Benchmark results\n\n"
    "Each section is written by the script it names, in one run of that script. "
    "Ratios are to non-private training measured in the same run.\n"
)


def machine_line():
    """One line describing this machine, for the record."""
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, {datetime.date.today().isoformat()}")


def write_section(name, markdown):
    """Replace (or append) the section ``name`` of RESULTS.md with ``markdown``."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text and end in text:
        before = text.split(start)[0]
        after = text.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def run_worker(cmd, what):
    """Run a benchmark worker process; return the JSON of its ``RESULT `` line.

    On failure the worker's stderr tail is shown and ``RuntimeError`` names ``what``.
    """
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"{what} failed (exit {proc.returncode})")


def random_token_batch(batch, length, vocabulary_size, seed=0):
    """``(ids [batch, length + 1], mask)``: random token ids and a padding mask whose
    real lengths are uniform in ``[length // 2, length + 1]`` (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocabulary_size, (batch, length + 1)).astype("int32")
    lengths = rng.integers(length // 2, length + 2, batch)
    mask = (np.arange(length + 1)[None, :] < lengths[:, None]).astype("int32")
    return ids, mask
