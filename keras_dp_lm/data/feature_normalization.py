"""``DPFeatureNormalization``: centre and rescale frozen features with a DP mean.

A linear head trained with DP on frozen encoder features (a probe) learns
more from the same privacy budget when the features are centred and share
one norm (Tramer & Boneh 2021, Mehta et al. 2023 normalise features before a
DP linear model): every example's clipped gradient then carries its own
direction instead of the encoder's common one, and no example's gradient is
cut more than another's. Centring needs the mean of the private features,
so the mean is released with the Gaussian mechanism and counted
(:meth:`DPFeatureNormalization.dp_event`).

The release and its guarantee (add/remove one privacy unit, the package's one
adjacency). ``adapt`` releases two noised statistics of the private rows and
nothing else: the sum ``S`` of their unit vectors plus ``N(0, sigma^2 I)``,
and their number ``n`` plus ``N(0, (k sigma)^2)`` with
``k = COUNT_NOISE_SCALE``. Adding or removing one unit moves ``S`` by one
vector of norm at most 1 and ``n`` by exactly 1, so the pair ``(S, n / k)``,
noised with std ``sigma`` on every coordinate, is one Gaussian mechanism of L2
sensitivity ``sqrt(1 + 1 / k^2)``: ``GaussianDpEvent(sigma / sqrt(1 + 1 /
k^2))``. The mean is ``noisy S / max(noisy n, 1)``, post-processing of the
release: no divisor is computed from the private data. (Dividing the noised
sum by the true ``n`` instead would move the released mean by up to twice the
sum's sensitivity under add/remove, and its noise scale with the data too.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_dp_lm.data.releases import COUNT_NOISE_SCALE
from keras_dp_lm.data.releases import ReleaseLayer
from keras_dp_lm.data.releases import user_index

if TYPE_CHECKING:
    import tensorflow as tf
    from numpy.typing import ArrayLike

# The norm the head rule of keras_dp_lm.recipes (rate 2 / steps) was tuned for:
# all-MiniLM-L6-v2's mean-pooled features have norms of 3.7-3.8 on the utility
# suite's tasks.
HEAD_FEATURE_NORM = 4.0
# Noise std on the sum of unit vectors (sensitivity 1): the released mean's noise
# is about 5 / N per coordinate. About epsilon 0.9 alone at delta 1e-6 with the
# count (below), far less once composed with DP-SGD (PLD).
MEAN_NOISE_MULTIPLIER = 5.0


def _unit_rows(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPFeatureNormalization(ReleaseLayer):
    """Centre features on a DP mean, then rescale each to norm ``norm``.

    ``call(x)`` returns ``norm * unit(unit(x) - mean)`` per example (``unit``
    divides a vector by its L2 norm), where ``mean`` is the DP mean of the
    training examples' unit vectors, released once per :meth:`adapt`: the
    sum of the unit vectors plus Gaussian noise of std ``noise_multiplier``
    per coordinate, divided by the number of privacy units plus Gaussian
    noise of std ``COUNT_NOISE_SCALE * noise_multiplier`` (at least 1). The
    pair moves by at most ``sqrt(1 + 1 / COUNT_NOISE_SCALE**2)`` in noise
    units when one unit is added or removed (module docstring), so one
    release is ``GaussianDpEvent(noise_multiplier /
    release_sensitivity())``; nothing divides by the private count itself.
    Each example's output depends on that example and the released mean
    only, so the layer can sit in a model trained with a DP optimizer.
    After ``adapt``, ``released_sum`` and ``released_count`` hold this
    process's last release (not saved).

    Privacy unit: one row of ``features``, or one user with ``user_ids``
    (each user's rows are averaged first, so a user also moves the sum by at
    most 1); :attr:`privacy_unit` keeps it, and ``PrivacyAccountant`` refuses
    to train a model holding this layer with the other unit, or without the
    layer's current :meth:`dp_event` among its ``extra_events``. The
    accountant sees the layer only inside the trained model, as a layer of it
    or of a nested model or custom layer; called where the model cannot list
    it (inside a ``keras.layers.Lambda``, or a global layer called from a
    custom ``call``) it is refused when the DP step is traced. Used as a
    preprocessing step outside the model, pass its event yourself.

    Every ``adapt`` is one more release, counted in ``num_releases`` (saved
    with the layer) and in :meth:`dp_event`; before the first ``adapt`` the
    event describes the one release it will make, so the budget can be
    planned. Pass the event to ``suggest_recipe(extra_events=[...])`` (the
    recipe's accountant then composes it with training) or to
    ``PrivacyAccountant(extra_events=[...])``.

    Args:
        norm: the norm of every output vector. The default suits the head
            rule of :func:`keras_dp_lm.recipes.suggest_recipe`
            (``trainable="head"``), whose rate was tuned on features of norm ~4.
        noise_multiplier: std of the noise on the sum of unit vectors (> 0);
            the count's is ``COUNT_NOISE_SCALE`` times larger.
        seed: seed of the noise (``None``: OS entropy); release ``i`` draws
            from the stream ``(seed, i)``. For tests only: two layers with the
            same seed on neighbouring data draw the same noise, which voids
            the guarantee.
        num_releases, privacy_unit: the releases made so far and their unit
            (restored by ``from_config``; leave them alone).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.data import DPFeatureNormalization
        >>> from keras_dp_lm.recipes import suggest_recipe
        >>> features = np.random.default_rng(0).normal(1.0, 1.0, (2000, 8))
        >>> norm = DPFeatureNormalization(seed=0)
        >>> norm.adapt(features)
        >>> norm.num_releases, round(float(np.linalg.norm(norm(features[:1]))), 3)
        (1, 4.0)
        >>> recipe = suggest_recipe(2000, 3.0, 1e-6, epochs=50, trainable="head",
        ...                         extra_events=[norm.dp_event()])
        >>> recipe.epsilon <= 3.0
        True
        >>> head = keras.Sequential([keras.Input((8,)), norm, keras.layers.Dense(2)])
    """

    released = "a mean"

    def __init__(self, norm: float = HEAD_FEATURE_NORM,
                 noise_multiplier: float = MEAN_NOISE_MULTIPLIER, seed: int | None = None,
                 num_releases: int = 0, privacy_unit: str = "example", **kwargs: Any) -> None:
        super().__init__(noise_multiplier, seed=seed, num_releases=num_releases,
                         privacy_unit=privacy_unit, **kwargs)
        norm = float(norm)
        if not norm > 0:
            raise ValueError(f"`norm` must be > 0, got {norm!r}.")
        self.norm = norm
        self.mean = None
        self.released_sum = self.released_count = None  # the last adapt's release

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.mean = self.add_weight(shape=(int(input_shape[-1]),), initializer="zeros",
                                    trainable=False, name="mean")
        self.add_release_count()

    def adapt(self, features: ArrayLike, user_ids: ArrayLike | None = None) -> None:
        """Release the DP mean of ``features`` (``[N, d]``), one more release.

        ``user_ids`` (``[N]``): the privacy unit is a user; each user's unit
        vectors are averaged first and N is the number of users.
        """
        x = self.check_features(features)
        units = _unit_rows(x)
        unit = self.check_unit(user_ids)
        if user_ids is not None:
            index, per_user = user_index(user_ids, x.shape[0])
            sums = np.zeros((len(per_user), x.shape[1]))
            np.add.at(sums, index, units)
            units = sums / per_user[:, None]
        if not self.built:
            self.build(x.shape)
        elif self.mean.shape[0] != x.shape[1]:
            raise ValueError(f"The layer was built for {self.mean.shape[0]} features, got "
                             f"{x.shape[1]}.")
        rng = self.begin_release(unit)
        noisy_sum = units.sum(0) + rng.normal(0.0, self.noise_multiplier, x.shape[1])
        noisy_count = len(units) + rng.normal(0.0, COUNT_NOISE_SCALE * self.noise_multiplier)
        self.released_sum, self.released_count = noisy_sum, float(noisy_count)
        # Post-processing of the release: the divisor is the noised count.
        self.mean.assign((noisy_sum / max(noisy_count, 1.0)).astype(self.mean.dtype))

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        self.require_release("mean")
        ops = keras.ops
        x = ops.cast(inputs, self.compute_dtype)

        def unit(v):
            return v / ops.maximum(ops.norm(v, axis=-1, keepdims=True), 1e-12)

        mean = ops.cast(self.mean, self.compute_dtype)
        return self.norm * unit(unit(x) - mean)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(norm=self.norm)
        return config
