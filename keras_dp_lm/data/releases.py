"""What every one-shot Gaussian release of training statistics shares
(``DPFeatureNormalization``, ``DPClassPriors``, ``DPClassMeans``): the grouping
of rows into users, each release class's own noise stream, the noise level that
cannot change once spent, and the release count that survives a weight copy."""

from __future__ import annotations

from typing import Any

import numpy as np

# Each release class draws from its own stream of a test seed: one seed given to
# two release layers must not give them the same noise (a public difference of
# their releases would cancel it). DPFeatureNormalization keeps the bare index.
PRIORS_STREAM = 1
CLASS_MEANS_STREAM = 2


def noise_generator(seed: int | None, index: int,
                    stream: int | None = None) -> np.random.Generator:
    """The generator of release ``index`` (OS entropy when ``seed`` is None)."""
    if seed is None:
        return np.random.default_rng()
    key = (index,) if stream is None else (stream, index)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def user_index(user_ids: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(user of each row, rows per user)`` for ``n`` rows. Refuses ids that are
    not one finite value per row: NaN or None ids would merge unknown people into
    one user, whose rows then move a release as if they were one person's."""
    users = np.asarray(user_ids)
    if users.ndim != 1 or len(users) != n:
        raise ValueError(f"`user_ids` must have one entry per record ({n}); got shape "
                         f"{tuple(users.shape)}.")
    if users.dtype.kind == "O" and any(u is None for u in users):
        raise ValueError("`user_ids` contain None: give every record its user's id.")
    if users.dtype.kind in "fc" and not np.all(np.isfinite(users)):
        raise ValueError("`user_ids` contain NaN or infinite values: give every record "
                         "its user's id (unknown people must not share one id).")
    _, inverse, per_user = np.unique(users, return_inverse=True, return_counts=True)
    return inverse.reshape(-1), per_user


class SetUntilReleased:
    """A data descriptor for a release's noise level: settable until the first
    release, read-only after (the events of past releases are computed from it,
    so a later change would rewrite what they spent)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.attribute = name, f"_{name}_value"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.attribute)

    def __set__(self, obj: Any, value: Any) -> None:
        if getattr(obj, "num_releases", 0):
            raise AttributeError(
                f"`{self.name}` cannot change after a release: the events of the "
                f"{obj.num_releases} release(s) made are computed from it. Make a new "
                "layer (and count both in the accountant's extra_events).")
        object.__setattr__(obj, self.attribute, value)


def sync_release_count(layer: Any) -> int:
    """The larger of ``layer.num_releases`` and its ``releases`` weight, written
    to both: a count copied with the weights (``set_weights``, a legacy ``.h5``)
    or kept by the layer is never lowered by the other."""
    count = int(layer.num_releases)
    variable = getattr(layer, "releases", None)
    if variable is not None:
        count = max(count, int(variable.numpy()))
        variable.assign(count)
    layer.num_releases = count
    return count
