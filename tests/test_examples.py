"""Smoke tests: each example in examples/ runs end to end with tiny flags."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bert_classifier_dp_example():
    result = _load("bert_classifier_dp").main(
        ["--steps", "2", "--batch-size", "4", "--train-examples", "32",
         "--eval-examples", "16", "--sequence-length", "16", "--verbose", "0"])
    assert result["dp_updates"] == 2
    assert 0 < result["epsilon"] < float("inf")
    # accuracy over the 16 held-out examples: a multiple of 1/16
    assert result["accuracy_after"] * 16 == pytest.approx(round(result["accuracy_after"] * 16))


@pytest.mark.slow
def test_causal_lm_from_preset_dp_example(tmp_path):
    result = _load("causal_lm_from_preset_dp").main(
        ["--steps", "3", "--batch-size", "8", "--target-epsilon", "3.0",
         "--work-dir", str(tmp_path), "--verbose", "0"])
    assert result["dp_updates"] == 3
    assert result["epsilon"] <= 3.0
    assert result["perplexity_after"] < float("inf")
    assert (Path(result["output_preset"]) / "config.json").exists()
    import keras_hub

    reloaded = keras_hub.models.GPT2CausalLM.from_preset(result["output_preset"])
    base = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "tiny_gpt2"))
    assert reloaded.backbone.count_params() == base.backbone.count_params()
    changed = [not np.array_equal(a, b) for a, b in
               zip(reloaded.backbone.get_weights(), base.backbone.get_weights())]
    assert any(changed)  # the saved preset holds the fine-tuned weights
