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
    """Quick mode: both runs really train (64 Rotten Tomatoes snippets, 2 steps each),
    the DP run after a DP linear probe (--dp-probe-epsilon): the probe's and the
    fine-tuning's updates, as applied (the head's ledger holds both: the probe
    trains its output layer), composed by dp_accounting directly, give the
    reported epsilon, within --epsilon."""
    import dp_accounting

    result = _load("bert_classifier_dp").main(["--quick", "--verbose", "0",
                                               "--dp-dropout", "0",
                                               "--dp-probe-epsilon", "0.5"])
    assert result["splits"] == ("test",)
    assert result["dp_updates"] == 2
    assert result["recipe"]["l2_norm_clip"] == 0.1
    for key in ("majority_accuracy", "non_private_accuracy", "dp_accuracy"):
        acc = result[key]["test"]  # over the 32 held-out snippets: a multiple of 1/32
        assert acc * 32 == pytest.approx(round(acc * 32))
    assert result["table"].count("\n") == 4  # header, rule and three runs
    assert "| DP (after a DP linear probe at epsilon 0.5, recipe" in result["table"]
    probe, recipe = result["probe_ledger"], result["recipe"]
    probe_updates = sum(row["updates"] for row in probe)
    assert probe_updates > 0
    # the probe trains the head's output layer: the head's ledger holds its
    # updates first, then the fine-tuning's 2
    assert result["dp_ledger"][:len(probe)] == probe
    assert sum(row["updates"] for row in result["dp_ledger"]) == probe_updates + 2
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for sigma, rate, updates in [(r["noise_multiplier"], r["sampling_rate"], r["updates"])
                                 for r in result["dp_ledger"]]:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)),
            updates))
    assert result["epsilon"] == pytest.approx(
        accountant.get_epsilon(recipe["training_delta"]), rel=2e-3)
    assert 0 < result["epsilon"] <= 3.0 * (1 + 1e-6)
    assert result["delta"] > recipe["delta"]  # plus the probe's overflow share


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


@pytest.mark.slow
def test_t5_span_corruption_dp_example():
    """Quick mode: a DP SentencePiece vocabulary and 4 DP-Adam updates of a tiny T5;
    the reported total is dp_accounting's composition of the vocabulary's event and
    the updates the ledger holds, within the target, and the model learned something
    (held-out span-infilling perplexity below the untrained model's)."""
    import dp_accounting

    from keras_dp_lm.accounting import EpsilonDeltaDpEvent

    result = _load("t5_dp_span_corruption").main(["--quick", "--verbose", "0"])
    assert result["vocabulary_size"] == 300
    assert result["dp_updates"] == result["steps"] == 4
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    # the vocabulary: a Gaussian histogram (composed) and its threshold's delta (added)
    vocabulary = result["vocabulary_event"].events
    threshold_delta = sum(e.delta for e in vocabulary
                          if isinstance(e, EpsilonDeltaDpEvent))
    for event in vocabulary:
        if isinstance(event, dp_accounting.GaussianDpEvent):
            accountant.compose(event)
    for sigma, rate, _, updates in result["ledger"]:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)),
            int(updates)))
    epsilon = accountant.get_epsilon(result["delta"] - threshold_delta)
    assert result["total_epsilon"] == pytest.approx(epsilon, rel=2e-2)
    assert result["total_epsilon"] <= 8.0 * (1 + 1e-6) and result["delta"] <= 1e-6
    assert result["held_out_perplexity"] < result["untrained_perplexity"]
