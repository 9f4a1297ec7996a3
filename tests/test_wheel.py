"""A wheel built from this checkout installs with pip alone into a fresh virtual environment.

No make, no editable install: ``pip wheel --no-deps`` builds the wheel (in pip's build
isolation, with the setuptools that pyproject.toml asks for), ``python -m
venv`` makes an empty environment and ``pip install`` resolves the wheel's declared
dependencies from the configured indexes (the pip cache makes TensorFlow's install
fast). Then the installed package imports from outside the checkout, and the
``keras-dp-lm`` console script answers.
"""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, cwd, timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_installs_with_pip_alone_and_works(tmp_path):
    # build from a copy of the tree's tracked files, so build/ and egg-info stay out of it
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard", "pyproject.toml", "README.md", "keras_dp_lm"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps",
          "-w", wheels, source], cwd=tmp_path, timeout=300)
    [wheel] = wheels.glob("keras_dp_lm-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", wheel], cwd=tmp_path, timeout=600)

    outside = tmp_path / "elsewhere"  # not the checkout: the import must come from the wheel
    outside.mkdir()
    found = _run([python, "-c", "import keras_dp_lm, keras_dp_lm.accounting as a; "
                  "print(keras_dp_lm.__file__); print(keras_dp_lm.__version__)"],
                 cwd=outside, timeout=300).stdout.split()
    assert str(env_dir) in found[0] and found[1] == "0.1.0"

    cli = env_dir / "bin" / "keras-dp-lm"
    answer = _run([cli, "epsilon", "--noise-multiplier", "1.1", "--batch-size", "256",
                   "--dataset-size", "60000", "--epochs", "60", "--delta", "1e-5", "--json"],
                  cwd=outside, timeout=300).stdout
    report = json.loads(answer)
    assert 0 < report["epsilon"] < 10
    calibrated = _run([cli, "calibrate", "--target-epsilon", "3", "--batch-size", "256",
                       "--dataset-size", "60000", "--epochs", "60", "--delta", "1e-5"],
                      cwd=outside, timeout=300)
    assert "noise" in calibrated.stdout.lower()
