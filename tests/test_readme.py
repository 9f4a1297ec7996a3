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
