"""The README's shape and links. Its code blocks run as written from the installed wheel,
outside the checkout, in tests/test_wheel.py (the guides' code in tests/test_docs.py)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _lm_block():
    return next(b for b in BLOCKS if "tiny_gpt2_causal_lm" in b)


def _head_block():
    return next(b for b in BLOCKS if 'trainable="head"' in b)


def test_readme_opens_with_the_two_commands_and_stays_short():
    first_block = re.search(r"```bash\n(.*?)```", TEXT, re.S).group(1)
    assert first_block.splitlines()[0].startswith("make demo")
    assert first_block.splitlines()[1].startswith("make test")
    assert TEXT.index("```bash") < TEXT.index("\n## ")
    assert len(TEXT.splitlines()) <= 200


def test_every_readme_block_is_run_by_the_wheel_test():
    import test_wheel   # tests/ is on the path (conftest.py)

    assert sorted(BLOCKS) == sorted([_lm_block(), _head_block()])
    scripts = test_wheel._scripts()
    assert scripts["readme_lm"] == _lm_block()
    assert scripts["readme_head"] == _head_block()


def test_readme_links_point_at_existing_files():
    for target in re.findall(r"\]\(([^)#]+)\)", TEXT):
        if "://" not in target:
            assert (ROOT / target).exists(), target
