"""The documentation site: it builds in strict mode, covers every public name, and its code runs.

Every ```python block of a page in docs/ runs, in order, in one namespace per page;
the pages share one subprocess (one TensorFlow start-up) and each reports its own
result. ```bash blocks whose lines call ``keras-dp-lm`` run too, with the
installed command. Blocks needing the pretrained SmolLM2 file read
``$KERAS_DP_LM_GGUF``, which the runner points at a tiny random GGUF written with
the GGUF writer of tests/test_models_gguf.py (nothing is downloaded).

Run the pages by hand: ``python tests/test_docs.py docs/guides/decoding.md``.
"""

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())
# The getting-started page runs as written from the installed wheel, outside the
# checkout (tests/test_wheel.py); every other page with code runs here.
RUN_BY_THE_WHEEL_TEST = DOCS / "guides" / "getting-started.md"
RUN_HERE = [page for page in PAGES if page != RUN_BY_THE_WHEEL_TEST]
BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
PUBLIC_PACKAGES = ("accounting", "callbacks", "clipping", "corpora", "data", "errors",
                   "evaluation", "models", "optimizers", "recipes", "samplers", "testing",
                   "tokenizers", "training", "tuning")


def blocks(page, language):
    return [code for lang, code in BLOCK.findall(Path(page).read_text()) if lang == language]


def _public_names(module_name):
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items()  # corpora: the functions it defines
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name]


def _api_targets():
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    return re.findall(r"^::: (\S+)", text, re.M)


def test_every_public_name_has_an_api_entry():
    targets = set(_api_targets())
    import keras_dp_lm
    expected = {f"keras_dp_lm.{n}" for n in keras_dp_lm.__all__
                if not inspect.ismodule(getattr(keras_dp_lm, n))}
    for package in PUBLIC_PACKAGES:
        assert (DOCS / "api" / f"{package}.md").exists(), package
        module = f"keras_dp_lm.{package}"
        expected |= {module} | {f"{module}.{n}" for n in _public_names(module)}
    assert expected - targets == set()


def test_api_pages_name_objects_by_public_paths_only():
    import keras_dp_lm
    allowed = {"keras_dp_lm"} | {f"keras_dp_lm.{n}" for n in keras_dp_lm.__all__}
    for package in PUBLIC_PACKAGES:
        module = f"keras_dp_lm.{package}"
        allowed |= {module} | {f"{module}.{n}" for n in _public_names(module)}
    assert set(_api_targets()) - allowed == set()


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert {p for p in pages if p not in config} == set()


def test_site_builds_offline_in_strict_mode(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    site = tmp_path / "site"
    # use_directory_urls: false, so a site opened from disk lands on pages, not folders
    assert (site / "api" / "tuning.html").exists()
    assert not (site / "api" / "tuning").exists()
    assert "private_search" in (site / "api" / "tuning.html").read_text()
    assert 'href="guides/getting-started.html"' in (site / "index.html").read_text()
    # No API entry shows a Python builtin's docstring (a constant's or field's type's)
    pages = sorted((site / "api").glob("*.html"))
    assert len(pages) == len(list((DOCS / "api").glob("*.md")))
    found = {str(page.relative_to(site)): text for page in pages
             for text in BUILTIN_DOC_TEXTS if text in page.read_text()}
    assert found == {}
    # Each DP optimizer convenience lists its arguments; constants are documented
    optimizers = (site / "api" / "optimizers.html").read_text()
    dpadam = optimizers[optimizers.index('id="keras_dp_lm.optimizers.DPAdam"'):
                        optimizers.index('id="keras_dp_lm.optimizers.DPAdamBC"')]
    for argument in ("l2_norm_clip", "noise_multiplier", "gradient_accumulation_steps",
                     "inner_optimizer", "suggest_recipe"):
        assert argument in dpadam, argument
    assert "The values of <code>DPOptimizer(clipping=...)</code>" in optimizers


# The first line of Python builtins' docstrings, as a page would show them (HTML-escaped).
BUILTIN_DOC_TEXTS = ("Create a new string object", "Built-in immutable sequence",
                     "Alias for field number",
                     "int([x]) -&gt; integer", "int([x]) -> integer",
                     "Convert a string or number to a floating point number",
                     "bool(x) -&gt; bool", "Returns True when the argument is true",
                     "Built-in mutable sequence", "dict() -&gt; new empty dictionary",
                     "Build an unordered collection of unique elements",
                     "Create and return a new object")


# ---------------------------------------------------------------- the pages' code


def _write_tiny_gguf(path):
    """A random 2-layer llama GGUF with a byte-level BPE vocabulary (every byte), written
    as llama.cpp writes one by the GGUF writer of tests/test_models_gguf.py."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_models_gguf import SPECIAL, _random_backbone, _write_gguf
    from keras_dp_lm import testing
    vocabulary, merges = testing.train_byte_level_bpe(testing.DEFAULT_TEXT, 320,
                                                      special_tokens=())
    tokens = SPECIAL + sorted(vocabulary, key=vocabulary.get)
    _write_gguf(path, _random_backbone(tokens, tied=True), tokens, merges)


def _run_pages(pages, workdir):
    """Runs each page's python blocks in a fresh namespace; returns {page: error or None}."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]  # two devices for the replicas guide
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    os.environ.setdefault("KERAS_DP_LM_DATA", str(ROOT / "data"))
    os.environ.setdefault("KERAS_DP_LM_GGUF", str(Path(workdir) / "tiny.gguf"))
    if not Path(os.environ["KERAS_DP_LM_GGUF"]).exists():
        _write_tiny_gguf(os.environ["KERAS_DP_LM_GGUF"])
    import keras
    results = {}
    for page in pages:
        start = time.perf_counter()
        keras.backend.clear_session()
        namespace = {"__name__": "__main__"}
        try:
            for i, code in enumerate(blocks(page, "python")):
                exec(compile(code, f"{page} (python block {i + 1})", "exec"), namespace)
            results[str(page)] = None
        except BaseException:  # noqa: BLE001 - reported per page
            results[str(page)] = traceback.format_exc()[-4000:]
        print(f"{page}: {'ok' if results[str(page)] is None else 'FAILED'} "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return results


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("docs_run")
    out = workdir / "results.json"
    result = subprocess.run(
        [sys.executable, str(Path(__file__)), "--json", str(out), *map(str, RUN_HERE)],
        cwd=workdir, capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("page", RUN_HERE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, page_results):
    error = page_results[str(page)]
    assert error is None, error


def test_the_pages_with_code_include_every_guide():
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert len(guides) >= 12 and set(guides) <= set(PAGES)
    import test_wheel   # tests/ is on the path

    assert test_wheel.GUIDE == RUN_BY_THE_WHEEL_TEST
    assert test_wheel._scripts()["getting_started"] == "\n".join(
        blocks(RUN_BY_THE_WHEEL_TEST, "python"))


def test_cli_commands_in_the_docs_answer():
    command = shutil.which("keras-dp-lm", path=str(Path(sys.executable).parent))
    assert command
    lines = [line for page in DOCS.rglob("*.md") for code in blocks(page, "bash")
             for line in code.replace("\\\n", " ").splitlines()
             if line.startswith("keras-dp-lm ")]
    assert lines
    for line in lines:
        args = line.split("#")[0].split()[1:]
        result = subprocess.run([command, *args], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, (line, result.stderr[-2000:])
        assert "epsilon" in result.stdout.lower() or "noise" in result.stdout.lower()


if __name__ == "__main__":
    args = sys.argv[1:]
    json_out = None
    if args[:1] == ["--json"]:
        json_out, args = args[1], args[2:]
    pages = [Path(a).resolve() for a in args]
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        outcome = _run_pages(pages, scratch)
    if json_out:
        Path(json_out).write_text(json.dumps(outcome))
    for page, error in outcome.items():
        if error:
            print(f"--- {page}\n{error}", file=sys.stderr)
    # skip TensorFlow's slow teardown once the results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if not any(outcome.values()) else 1)
