"""Secret-sharer canaries (Carlini et al., 2019): random secrets inserted into training data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class CanarySpace:
    """All texts ``format.format(digits=d)`` for ``num_digits``-digit strings ``d``.

    ``digit_separator`` is put between digits (``" "`` makes every digit its own word,
    which helps word-level vocabularies).
    """

    format: str = "my ssn is {digits}"
    num_digits: int = 6
    digit_separator: str = ""

    @property
    def size(self) -> int:
        return 10 ** self.num_digits

    def secret(self, index: int) -> str:
        return str(int(index)).zfill(self.num_digits)

    def text(self, secret: int | str) -> str:
        """The text for a secret given as an int index or a digit string."""
        if not isinstance(secret, str):
            secret = self.secret(secret)
        if len(secret) != self.num_digits or not secret.isdigit():
            raise ValueError(f"secret must be {self.num_digits} digits, got {secret!r}")
        return self.format.format(digits=self.digit_separator.join(secret))

    def enumerate(self) -> list[str]:
        """Every text of the space, in secret order (only for small spaces)."""
        return [self.text(i) for i in range(self.size)]

    def sample(self, num: int, seed: int | None = None, exclude: Iterable[str] = ()) -> list[str]:
        """``num`` texts with uniformly random secrets (with replacement), never any
        text in ``exclude``; ``seed`` seeds NumPy's generator (None: fresh entropy)."""
        rng = np.random.default_rng(seed)
        exclude = set(exclude)
        out = []
        while len(out) < num:
            for idx in _random_indices(rng, self.size, num - len(out)):
                text = self.text(int(idx))
                if text not in exclude:
                    out.append(text)
        return out


def _random_indices(rng, size, num):
    if size <= 2**62:
        return rng.integers(0, size, size=num)
    # Python ints for huge spaces.
    return [int("".join(map(str, rng.integers(0, 10, size=len(str(size)) - 1))))
            for _ in range(num)]


@dataclasses.dataclass(frozen=True)
class Canary:
    """One inserted secret: ``text`` is what goes into the training data.

    Attributes:
        text: the canary's text in its space's ``format``.
        secret: the ``num_digits``-digit string.
        space: the :class:`CanarySpace` it was drawn from (the candidates of
            :func:`exposure`).
    """

    text: str
    secret: str
    space: CanarySpace

    def __str__(self):
        return self.text


def make_canaries(num: int, format: str = "my ssn is {digits}", num_digits: int = 6,
                  seed: int | None = None, digit_separator: str = "") -> list[Canary]:
    """``num`` canaries with distinct uniformly random secrets.

    Args:
        num: how many canaries.
        format: a ``str.format`` pattern with a ``{digits}`` field.
        num_digits: secret length; the candidate space has ``10**num_digits`` texts.
        seed: numpy seed (``None``: fresh entropy).
        digit_separator: put between digits (e.g. ``" "``).

    Returns:
        A list of :class:`Canary`.
    """
    if "{digits}" not in format:
        raise ValueError("format must contain a '{digits}' field")
    space = CanarySpace(format, int(num_digits), digit_separator)
    if num > space.size:
        raise ValueError(f"cannot draw {num} distinct secrets from {space.size}")
    rng = np.random.default_rng(seed)
    secrets, seen = [], set()
    while len(secrets) < num:
        for idx in _random_indices(rng, space.size, num - len(secrets)):
            s = space.secret(int(idx))
            if s not in seen:
                seen.add(s)
                secrets.append(s)
    return [Canary(space.text(s), s, space) for s in secrets]


def insert_canaries(texts: Sequence[str], canaries: Sequence[Canary | str],
                    repetitions: int | Sequence[int] = 1, seed: int | None = None) -> list[str]:
    """Return a new list: ``texts`` plus each canary as its own record, repeated.

    Args:
        texts: the training records (strings).
        canaries: :class:`Canary` objects or strings.
        repetitions: an int for all canaries, or one int per canary (0 = left out).
        seed: the canary records are put at random positions drawn with this seed.
    """
    canaries = list(canaries)
    if isinstance(repetitions, (int, np.integer)):
        repetitions = [int(repetitions)] * len(canaries)
    repetitions = list(repetitions)
    if len(repetitions) != len(canaries):
        raise ValueError("need one repetition count per canary")
    if any(r < 0 for r in repetitions):
        raise ValueError("repetitions must be >= 0")
    out = [str(t) for t in texts]
    extra = [str(c) for c, r in zip(canaries, repetitions) for _ in range(r)]
    rng = np.random.default_rng(seed)
    # Random insertion points among the original records (original order kept).
    slots = rng.integers(0, len(out) + 1, size=len(extra))
    order = np.argsort(slots, kind="stable")
    result, prev = [], 0
    for j in order:
        result.extend(out[prev:slots[j]])
        prev = slots[j]
        result.append(extra[j])
    result.extend(out[prev:])
    return result
