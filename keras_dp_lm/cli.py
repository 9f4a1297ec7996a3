"""``keras-dp-lm`` command line.

Subcommands:
    epsilon    epsilon of a DP-SGD run (noise multiplier, batch, data, epochs/steps, delta)
    calibrate  noise multiplier for a target epsilon
    demo       (moved) the demo is an application in the repository: ``make demo``

Example:
    $ keras-dp-lm epsilon --noise-multiplier 1.1 --batch-size 256 \\
          --dataset-size 60000 --epochs 60 --delta 1e-5
    $ keras-dp-lm calibrate --target-epsilon 3 --batch-size 256 \\
          --dataset-size 60000 --epochs 60 --delta 1e-5 --json
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
        description="Differential privacy accounting for keras_dp_lm training "
                    "(all numbers from dp_accounting).")
    sub = parser.add_subparsers(dest="command", metavar="{epsilon,calibrate,demo}",
                                parser_class=_Parser)
    sub.required = True
    eps = sub.add_parser("epsilon", help="epsilon of a DP-SGD run")
    eps.add_argument("--noise-multiplier", type=_float, required=True,
                     help="sigma = noise std / clipping norm")
    _add_run_arguments(eps)
    cal = sub.add_parser("calibrate", help="noise multiplier for a target epsilon")
    cal.add_argument("--target-epsilon", type=_float, required=True)
    _add_run_arguments(cal)
    sub.add_parser("demo", help="moved: run `make demo` (python demo/run.py) in the "
                   "repository", add_help=False)
    return parser


def _steps(args):
    if args.steps is not None:
        return args.steps
    if args.epochs < 0 or not math.isfinite(args.epochs):
        raise ValueError(f"--epochs must be a finite number >= 0, got {args.epochs!r}.")
    steps_per_epoch = math.ceil(args.dataset_size / args.batch_size)
    return math.ceil(args.epochs * steps_per_epoch - 1e-9)


def _run_demo(argv):
    print("keras-dp-lm: the demo is an application in the keras_dp_lm repository, "
          "outside the library: run `make demo`, or `python demo/run.py "
          + " ".join(argv) + "` from a checkout.", file=sys.stderr)
    return EXIT_USAGE


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
    if argv and argv[0] == "demo":
        return _run_demo(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command == "demo":  # e.g. options placed before "demo"
        return _run_demo([])

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
