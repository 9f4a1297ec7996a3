"""``DPClassPriors``: a DP release of the label histogram, and a loss that uses it.

A DP head on unbalanced labels drifts to the majority class: every clipped
example pushes the bias towards its own class with the same force
(``benchmarks/results/imbalanced.md``). Logit adjustment (Menon et al. 2021,
"Long-tail learning via logit adjustment") trains on ``logits + tau * log(prior)``
and predicts with the raw logits, so the head does not have to learn the prior and
its raw logits rank the classes as if they were balanced. The prior comes from
the private labels, so it is released with the Gaussian mechanism and counted
(:meth:`DPClassPriors.dp_event`).

The release and its guarantee (add/remove one privacy unit, the package's one
adjacency). ``release(labels)`` publishes the count vector ``c`` (one entry per
class) plus ``N(0, sigma^2 I)`` and nothing else. Adding or removing one record
changes exactly one entry by exactly 1: L2 sensitivity 1, so one release is
``GaussianDpEvent(sigma)``. With ``user_ids`` the unit is a user: each user's
label histogram is normalised to sum 1 before it is added, and a vector of
non-negative entries summing to 1 has L2 norm at most 1, so the sensitivity is
1 again. The priors are ``max(noised counts, min_count)`` divided by their sum:
post-processing of the release, no divisor computed from the private data.

:class:`LogitAdjustedSparseCategoricalCrossentropy` uses the released priors
only: each example's loss depends on that example's logits and label and on
the (public, released) priors, so per-example independence (and the clipping
bound) is unchanged. Its optional class weights ``min(prior) / prior[y]`` lie in
``(0, 1]``: they only shrink an example's gradient before clipping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dp_accounting
import keras
import numpy as np

from keras_dp_lm.accounting._arguments import check_noise
from keras_dp_lm.data.releases import PRIORS_STREAM
from keras_dp_lm.data.releases import SetUntilReleased
from keras_dp_lm.data.releases import noise_generator
from keras_dp_lm.data.releases import user_index

if TYPE_CHECKING:
    import tensorflow as tf
    from numpy.typing import ArrayLike

# Noise std on each class count (sensitivity 1). About epsilon 0.4 alone at
# delta 1e-6, far less once composed with DP-SGD (PLD); the count of a class with
# 50 examples is then known to about 20%, about 0.2 on log(prior), which logit
# adjustment tolerates (an offset of log(0.1 / 0.9) = -2.2 for a 10% class).
PRIOR_NOISE_MULTIPLIER = 10.0
# The floor of a noised count before normalisation: log(prior) stays finite.
MIN_COUNT = 1.0
PRIVACY_UNITS = ("example", "user")


def release_sensitivity() -> float:
    """L2 sensitivity of the count vector under adding or removing one privacy
    unit (a record, or a user whose histogram is normalised to sum 1)."""
    return 1.0


class DPClassPriors:
    """The label histogram released with Gaussian noise, and priors from it.

    ``release(labels)`` adds ``N(0, noise_multiplier^2)`` to every class count
    (``num_classes`` entries; a record moves one entry by 1, so the L2
    sensitivity is 1) and sets :attr:`priors` to the noised counts floored at
    ``min_count`` and normalised to sum 1 (post-processing). Every ``release``
    is one more Gaussian release, counted in ``num_releases`` and in
    :meth:`dp_event` (``GaussianDpEvent(noise_multiplier)`` per release; before
    the first, the one it will make, so the budget can be planned).

    The priors feed :class:`LogitAdjustedSparseCategoricalCrossentropy`, which
    sits outside the model, where the accountant cannot see it: pass
    :meth:`dp_event` to ``suggest_recipe(extra_events=[...])`` or
    ``PrivacyAccountant(extra_events=[...])`` yourself, and the total then
    includes the release.

    Args:
        num_classes: the number of classes (public: the label set is not
            derived from the data). Labels outside ``[0, num_classes)`` are
            refused.
        noise_multiplier: std of the noise on each count (> 0).
        min_count: floor of a noised count before normalising (> 0).
        seed: seed of the noise (``None``: OS entropy); release ``i`` draws from
            ``(seed, i)``. For tests only: two objects with one seed on
            neighbouring data draw the same noise, which voids the guarantee.

    Attributes:
        released_counts: the last release's noised count vector.
        priors: the priors from it (``None`` before the first release).
        privacy_unit: ``"example"`` or ``"user"`` (every release uses one).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.data import DPClassPriors
        >>> from keras_dp_lm.data import LogitAdjustedSparseCategoricalCrossentropy
        >>> from keras_dp_lm.recipes import suggest_recipe
        >>> rng = np.random.default_rng(0)
        >>> y = (rng.uniform(size=2000) < 0.1).astype("int32")   # a 10% class
        >>> x = (rng.normal(size=(2000, 8)) + y[:, None]).astype("float32")
        >>> priors = DPClassPriors(num_classes=2, seed=0)
        >>> p = priors.release(y)
        >>> bool(0.05 < p[1] < 0.15)
        True
        >>> recipe = suggest_recipe(2000, 3.0, 1e-6, epochs=5, trainable="head",
        ...                         extra_events=[priors.dp_event()])
        >>> recipe.epsilon <= 3.0
        True
        >>> head = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        >>> head.compile(optimizer=recipe.optimizer(seed=0),
        ...              loss=LogitAdjustedSparseCategoricalCrossentropy(priors))
        >>> batches = recipe.poisson_batches((x, y), seed=0)
        >>> accountant = recipe.accountant(batches=batches, verbose=0)
        >>> _ = head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
        >>> bool(accountant.report()["total_epsilon"] <= 3.0)
        True
    """

    noise_multiplier = SetUntilReleased()

    def __init__(self, num_classes: int, noise_multiplier: float = PRIOR_NOISE_MULTIPLIER,
                 min_count: float = MIN_COUNT, seed: int | None = None) -> None:
        if (isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer))
                or num_classes < 2):
            raise ValueError(f"`num_classes` must be an int >= 2, got {num_classes!r}.")
        self.num_classes = int(num_classes)
        self.noise_multiplier = check_noise(noise_multiplier)
        if self.noise_multiplier == 0:
            raise ValueError("`noise_multiplier` must be > 0: counts released without "
                             "noise are not differentially private.")
        min_count = float(min_count)
        if not (np.isfinite(min_count) and min_count > 0):
            raise ValueError(f"`min_count` must be a finite number > 0, got {min_count!r}.")
        self.min_count = min_count
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be an int or None, got {seed!r}.")
        self.seed = seed
        self.num_releases = 0
        self.privacy_unit = None
        self.released_counts = None
        self.priors = None

    def _histogram(self, labels, user_ids):
        y = np.asarray(labels)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1 or y.shape[0] == 0:
            raise ValueError(f"`labels` must be a non-empty [N] array of class ids, got "
                             f"shape {y.shape}.")
        if not np.issubdtype(y.dtype, np.integer):
            if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
                raise ValueError("`labels` must be integer class ids.")
            y = y.astype("int64")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"`labels` must lie in [0, {self.num_classes}) (num_classes="
                             f"{self.num_classes}).")
        if user_ids is None:
            return np.bincount(y, minlength=self.num_classes).astype("float64")
        index, per_user = user_index(user_ids, len(y))
        counts = np.zeros(self.num_classes)
        # each user's histogram sums to 1 (L1 1, hence L2 <= 1)
        np.add.at(counts, y, 1.0 / per_user[index])
        return counts

    def release(self, labels: ArrayLike, user_ids: ArrayLike | None = None) -> np.ndarray:
        """Release the noised histogram of ``labels`` (``[N]`` class ids) and
        return the priors (one more release). ``user_ids`` (``[N]``): the privacy
        unit is a user, whose label histogram counts with total weight 1."""
        unit = "example" if user_ids is None else "user"
        if self.num_releases and unit != self.privacy_unit:
            raise ValueError(f"The earlier releases protected one {self.privacy_unit}; "
                             f"release again with the same unit (`user_ids` "
                             f"{'given' if self.privacy_unit == 'user' else 'None'}).")
        counts = self._histogram(labels, user_ids)
        rng = noise_generator(self.seed, self.num_releases, PRIORS_STREAM)
        self.num_releases += 1  # counted as soon as the noise is drawn
        self.privacy_unit = unit
        self.released_counts = counts + rng.normal(0.0, self.noise_multiplier,
                                                   self.num_classes)
        # Post-processing of the release only.
        floored = np.maximum(self.released_counts, self.min_count)
        self.priors = floored / floored.sum()
        _RELEASED[_as_priors(self.priors).tobytes()] = (self.noise_multiplier,
                                                        self.num_releases, unit)
        return self.priors.copy()

    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of every release (the planned one before the
        first): ``GaussianDpEvent(noise_multiplier / release_sensitivity())`` each."""
        return _releases_event(self.noise_multiplier, max(self.num_releases, 1))

    def released_priors(self) -> np.ndarray:
        """The priors of the last ``release`` (a copy). Priors set by hand (not the
        output of a release) are refused: a choice made from them would be a
        release of the labels that no budget counts."""
        priors = self._require_priors()
        if self.num_releases == 0 or _as_priors(priors).tobytes() not in _RELEASED:
            raise ValueError("DPClassPriors.priors was not made by `release(labels)` (it was "
                             "set by hand): release the counts with `release(labels)` and "
                             "count `dp_event()` in the budget.")
        return np.array(priors, dtype="float64")

    def class_weights(self) -> np.ndarray:
        """``min(priors) / priors``: weight 1 for the rarest class, in ``(0, 1]``."""
        return _class_weights(self._require_priors())

    def _require_priors(self):
        if self.priors is None:
            raise ValueError("DPClassPriors has no priors yet: call `release(labels)` on "
                             "the training labels first.")
        return self.priors


def _release_of(priors, vector):
    """``(noise multiplier, releases, privacy unit)`` of the release ``vector``
    (normalised priors) came from, or None. A vector within ``RELEASE_MATCH_ATOL``
    of a released one (cast to float32, rounded) is taken as that release: counting
    a release that public priors happen to resemble over-counts, taking released
    priors as public would under-count."""
    if isinstance(priors, DPClassPriors):
        return (priors.noise_multiplier, max(priors.num_releases, 1), priors.privacy_unit)
    exact = _RELEASED.get(vector.tobytes())
    if exact is not None:
        return exact
    near = [release for key, release in _RELEASED.items()
            if len(key) == vector.nbytes and np.max(np.abs(
                np.frombuffer(key, dtype="float64") - vector)) <= RELEASE_MATCH_ATOL]
    return near[-1] if near else None


def _releases_event(noise_multiplier, count):
    """The event of ``count`` histogram releases at ``noise_multiplier``."""
    one = dp_accounting.GaussianDpEvent(noise_multiplier / release_sensitivity())
    return one if count == 1 else dp_accounting.ComposedDpEvent([one] * count)


def _class_weights(priors):
    return np.min(priors) / priors


# The priors vectors released so far, by value -> (noise multiplier, releases up to
# and including that one, privacy unit): a loss given one as a plain vector
# (``priors.priors``, or ``release``'s return, also once the DPClassPriors object is
# gone, or either cast to float32 or rounded) carries its release.
_RELEASED = {}
# Largest coordinate difference at which a plain vector is taken as a released one.
RELEASE_MATCH_ATOL = 1e-3


def _as_priors(priors):
    if isinstance(priors, DPClassPriors):
        priors = priors._require_priors()
    p = np.asarray(priors, dtype="float64")
    if p.ndim != 1 or p.shape[0] < 2 or not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError(f"`priors` must be a vector of at least 2 positive numbers (a "
                         f"released `DPClassPriors` or its `priors`), got {priors!r}.")
    return p / p.sum()


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class LogitAdjustedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Cross-entropy on ``logits + tau * log(priors)``, optionally class-weighted.

    Train with this loss and predict with the model's raw logits (Menon et al.
    2021): the head no longer has to learn the prior, and argmax of the raw
    logits approximates the balanced-error decision. ``class_weighting=True``
    also multiplies each example's loss by ``min(priors) / priors[y]`` (in
    ``(0, 1]``: the rarest class keeps weight 1). Each example's value depends on
    its own logits and label and on ``priors`` only, so a DP optimizer's
    per-example clipping bound holds as for the plain cross-entropy.

    Args:
        priors: released priors: a :class:`DPClassPriors` after ``release`` or
            its ``priors`` vector (recognised by value, also cast to float32 or
            rounded to 3 decimals: it still carries its release), or public
            priors. Never priors counted on the private
            labels without noise: they would be an unaccounted release.
        tau: the adjustment's scale (``0``: the plain cross-entropy).
        class_weighting: multiply each example's loss by its class weight.
        from_logits: must be ``True`` (the adjustment is on logits).
        reduction, name, dtype: as for any ``keras.losses.Loss``.

    Example:
        >>> import numpy as np
        >>> loss = LogitAdjustedSparseCategoricalCrossentropy([0.9, 0.1], tau=1.0)
        >>> logits = np.zeros((2, 2), "float32")
        >>> # with equal raw logits, the adjusted logits favour the 90% class
        >>> round(float(loss(np.array([0]), logits[:1])), 4)
        0.1054
        >>> round(float(loss(np.array([1]), logits[1:])), 4)
        2.3026
    """

    def __init__(self, priors: DPClassPriors | ArrayLike, tau: float = 1.0,
                 class_weighting: bool = False, from_logits: bool = True,
                 reduction: str | None = "sum_over_batch_size",
                 name: str = "logit_adjusted_sparse_categorical_crossentropy",
                 dtype: str | None = None) -> None:
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if not from_logits:
            raise ValueError("LogitAdjustedSparseCategoricalCrossentropy adjusts logits: "
                             "use a model that outputs logits and `from_logits=True`.")
        tau = float(tau)
        if not np.isfinite(tau) or tau < 0:
            raise ValueError(f"`tau` must be a finite number >= 0, got {tau!r}.")
        self.priors = _as_priors(priors)
        # The release these priors came from, which the PrivacyAccountant requires
        # among its extra_events (a plain vector is taken as public priors unless
        # it is a released one, exactly or within RELEASE_MATCH_ATOL).
        # It is saved with the loss (get_config), so a reloaded model still needs it.
        self._release = _release_of(priors, self.priors)
        self.tau = tau
        self.class_weighting = bool(class_weighting)
        self.from_logits = True

    @property
    def release_event(self) -> dp_accounting.DpEvent | None:
        """The ``dp_accounting`` event of the release the priors came from, or
        None for priors given as a vector that no release made (taken as
        public)."""
        return None if self._release is None else _releases_event(*self._release[:2])

    @property
    def release_unit(self) -> str | None:
        """The privacy unit of that release (``"example"`` or ``"user"``), None
        for public priors or priors not released yet."""
        return None if self._release is None else self._release[2]

    def call(self, y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        ops = keras.ops
        logits = ops.convert_to_tensor(y_pred)
        if logits.shape[-1] is not None and logits.shape[-1] != len(self.priors):
            raise ValueError(
                f"The model outputs {logits.shape[-1]} logits per example but the priors "
                f"have {len(self.priors)} classes: give the head one output per class "
                f"(e.g. keras.layers.Dense({len(self.priors)})), or release the priors "
                f"with DPClassPriors(num_classes={logits.shape[-1]}).")
        offset = ops.convert_to_tensor(self.tau * np.log(self.priors), dtype=logits.dtype)
        labels = ops.cast(y_true, "int32")
        if len(labels.shape) == len(logits.shape):
            labels = ops.squeeze(labels, axis=-1)
        values = keras.losses.sparse_categorical_crossentropy(
            labels, logits + offset, from_logits=True)
        if self.class_weighting:
            weights = ops.convert_to_tensor(_class_weights(self.priors), dtype=values.dtype)
            values = values * ops.take(weights, labels)
        return values

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(priors=[float(p) for p in self.priors], tau=self.tau,
                      class_weighting=self.class_weighting, from_logits=True)
        if self._release is not None:
            config["release"] = {"noise_multiplier": self._release[0],
                                 "releases": self._release[1],
                                 "privacy_unit": self._release[2]}
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LogitAdjustedSparseCategoricalCrossentropy:
        config = dict(config)
        release = config.pop("release", None)
        loss = cls(**config)
        if release is not None:
            # A config saved before the unit was recorded: taken as example-level,
            # which user-level training refuses (the safe reading).
            loss._release = (float(release["noise_multiplier"]), int(release["releases"]),
                             release.get("privacy_unit", "example"))
        return loss


__all__ = ["DPClassPriors", "LogitAdjustedSparseCategoricalCrossentropy",
           "PRIOR_NOISE_MULTIPLIER", "release_sensitivity"]
