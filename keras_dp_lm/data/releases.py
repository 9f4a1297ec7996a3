"""What every one-shot Gaussian release of training statistics shares
(``DPFeatureNormalization``, ``DPClassPriors``, ``DPClassMeans``): the grouping
of rows into users, each release class's own noise stream, the noise level that
cannot change once spent, the release count that survives a weight copy, and,
for the two Keras layers, :class:`ReleaseLayer`: one noised pair ``(sums,
counts / COUNT_NOISE_SCALE)`` per ``adapt``, whose event, count and privacy unit
the accountant and the DP step check in every model that holds the layer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import dp_accounting
import keras
import numpy as np

from keras_dp_lm.accounting._arguments import check_noise

# The count's noise std is COUNT_NOISE_SCALE times the sum's: std 20 with the
# default (2% of the mean's scale at N = 1,000), for a joint sensitivity of
# sqrt(1 + 1 / 16) = 1.031 instead of 1.
COUNT_NOISE_SCALE = 4.0
PRIVACY_UNITS = ("example", "user")


_CALLS = threading.local()


@contextlib.contextmanager
def recording_release_calls():
    """Collect the release layers (:class:`DPFeatureNormalization`,
    ``DPClassMeans``) called inside the block.

    The DP train step traces the model's forward pass in this block and refuses
    a release layer the model does not list among its layers (called from a
    ``keras.layers.Lambda``, or a global layer called from a custom ``call``):
    the accountant, which finds release layers by walking the model, would
    leave its release out of the total.

    Example:
        >>> import numpy as np
        >>> from keras_dp_lm.data import DPFeatureNormalization
        >>> layer = DPFeatureNormalization(seed=0)
        >>> layer.adapt(np.eye(3) + 1.0)
        >>> with recording_release_calls() as called:
        ...     _ = layer(np.ones((1, 3), "float32"))
        >>> called == [layer]
        True
    """
    collectors = _CALLS.__dict__.setdefault("collectors", [])
    called = []
    collectors.append(called)
    try:
        yield called
    finally:
        collectors.remove(called)


def note_release_call(layer):
    """Tell every open :func:`recording_release_calls` block that ``layer`` (a
    release layer) was called: each release layer's ``call`` starts with it."""
    for called in getattr(_CALLS, "collectors", ()):
        if all(seen is not layer for seen in called):
            called.append(layer)


def is_release_layer(layer):
    """Whether ``layer`` releases statistics of its training data
    (:class:`DPFeatureNormalization`, :class:`~keras_dp_lm.data.DPClassMeans`),
    by a class marker: one made before an ``importlib.reload`` still counts."""
    return getattr(type(layer), "_keras_dp_lm_release_layer", False) is True


def release_sensitivity() -> float:
    """L2 sensitivity of a release layer's noised pair ``(sums of vectors of norm
    at most 1, counts / COUNT_NOISE_SCALE)`` under adding or removing one privacy
    unit, each coordinate noised with the same std."""
    return float(np.sqrt(1.0 + COUNT_NOISE_SCALE ** -2))


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
    _refuse_mixed_id_types(user_ids)
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


def _refuse_mixed_id_types(user_ids: Any) -> None:
    """Refuse ids of several kinds (numbers, text, booleans): converting them to one
    array type merges ``1`` and ``"1"`` (or ``True`` and ``1``) into one user."""
    if isinstance(user_ids, np.ndarray) and user_ids.dtype.kind != "O":
        return  # one dtype already: nothing was converted
    kinds = {"text" if isinstance(u, (str, bytes, np.str_, np.bytes_)) else
             "boolean" if isinstance(u, (bool, np.bool_)) else "number"
             for u in np.asarray(user_ids, dtype=object).ravel()}
    if len(kinds) > 1:
        raise ValueError(f"`user_ids` mix {' and '.join(sorted(kinds))} ids: converted to "
                         "one type they can merge different people (1 and '1') into one "
                         "user. Give every id the same type.")


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


def sync_release_count(layer: ReleaseLayer) -> int:
    """The larger of ``layer.num_releases`` and its ``releases`` weight, written
    to both: a count copied with the weights (``set_weights``, a legacy ``.h5``)
    or kept by the layer is never lowered by the other."""
    count = layer.releases_made()
    if layer.releases is not None:
        layer.releases.assign(count)
    layer.num_releases = count
    return count


class ReleaseLayer(keras.layers.Layer):
    """Base of the Keras layers that release statistics of their training data
    (:class:`~keras_dp_lm.data.DPFeatureNormalization`,
    :class:`~keras_dp_lm.data.DPClassMeans`): the constructor's checks, the
    release count saved with the weights, the privacy unit, the noise of each
    release and its ``dp_event``. A subclass names what it releases
    (``released``), calls :meth:`add_release_count` in ``build``,
    :meth:`check_unit` before it reads the data, :meth:`begin_release` to draw
    one release's noise, and :meth:`require_release` at the top of ``call``."""

    _keras_dp_lm_release_layer = True  # what is_release_layer reads (reload-proof)
    noise_multiplier = SetUntilReleased()
    released = "statistics"  # in messages: "<released> released without noise ..."
    noise_stream: int | None = None  # this class's stream of a test seed

    def __init__(self, noise_multiplier: float, seed: int | None = None,
                 num_releases: int = 0, privacy_unit: str = "example",
                 **kwargs: Any) -> None:
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        self.noise_multiplier = check_noise(noise_multiplier)
        if self.noise_multiplier == 0:
            raise ValueError(f"`noise_multiplier` must be > 0: {self.released} released "
                             "without noise is not differentially private.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be an int or None, got {seed!r}.")
        self.seed = seed
        if (isinstance(num_releases, bool) or not isinstance(num_releases, (int, np.integer))
                or num_releases < 0):
            raise ValueError(f"`num_releases` must be an int >= 0, got {num_releases!r}.")
        if privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"`privacy_unit` must be one of {PRIVACY_UNITS}, got "
                             f"{privacy_unit!r}.")
        self.num_releases = int(num_releases)
        self.privacy_unit = privacy_unit
        self._has_release = False  # set by a release or by loading saved weights
        self.releases = None

    def add_release_count(self) -> None:
        """The release count as a weight (call in ``build``): loading weights into
        a fresh layer must not restart it."""
        self.releases = self.add_weight(shape=(), initializer="zeros", dtype="int64",
                                        trainable=False, name="releases")
        self.releases.assign(self.num_releases)

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        super().load_own_variables(store)
        self._has_release = sync_release_count(self) > 0

    def set_weights(self, weights: Sequence[Any]) -> None:
        super().set_weights(weights)
        self._has_release = sync_release_count(self) > 0

    @staticmethod
    def check_features(features: Any) -> np.ndarray:
        """``features`` as a float64 ``[N, d]`` array; refuses an empty, ragged or
        non-finite one."""
        x = np.asarray(features, dtype="float64")
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"`features` must be a non-empty [N, d] array, got shape "
                             f"{x.shape}.")
        if not np.all(np.isfinite(x)):
            raise ValueError("`features` contain NaN or infinite values.")
        return x

    def check_unit(self, user_ids: Any) -> str:
        """The privacy unit of a release with these ``user_ids``; refuses another
        unit than the earlier releases'."""
        unit = "example" if user_ids is None else "user"
        if self.num_releases and unit != self.privacy_unit:
            raise ValueError(f"This layer's earlier releases protected one {self.privacy_unit}"
                             f"; adapt again with the same unit (`user_ids` "
                             f"{'given' if self.privacy_unit == 'user' else 'None'}).")
        return unit

    def begin_release(self, unit: str) -> np.random.Generator:
        """Count one more release (as soon as its noise is drawn) and return the
        generator of its noise."""
        rng = noise_generator(self.seed, sync_release_count(self), self.noise_stream)
        self.num_releases += 1
        self.privacy_unit = unit
        self.releases.assign(self.num_releases)
        self._has_release = True
        return rng

    def require_release(self, hint: str) -> None:
        """Note this call for the DP step (:func:`recording_release_calls`) and
        refuse a layer that has released nothing yet."""
        note_release_call(self)
        if not self._has_release:
            raise ValueError(f"{type(self).__name__} has no {hint} yet: call `adapt` on "
                             "the training data first (or load saved weights).")

    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of every release (the planned one before
        the first ``adapt``): ``GaussianDpEvent(noise_multiplier /
        release_sensitivity())`` per release. Copying released weights into
        another layer (a warm start) is this release too: count this event
        wherever they go."""
        one = dp_accounting.GaussianDpEvent(self.noise_multiplier / release_sensitivity())
        count = max(self.releases_made(), 1)
        return one if count == 1 else dp_accounting.ComposedDpEvent([one] * count)

    def releases_made(self) -> int:
        """The releases made so far: the larger of ``num_releases`` and the
        ``releases`` weight (a count restored into the weights by any path counts,
        read without writing anything)."""
        if self.releases is None:
            return int(self.num_releases)
        return max(int(self.num_releases), int(self.releases.numpy()))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(noise_multiplier=self.noise_multiplier, seed=self.seed,
                      num_releases=self.num_releases, privacy_unit=self.privacy_unit)
        return config
