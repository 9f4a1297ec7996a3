"""``DPClassMeans``: a classification head made of DP class means, not trained.

A linear head trained with DP-SGD on a few hundred examples spends most of its
budget on noise, and a class with 50-100 examples barely moves it: on the
utility benchmarks the trained head stayed 4-8 points of balanced accuracy
below the non-private probe at epsilon 8 on such tasks
(``benchmarks/results/balanced_heads.md``). A nearest-class-mean classifier
needs one release instead of hundreds of noised steps: the per-class sums and
counts of the (normalised) features, from which every class mean follows
(post-processing). On frozen sentence features it is a strong classifier on
its own (Snell et al. 2017's prototypes; Mensink et al. 2013), and it predicts
as if the classes were equally frequent, which is what balanced accuracy asks.

The release and its guarantee (add/remove one privacy unit). Every input row
is first scaled to norm at most ``max_norm`` and divided by ``max_norm``
(``u = x / max(||x||, max_norm)``, so ``||u|| <= 1`` whatever the input), then
``adapt`` releases, for every class ``c``, ``S_c = sum of u over the class``
plus ``N(0, sigma^2 I)`` and ``n_c = the class's count`` plus
``N(0, (k sigma)^2)`` with ``k = COUNT_NOISE_SCALE``. Adding or removing one
row moves one ``S_c`` by at most 1 and one ``n_c`` by exactly 1 (a user with
``user_ids``: each of the user's rows counts with weight ``1 / rows``, so the
user moves the concatenated sums by at most 1 and the counts by at most 1 in
L2 too). All of it is one Gaussian mechanism of L2 sensitivity
``sqrt(1 + 1 / k^2)`` in units of sigma, ``GaussianDpEvent(sigma / sqrt(1 + 1
/ k^2))``, the same as :class:`DPFeatureNormalization`'s release. The head is
computed from the noised values only: ``mu_c = S_c / max(n_c, 1)``, its
squared norm less the noise's expected share ``d sigma^2 / n_c^2`` (so that a
rare class's noisier mean is not pushed away from every input), and one
within-class spread ``(1 - mean of the squared norms) / d`` that sets the
logits' scale. Nothing divides by a private count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dp_accounting
import keras
import numpy as np

from keras_dp_lm.data.feature_normalization import HEAD_FEATURE_NORM
from keras_dp_lm.data.releases import CLASS_MEANS_STREAM
from keras_dp_lm.data.releases import COUNT_NOISE_SCALE
from keras_dp_lm.data.releases import ReleaseLayer
from keras_dp_lm.data.releases import release_sensitivity
from keras_dp_lm.data.releases import user_index

if TYPE_CHECKING:
    import tensorflow as tf
    from numpy.typing import ArrayLike

# Floor of the within-class spread (per coordinate, times d): keeps the logits
# finite when a noised release says the classes have no spread at all.
MIN_SPREAD = 1e-3
# max_norm outside this range is refused: row norms are computed in float64.
MAX_NORM_RANGE = (1e-100, 1e100)


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPClassMeans(ReleaseLayer):
    """A head whose logits come from DP class means (released once, not trained).

    ``adapt(features, labels)`` releases the noised per-class sums and counts of
    the inputs scaled to norm at most ``max_norm`` (module docstring: one
    Gaussian release, :meth:`dp_event`); ``call(x)`` returns one logit per
    class, ``(u . mu_c - q_c / 2) / s`` with ``u = x / max(||x||, max_norm)``,
    ``mu_c`` the released class mean, ``q_c`` its squared norm less the
    noise's expected share and ``s`` the released within-class spread: the
    nearest class mean, as a linear layer. The classes count as equally
    frequent: ``argmax`` maximises balanced accuracy, not accuracy (add the
    log of released priors to the logits for the latter).

    Put it after :class:`DPFeatureNormalization` (whose output norm is the
    default ``max_norm``); the layer is not trained, so the model needs no
    ``fit``: its epsilon is that of the releases, composed
    (:func:`keras_dp_lm.accounting.compose_epsilon`). Pick the noise for a
    total budget with :meth:`for_budget`. A model holding it that is trained
    with a DP optimizer anyway is checked like one holding
    ``DPFeatureNormalization``: the accountant refuses it unless this layer's
    :meth:`dp_event` is among its ``extra_events``.

    Args:
        num_classes: the number of classes (public). Labels outside
            ``[0, num_classes)`` are refused.
        noise_multiplier: std of the noise on every coordinate of the
            (norm <= 1) class sums, > 0; the counts' is ``COUNT_NOISE_SCALE``
            times larger. :meth:`for_budget` picks it for a target epsilon.
            Read-only after the first release.
        max_norm: input rows are scaled down to this norm before they count
            (the release's sensitivity does not depend on the inputs);
            between 1e-100 and 1e100.
        seed: seed of the noise (``None``: OS entropy); release ``i`` draws
            from its own stream of ``seed``, apart from the other release
            classes'. For tests only: two of these layers with one seed draw
            the same noise, which voids the guarantee.
        num_releases, privacy_unit: the releases made so far and their unit
            (restored by ``from_config``; leave them alone).

    Attributes:
        released_sums, released_counts: this process's last release (``[K, d]``
            and ``[K]``, the sums in units of ``max_norm``; not saved).

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm.accounting import compose_epsilon
        >>> from keras_dp_lm.data import DPClassMeans, DPFeatureNormalization
        >>> rng = np.random.default_rng(0)
        >>> labels = (rng.random(2000) < 0.1).astype("int32")       # 10% rare
        >>> features = rng.normal(0.0, 1.0, (2000, 8)) + 1.5 * labels[:, None]
        >>> norm = DPFeatureNormalization()
        >>> norm.adapt(features)
        >>> means = DPClassMeans.for_budget(2, 3.0, 1e-6, extra_events=[norm.dp_event()])
        >>> means.adapt(norm(features), labels)
        >>> head = keras.Sequential([keras.Input((8,)), norm, means])
        >>> predicted = head.predict(features, verbose=0).argmax(-1)
        >>> bool(np.mean(predicted[labels == 1] == 1) > 0.5)       # the rare class
        True
        >>> compose_epsilon([norm.dp_event(), means.dp_event()], 1e-6) <= 3.0
        True
    """

    released = "a set of class means"
    noise_stream = CLASS_MEANS_STREAM

    def __init__(self, num_classes: int, noise_multiplier: float,
                 max_norm: float = HEAD_FEATURE_NORM, seed: int | None = None,
                 num_releases: int = 0, privacy_unit: str = "example",
                 **kwargs: Any) -> None:
        super().__init__(noise_multiplier, seed=seed, num_releases=num_releases,
                         privacy_unit=privacy_unit, **kwargs)
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
                or num_classes < 2:
            raise ValueError(f"`num_classes` must be an int >= 2, got {num_classes!r}.")
        self.num_classes = int(num_classes)
        max_norm = float(max_norm)
        if not MAX_NORM_RANGE[0] <= max_norm <= MAX_NORM_RANGE[1]:
            raise ValueError(f"`max_norm` must lie in [{MAX_NORM_RANGE[0]:g}, "
                             f"{MAX_NORM_RANGE[1]:g}], got {max_norm!r}.")
        self.max_norm = max_norm
        low = [dtype for dtype in (self.dtype_policy.compute_dtype,
                                   self.dtype_policy.variable_dtype)
               if dtype in ("float16", "bfloat16")]
        if low:
            raise ValueError(
                f"DPClassMeans needs float32 or float64: its logits scale with the "
                f"feature size over the class spread (about 1e5 for well separated "
                f"classes), which {low[0]} overflows or rounds away. Construct it with "
                "dtype='float32' (also under a mixed-precision policy).")
        self.kernel = self.bias = None
        self.released_sums = self.released_counts = None

    @classmethod
    def for_budget(cls, num_classes: int, target_epsilon: float, delta: float,
                   extra_events: Sequence[dp_accounting.DpEvent] = (),
                   **kwargs: Any) -> DPClassMeans:
        """A layer whose release, composed with ``extra_events`` (the other
        releases about the same data, e.g. ``[norm.dp_event()]``), spends at
        most ``target_epsilon`` at ``delta``: the smallest such noise within
        0.1%. ``kwargs`` go to the constructor."""
        from keras_dp_lm.accounting import calibrate_noise_multiplier

        sigma = calibrate_noise_multiplier(target_epsilon, delta, sampling_rate=1.0,
                                           steps=1, extra_events=list(extra_events))
        return cls(num_classes, sigma * release_sensitivity(), **kwargs)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        dim = int(input_shape[-1])
        self.kernel = self.add_weight(shape=(dim, self.num_classes), initializer="zeros",
                                      trainable=False, name="kernel")
        self.bias = self.add_weight(shape=(self.num_classes,), initializer="zeros",
                                    trainable=False, name="bias")
        self.add_release_count()

    def adapt(self, features: ArrayLike, labels: ArrayLike,
              user_ids: ArrayLike | None = None) -> None:
        """Release the noised class sums and counts of ``features`` (``[N, d]``)
        under ``labels`` (``[N]`` class ids), one more release, and set the
        head from them. ``user_ids`` (``[N]``): the privacy unit is a user,
        whose rows count with total weight 1."""
        x = self.check_features(features)
        y = np.asarray(labels)
        if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"`labels` must be {x.shape[0]} integer class ids, got "
                             f"shape {y.shape} and dtype {y.dtype}.")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"`labels` must lie in [0, {self.num_classes}), got "
                             f"{int(y.min())}..{int(y.max())}.")
        unit = self.check_unit(user_ids)
        weights = np.ones(len(y))
        if user_ids is not None:
            index, per_user = user_index(user_ids, len(y))
            weights = 1.0 / per_user[index]
        if not self.built:
            self.build(x.shape)
        elif self.kernel.shape[0] != x.shape[1]:
            raise ValueError(f"The layer was built for {self.kernel.shape[0]} features, got "
                             f"{x.shape[1]}.")
        scaled = x / np.maximum(_row_norms(x), self.max_norm)
        # Rounding can leave a row a hair above norm 1: scale it back.
        scaled /= np.maximum(_row_norms(scaled), 1.0)
        sums = np.zeros((self.num_classes, x.shape[1]))
        np.add.at(sums, y, scaled * weights[:, None])
        counts = np.bincount(y, weights=weights, minlength=self.num_classes)
        rng = self.begin_release(unit)
        sigma = self.noise_multiplier
        self.released_sums = sums + rng.normal(0.0, sigma, sums.shape)
        self.released_counts = counts + rng.normal(0.0, COUNT_NOISE_SCALE * sigma,
                                                   self.num_classes)
        kernel, bias = class_mean_logits(self.released_sums, self.released_counts, sigma)
        self.kernel.assign(kernel.astype(self.kernel.dtype))
        self.bias.assign(bias.astype(self.bias.dtype))

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        self.require_release("class means")
        ops = keras.ops
        x = ops.cast(inputs, self.compute_dtype)
        scaled = x / ops.maximum(ops.norm(x, axis=-1, keepdims=True), self.max_norm)
        return ops.matmul(scaled, ops.cast(self.kernel, self.compute_dtype)) + ops.cast(
            self.bias, self.compute_dtype)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape[:-1], self.num_classes)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(num_classes=self.num_classes, max_norm=self.max_norm)
        return config


def _row_norms(x):
    """``[N, 1]`` L2 norms of float64 rows without overflow or underflow (each row
    divided by its largest magnitude first)."""
    peak = np.max(np.abs(x), axis=1, keepdims=True)
    safe = np.where(peak > 0, peak, 1.0)
    return peak * np.linalg.norm(x / safe, axis=1, keepdims=True)


def class_mean_logits(sums: np.ndarray, counts: np.ndarray,
                      noise_multiplier: float) -> tuple[np.ndarray, np.ndarray]:
    """``(kernel [d, K], bias [K])`` of the nearest-class-mean logits from
    noised class ``sums`` (``[K, d]``, rows of norm <= 1 summed) and noised
    ``counts`` (``[K]``) released with noise std ``noise_multiplier`` on the
    sums: post-processing of the release only (module docstring)."""
    dim = sums.shape[1]
    counts = np.maximum(counts, 1.0)
    means = sums / counts[:, None]
    # E||noisy mean||^2 = ||mean||^2 + d sigma^2 / n^2: remove the noise's share.
    squared = np.sum(means ** 2, axis=1) - dim * noise_multiplier ** 2 / counts ** 2
    weights = counts / counts.sum()
    spread = max(1.0 - float(np.sum(weights * np.clip(squared, 0.0, 1.0))), MIN_SPREAD) / dim
    return means.T / spread, -0.5 * squared / spread
