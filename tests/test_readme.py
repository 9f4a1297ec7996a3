"""The README's code examples run as written (the guides' code runs in tests/test_docs.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _lm_block():
    return next(b for b in BLOCKS if "tiny_gpt2_causal_lm" in b)


def _head_block():
    return next(b for b in BLOCKS if 'trainable="head"' in b)


def _search_block():
    return next(b for b in BLOCKS if "tuning.private_search" in b)


def test_readme_opens_with_the_two_commands_and_stays_short():
    first_block = re.search(r"```bash\n(.*?)```", TEXT, re.S).group(1)
    assert first_block.splitlines()[0].startswith("make demo")
    assert first_block.splitlines()[1].startswith("make test")
    assert TEXT.index("```bash") < TEXT.index("\n## ")
    assert len(TEXT.splitlines()) <= 200


def test_every_readme_block_is_run_by_a_test():
    assert sorted(BLOCKS) == sorted([_lm_block(), _head_block(), _search_block()])


def test_readme_links_point_at_existing_files():
    for target in re.findall(r"\]\(([^)#]+)\)", TEXT):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_causal_lm_quick_start_runs_as_written():
    result = subprocess.run([sys.executable, "-c", _lm_block()], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "satisfies (epsilon = 3" in result.stdout


@pytest.mark.slow
def test_head_quick_start_and_the_search_run_as_written():
    # the search block continues the head block (it reuses its features)
    result = subprocess.run([sys.executable, "-c", _head_block() + "\n" + _search_block()],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy, epsilon = re.search(r"test accuracy ([\d.]+) at epsilon ([\d.]+)",
                                  result.stdout).groups()
    assert float(epsilon) <= 3.0 and float(accuracy) > 0.5
    assert "trainable='head'" in result.stdout and "spends epsilon" in result.stdout
