"""The end-to-end demo app (demo/run.py) in its fast --tiny form."""

import json
import math

import pytest

from demo import run as demo


def test_parse_args_tiny_keeps_explicit_flags():
    args = demo.parse_args(["--tiny", "--steps", "5"])
    assert args.steps == 5 and args.model_size == "micro"
    assert args.pretrain_steps == demo.TINY_OVERRIDES["pretrain_steps"]
    defaults = demo.parse_args([])
    assert defaults.target_epsilon == 8.0 and defaults.sampling == "poisson"
    with pytest.raises(SystemExit):
        demo.parse_args(["--vocab-epsilon", "9", "--target-epsilon", "8"])


@pytest.mark.slow
def test_tiny_demo_end_to_end(tmp_path):
    out = tmp_path / "demo_output"
    report = demo.run(demo.parse_args(
        ["--tiny", "--output-dir", str(out), "--noise-seed", "0", "--verbose", "0"]))
    on_disk = json.loads((out / "report.json").read_text())
    for key in demo.REQUIRED_REPORT_KEYS:
        assert key in report and key in on_disk, key
    privacy = on_disk["privacy"]
    # Vocabulary + training composed within the total target, with every update counted.
    assert privacy["total_epsilon"] <= privacy["target_epsilon"] + 1e-9
    assert privacy["training_epsilon"] < privacy["total_epsilon"]
    assert privacy["vocabulary_epsilon"] < privacy["total_epsilon"]
    # ... at 1e-6 minus the recipe's reserve for a Poisson draw above the padded cap.
    assert privacy["total_delta"] + privacy["overflow_delta_reserved"] == pytest.approx(1e-6)
    assert privacy["dp_updates"] == demo.TINY_OVERRIDES["steps"]
    assert privacy["epsilon_curve_pld"]["total"][-1] == pytest.approx(
        privacy["total_epsilon"], rel=1e-6)
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
    recipe = on_disk["recipe"]
    assert (recipe["steps"], recipe["batch_size"]) == (
        demo.TINY_OVERRIDES["steps"], demo.TINY_OVERRIDES["batch_size"])
    assert recipe["noise_multiplier"] == pytest.approx(privacy["noise_multiplier"])
    assert recipe["epsilon"] == pytest.approx(privacy["total_epsilon"], rel=1e-6)
    assert 1.0 <= on_disk["efficiency"]["padded_slot_overhead"] <= 1.6
    # The progress bar's epsilon never drops below what the updates spent.
    assert privacy["epsilon_by_step"][-1] >= privacy["training_epsilon"] * (1 - 1e-9)


@pytest.mark.slow
def test_tiny_demo_with_speakers_as_privacy_units(tmp_path):
    """--privacy-unit speaker: user-level vocabulary and training, accounted over speakers."""
    import dp_accounting

    args = demo.parse_args(["--tiny", "--privacy-unit", "speaker", "--output-dir",
                            str(tmp_path), "--noise-seed", "0", "--verbose", "0",
                            "--no-plots", "--num-samples", "1"])
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
