"""Fetch the demo's and tests' public corpora: a thin wrapper of the library.

    python demo/fetch_corpora.py fetch --data-dir data    # = keras-dp-lm data --data-dir data

The fetching lives in the package (:func:`keras_dp_lm.corpora.fetch`), so a pip user,
``make data`` and this script share one implementation; ``make data`` runs
``keras-dp-lm data`` directly. Kept for old commands and scripts.
"""

import argparse
import sys

from keras_dp_lm import corpora
from keras_dp_lm.corpora import fetch_fortunes  # noqa: F401  (old import paths)
from keras_dp_lm.corpora import fetch_kjv  # noqa: F401
from keras_dp_lm.corpora import fetch_rotten_tomatoes  # noqa: F401
from keras_dp_lm.corpora import fetch_shakespeare  # noqa: F401
from keras_dp_lm.corpora import fetch_smollm2  # noqa: F401


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python demo/fetch_corpora.py")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download the public corpora")
    fetch.add_argument("--data-dir", default=None)
    fetch.add_argument("--no-debian", action="store_true",
                       help="skip the optional Debian corpora (fortunes, kjv)")
    args = parser.parse_args(argv)
    names = ["shakespeare", "rotten_tomatoes", "smollm2"] if args.no_debian else None
    for name, path in corpora.fetch(names, data_dir=args.data_dir).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
