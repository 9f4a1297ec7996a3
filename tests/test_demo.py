"""The end-to-end demo app (demo/run.py): its configurations, and its fast --tiny form."""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from demo import run as demo

ROOT = Path(__file__).resolve().parents[1]


def test_parse_args_tiny_keeps_explicit_flags():
    args = demo.parse_args(["--tiny", "--steps", "5"])
    assert args.steps == 5 and args.model_size == "micro"
    assert args.pretrain_steps == demo.TINY_OVERRIDES["pretrain_steps"]
    defaults = demo.parse_args([])
    assert defaults.target_epsilon == 8.0 and defaults.sampling == "poisson"
    with pytest.raises(SystemExit):
        demo.parse_args(["--vocab-epsilon", "9", "--target-epsilon", "8"])
    full = demo.parse_args(["--full"])  # the recipe behind the README's numbers
    assert full.min_steps == 100 and full.epochs == 3.0
    with pytest.raises(SystemExit):
        demo.parse_args(["--min-steps", "0"])


def test_quick_is_the_default_and_full_is_one_flag():
    quick, full = demo.parse_args([]), demo.parse_args(["--full"])
    assert (quick.configuration, full.configuration) == ("quick", "full")
    assert demo.QUICK_OVERRIDES["pretrain_steps"] < full.pretrain_steps == 6000
    for key, value in demo.QUICK_OVERRIDES.items():
        assert getattr(quick, key) == value, key
    # --full is the parser's own defaults: what the README's results table quotes.
    assert vars(full) == dict(vars(demo.build_parser().parse_args([])), configuration="full",
                              full=True)
    # A flag given explicitly wins over the configuration, in any spelling.
    assert demo.parse_args(["--pretrain-steps=7"]).pretrain_steps == 7
    assert demo.parse_args(["--pretrain-st", "7"]).pretrain_steps == 7
    assert demo.parse_args(["--decoding-epsilons"]).decoding_epsilons == []
    assert demo.parse_args(["--full", "--epochs", "2"]).epochs == 2
    with pytest.raises(SystemExit):
        demo.parse_args(["--full", "--tiny"])


def test_quick_configuration_is_reported_as_such():
    summary = demo.configuration_summary(demo.parse_args([]))
    assert summary["name"] == "quick" and not summary["comparable_with_readme_results"]
    assert summary["differs_from_full"]["pretrain_steps"] == {
        "value": demo.QUICK_OVERRIDES["pretrain_steps"], "full": 6000}
    text = " ".join(demo.configuration_lines(summary))
    assert "**quick**" in text and "README" in text and "--full" in text
    assert "pretrain_steps" in text
    full = demo.configuration_summary(demo.parse_args(["--full"]))
    assert full["comparable_with_readme_results"] and not full["differs_from_full"]
    changed = demo.configuration_summary(demo.parse_args(["--full", "--epochs", "1"]))
    assert not changed["comparable_with_readme_results"]
    assert "not the README's" in " ".join(demo.configuration_lines(changed))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_runs_quick_unless_full():
    def command(*extra):
        out = subprocess.run(["make", "-n", "demo", *extra],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return next(line for line in out.splitlines() if "demo/run.py" in line)

    assert "--full" not in command() and "--tiny" not in command()
    assert "--full" in command("FULL=1")


@pytest.mark.slow
def test_tiny_demo_end_to_end(tmp_path):
    out = tmp_path / "demo_output"
    report = demo.run(demo.parse_args(
        ["--tiny", "--output-dir", str(out), "--noise-seed", "0", "--verbose", "0"]))
    on_disk = json.loads((out / "report.json").read_text())
    for key in demo.REQUIRED_REPORT_KEYS:
        assert key in report and key in on_disk, key
    # One timed stage per pipeline function, wall and CPU, and which configuration ran.
    assert list(on_disk["runtime_seconds"]) == list(on_disk["cpu_seconds"]) == [
        *demo.STAGES, "total"]
    assert on_disk["configuration"]["name"] == on_disk["config"]["configuration"] == "tiny"
    assert not on_disk["configuration"]["comparable_with_readme_results"]
    privacy = on_disk["privacy"]
    # Vocabulary + training composed within the total target, with every update counted.
    assert privacy["total_epsilon"] <= privacy["target_epsilon"] + 1e-9
    assert privacy["training_epsilon"] < privacy["total_epsilon"]
    assert privacy["vocabulary_epsilon"] < privacy["total_epsilon"]
    # ... at 1e-6 minus the recipe's reserve for a Poisson draw above the padded cap.
    assert privacy["total_delta"] + privacy["overflow_delta_reserved"] == pytest.approx(1e-6)
    assert privacy["dp_updates"] == demo.TINY_OVERRIDES["steps"]
    # The curve bounds the accountant's value from above (read 1e-11 lower in delta).
    assert (privacy["total_epsilon"] <= privacy["epsilon_curve_pld"]["total"][-1]
            <= privacy["total_epsilon"] * (1 + 3e-6))
    for name in ("public_only", "dp", "non_private"):
        assert math.isfinite(on_disk["perplexity"][name]) and on_disk["perplexity"][name] > 1
    assert len(on_disk["exposure"]["canaries"]) == len(demo.TINY_OVERRIDES["canary_repetitions"])
    for row in on_disk["exposure"]["canaries"]:
        for name in ("public_only", "dp", "non_private"):
            assert 0 <= row[name] <= on_disk["exposure"]["max_exposure"]
    for name in ("dp", "non_private", "dp_top_k"):
        samples = on_disk["samples"][name]
        assert "error" not in samples, samples.get("error")
        assert len(samples["texts"]) == len(samples["prompts"]) > 0
        assert all(isinstance(t, str) and t for t in samples["texts"])
    for name in ("dp", "non_private"):
        assert on_disk["samples"][name]["decoding_epsilon_per_sequence"] > 0
    for f in ("report.md", "epsilon_vs_step.png", "loss_curves.png", "exposure.png",
              "dp_sentencepiece.model"):
        assert (out / f).stat().st_size > 0, f
    markdown = (out / "report.md").read_text()
    assert "Total: epsilon" in markdown and "## Recipe" in markdown
    assert "Configuration: **tiny**" in markdown and "| stage | wall | CPU |" in markdown
    recipe = on_disk["recipe"]
    assert (recipe["steps"], recipe["batch_size"]) == (
        demo.TINY_OVERRIDES["steps"], demo.TINY_OVERRIDES["batch_size"])
    assert recipe["noise_multiplier"] == pytest.approx(privacy["noise_multiplier"])
    assert recipe["epsilon"] == pytest.approx(privacy["total_epsilon"], rel=1e-6)
    assert 1.0 <= on_disk["efficiency"]["padded_slot_overhead"] <= 1.6
    # The progress bar's epsilon never drops below what the updates spent.
    assert privacy["epsilon_by_step"][-1] >= privacy["training_epsilon"] * (1 - 1e-9)
    _check_decoding_comparison(on_disk, markdown)


def _check_decoding_comparison(report, markdown):
    """Issue 17: uniform mixture, public mixture and public model alone at equal epsilon."""
    from keras_dp_lm.samplers import PublicMixtureSampler, renyi

    d = report["decoding_comparison"]
    assert "error" not in d, d.get("error")
    epsilons = demo.TINY_OVERRIDES["decoding_epsilons"]
    tokens = demo.TINY_OVERRIDES["decoding_tokens"]
    assert d["epsilons"] == epsilons and d["num_tokens"] == tokens
    assert d["delta"] == pytest.approx(1e-6)
    assert d["scored_records"] == demo.TINY_OVERRIDES["heldout_records"]
    by = {(r["epsilon"], r["sampler"]): r for r in d["rows"]}
    assert len(by) == len(d["rows"]) == 3 * len(epsilons)
    v = d["vocabulary_size"]
    # Scored like the held-out table: the public model alone and the DP model match it.
    assert d["references"]["public_only"] == pytest.approx(
        report["perplexity"]["public_only"], rel=1e-3)
    assert d["references"]["dp_model_alone"] == pytest.approx(
        report["perplexity"]["dp"], rel=1e-3)
    assert d["references"]["private_model_alone"] == pytest.approx(
        report["perplexity"]["non_private"], rel=1e-3)
    for e in epsilons:
        uniform, mixture, public = (by[(e, s)] for s in (
            "uniform_mixture", "public_mixture", "public_only"))
        lam = uniform["parameters"]["lambda"]
        # lambda from lambda_for_epsilon; perplexity at most |V| / (1 - lambda).
        assert 0 < lam < 1 and 1 < uniform["perplexity"] <= v / (1 - lam) * (1 + 1e-9)
        assert public["perplexity"] == d["references"]["public_only"]
        assert mixture["reachable"] and mixture["delta"] == d["delta"]
        p = mixture["parameters"]
        # The ball spends at most epsilon per sequence, recomputed independently.
        assert p["charged_epsilon"] <= e * (1 + 1e-9)
        assert renyi.sequence_epsilon(p["beta"], p["alpha"], 1, tokens, d["delta"]) \
            <= e * (1 + 1e-9)
        assert 0 <= p["mean_lambda"] <= 1 and 1 < mixture["perplexity"] < v
    gains = {g["epsilon"]: g for g in d["public_mixture_vs_public_only"]}
    assert set(gains) == set(epsilons)
    samples = d["samples"]
    assert len(samples["public_only"]) == len(samples["prompts"]) == \
        demo.TINY_OVERRIDES["decoding_samples"]
    for entry in samples["by_epsilon"]:
        for name in ("uniform_mixture", "public_mixture"):
            assert len(entry[name]) == len(samples["prompts"])
            assert all(isinstance(t, str) and t for t in entry[name])
            # Each sample was charged to a budget before it was generated.
            assert 0 < entry[name + "_spent"] <= entry["epsilon"] * len(
                samples["prompts"]) * (1 + 1e-9)
    assert "## Private decoding at equal epsilon" in markdown
    assert "| epsilon / %d tokens | uniform mixture" % tokens in markdown
    assert PublicMixtureSampler.__name__ in markdown


@pytest.mark.slow
def test_tiny_demo_with_speakers_as_privacy_units(tmp_path):
    """--privacy-unit speaker: user-level vocabulary and training, accounted over speakers."""
    import dp_accounting

    args = demo.parse_args(["--tiny", "--privacy-unit", "speaker", "--output-dir",
                            str(tmp_path), "--noise-seed", "0", "--verbose", "0",
                            "--no-plots", "--num-samples", "1", "--decoding-epsilons"])
    data = demo.load_data(args)
    units = len(set(data["private_units"]))
    assert len(data["private_units"]) == len(data["private"]) > units > 100
    report = demo.run(args)
    corpora, privacy = report["corpora"], report["privacy"]
    assert (corpora["privacy_unit"], corpora["privacy_units"]) == ("speaker", units)
    assert report["recipe"]["dataset_size"] == units
    assert privacy["total_epsilon"] <= privacy["target_epsilon"] + 1e-9
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        privacy["sampling_rate"], dp_accounting.GaussianDpEvent(privacy["noise_multiplier"])),
        privacy["dp_updates"])
    direct = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(
        privacy["training_delta"])
    assert privacy["training_epsilon"] == pytest.approx(direct, rel=1e-3)
    assert "the speaker" in (tmp_path / "report.md").read_text()
    assert "skipped" in report["decoding_comparison"]


# --- the corpora the demo uses (keras_dp_lm.corpora) ----------------------------------


def test_text_records_split_and_join():
    from keras_dp_lm import corpora

    text = "Ber.\nWho's there?\n\nFran.\nNay, answer me:  stand,\tand unfold yourself.\n\n\nx"
    assert corpora.text_records(text) == [
        "Ber. Who's there?", "Fran. Nay, answer me: stand, and unfold yourself.", "x"]
    assert corpora.text_records(text, min_chars=2) == [
        "Ber. Who's there?", "Fran. Nay, answer me: stand, and unfold yourself."]
    # Lines are kept whole while they fit; overlong lines are cut between words.
    assert corpora.text_records("aa bb\ncc dd\nee", max_chars=11) == ["aa bb cc dd", "ee"]
    assert corpora.text_records("one two three four", max_chars=9) == [
        "one two", "three", "four"]
    assert all(len(r) <= 9 for r in corpora.text_records("a" * 20 + " b", max_chars=9))


def test_public_and_private_corpora_are_disjoint():
    from keras_dp_lm import corpora

    plays = corpora.load_shakespeare_plays()  # `make test` fetches them: missing = failure
    milton = corpora.load_milton()
    assert {"hamlet", "macbeth", "sonnets"} <= set(plays)
    assert set(milton) == set(corpora.MILTON_FILES)
    assert not any("paradise" in name or "areopagitica" in name for name in plays)
    assert "Of Mans First Disobedience" in milton["paradise_lost"]
    assert all("Milton" not in text[:300] for text in plays.values())


def test_load_text_files(tmp_path):
    from keras_dp_lm import corpora

    (tmp_path / "a.txt").write_text("first file")
    sub = tmp_path / "dir"
    sub.mkdir()
    (sub / "a.txt").write_text("second file")
    texts = corpora.load_text_files([tmp_path / "a.txt", sub])
    assert texts == {"a": "first file", "a_2": "second file"}
    with pytest.raises(FileNotFoundError):
        corpora.load_text_files([tmp_path / "missing.txt"])
