"""The README's code examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples():
    assert any("register_clipping_rule" in block for block in BLOCKS)


@pytest.mark.parametrize("block", [b for b in BLOCKS if "register_clipping_rule" in b],
                         ids=["custom_layer_rule"])
def test_custom_layer_rule_example_runs(block):
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ghost" in result.stdout and "why exact" in result.stdout


@pytest.mark.slow
def test_head_quick_start_and_the_search_run_as_written():
    head = next(b for b in BLOCKS if 'trainable="head"' in b)
    search = next(b for b in BLOCKS if "tuning.private_search" in b)
    # the search block continues the head block (it reuses its features)
    result = subprocess.run([sys.executable, "-c", head + "\n" + search],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy, epsilon = re.search(r"test accuracy ([\d.]+) at epsilon ([\d.]+)",
                                  result.stdout).groups()
    assert float(epsilon) <= 3.0 and float(accuracy) > 0.5
    assert "trainable='head'" in result.stdout and "spends epsilon" in result.stdout
