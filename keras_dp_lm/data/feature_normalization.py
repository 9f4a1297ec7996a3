"""``DPFeatureNormalization``: centre and rescale frozen features with a DP mean.

A linear head trained with DP on frozen encoder features (a probe) learns
more from the same privacy budget when the features are centred and share
one norm (Tramer & Boneh 2021, Mehta et al. 2023 normalise features before a
DP linear model): every example's clipped gradient then carries its own
direction instead of the encoder's common one, and no example's gradient is
cut more than another's. Centring needs the mean of the private features,
so the mean is released with the Gaussian mechanism and counted
(:meth:`DPFeatureNormalization.dp_event`).
"""

import dp_accounting
import keras
import numpy as np

from keras_dp_lm.accounting._arguments import check_noise

# The norm the head rule of keras_dp_lm.recipes (rate 2 / steps) was tuned for:
# all-MiniLM-L6-v2's mean-pooled features have norms of 3.7-3.8 on the utility
# suite's tasks.
HEAD_FEATURE_NORM = 4.0
# Noise multiplier of the mean: sensitivity 1 (one example's unit vector), so the
# released mean's noise is 5 / N per coordinate; about epsilon 1 alone at delta
# 1e-6, far less once composed with DP-SGD (PLD).
MEAN_NOISE_MULTIPLIER = 5.0
PRIVACY_UNITS = ("example", "user")


def _unit_rows(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPFeatureNormalization(keras.layers.Layer):
    """Centre features on a DP mean, then rescale each to norm ``norm``.

    ``call(x)`` returns ``norm * unit(unit(x) - mean)`` per example (``unit``
    divides a vector by its L2 norm), where ``mean`` is the DP mean of the
    training examples' unit vectors, released once per :meth:`adapt`:
    the sum of the unit vectors (L2 sensitivity 1 under adding or removing
    one example) plus Gaussian noise of std ``noise_multiplier`` per
    coordinate, divided by the number of privacy units N (public, as the
    dataset size is everywhere in keras_dp_lm). Each example's output
    depends on that example and the released mean only, so the layer can sit
    in a model trained with a DP optimizer.

    Privacy unit: one row of ``features``, or one user with ``user_ids``
    (each user's rows are averaged first, so a user also moves the sum by at
    most 1); :attr:`privacy_unit` keeps it, and ``PrivacyAccountant`` refuses
    to train a model holding this layer with the other unit, or without the
    layer's current :meth:`dp_event` among its ``extra_events``. The
    accountant sees the layer only inside the trained model: used as a
    preprocessing step outside it, pass its event yourself. Releasing the
    mean also releases N.

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
        noise_multiplier: std of the noise on the sum of unit vectors (> 0).
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

    def __init__(self, norm=HEAD_FEATURE_NORM, noise_multiplier=MEAN_NOISE_MULTIPLIER,
                 seed=None, num_releases=0, privacy_unit="example", **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        norm = float(norm)
        if not norm > 0:
            raise ValueError(f"`norm` must be > 0, got {norm!r}.")
        self.norm = norm
        self.noise_multiplier = check_noise(noise_multiplier)
        if self.noise_multiplier == 0:
            raise ValueError("`noise_multiplier` must be > 0: a mean released without "
                             "noise is not differentially private.")
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
        self._has_mean = False  # set by adapt or by loading saved weights
        self.mean = None

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(int(input_shape[-1]),), initializer="zeros",
                                    trainable=False, name="mean")
        # The release count travels with the weights too (load_weights into a
        # fresh layer must not restart it).
        self.releases = self.add_weight(shape=(), initializer="zeros", dtype="int64",
                                        trainable=False, name="releases")
        self.releases.assign(self.num_releases)

    def load_own_variables(self, store):
        super().load_own_variables(store)
        self.num_releases = max(self.num_releases, int(self.releases.numpy()))
        self._has_mean = self.num_releases > 0

    def adapt(self, features, user_ids=None):
        """Release the DP mean of ``features`` (``[N, d]``), one more release.

        ``user_ids`` (``[N]``): the privacy unit is a user; each user's unit
        vectors are averaged first and N is the number of users.
        """
        x = np.asarray(features, dtype="float64")
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"`features` must be a non-empty [N, d] array, got shape "
                             f"{x.shape}.")
        if not np.all(np.isfinite(x)):
            raise ValueError("`features` contain NaN or infinite values.")
        units = _unit_rows(x)
        unit = "example" if user_ids is None else "user"
        if self.num_releases and unit != self.privacy_unit:
            raise ValueError(f"This layer's earlier releases protected one {self.privacy_unit}"
                             f"; adapt again with the same unit (`user_ids` "
                             f"{'given' if self.privacy_unit == 'user' else 'None'}).")
        if user_ids is not None:
            users = np.asarray(user_ids)
            if users.shape != (x.shape[0],):
                raise ValueError(f"`user_ids` must have shape ({x.shape[0]},), got "
                                 f"{users.shape}.")
            _, index, per_user = np.unique(users, return_inverse=True, return_counts=True)
            sums = np.zeros((len(per_user), x.shape[1]))
            np.add.at(sums, index, units)
            units = sums / per_user[:, None]
        if not self.built:
            self.build(x.shape)
        elif self.mean.shape[0] != x.shape[1]:
            raise ValueError(f"The layer was built for {self.mean.shape[0]} features, got "
                             f"{x.shape[1]}.")
        rng = np.random.default_rng(self._release_seed(self.num_releases))
        self.num_releases += 1  # counted as soon as the noise is drawn
        self.privacy_unit = unit
        self.releases.assign(self.num_releases)
        noisy_sum = units.sum(0) + rng.normal(0.0, self.noise_multiplier, x.shape[1])
        self.mean.assign((noisy_sum / len(units)).astype(self.mean.dtype))
        self._has_mean = True

    def _release_seed(self, index):
        if self.seed is None:
            return None
        return np.random.SeedSequence(self.seed, spawn_key=(index,))

    def call(self, inputs):
        if not self._has_mean:
            raise ValueError("DPFeatureNormalization has no mean yet: call `adapt(features)` "
                             "on the training features first (or load saved weights).")
        ops = keras.ops
        x = ops.cast(inputs, self.compute_dtype)

        def unit(v):
            return v / ops.maximum(ops.norm(v, axis=-1, keepdims=True), 1e-12)

        mean = ops.cast(self.mean, self.compute_dtype)
        return self.norm * unit(unit(x) - mean)

    def compute_output_shape(self, input_shape):
        return input_shape

    def dp_event(self):
        """The ``dp_accounting`` event of every release (the planned one before
        the first ``adapt``): ``GaussianDpEvent(noise_multiplier)`` per release."""
        one = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        count = max(self.num_releases, 1)
        return one if count == 1 else dp_accounting.ComposedDpEvent([one] * count)

    def get_config(self):
        config = super().get_config()
        config.update(norm=self.norm, noise_multiplier=self.noise_multiplier,
                      seed=self.seed, num_releases=self.num_releases,
                      privacy_unit=self.privacy_unit)
        return config
