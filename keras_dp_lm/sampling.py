"""Poisson-sampled, fixed-shape batches for DP-SGD.

The DP-SGD privacy analysis (``PoissonSampledDpEvent``) assumes that every
step includes each example independently with probability ``q``. Batches
then have a random size, which XLA/TPU and ``tf.function`` dislike, so
:func:`poisson_batches` pads every batch to a fixed ``max_batch_size`` and
gives the padded slots ``sample_weight = 0``. The DP step multiplies each
per-example loss by its sample weight, so a padded slot has a zero
per-example gradient and changes nothing (as long as the model's loss has no
weight regulariser, whose gradient does not depend on the data).

Two things the user must do:

* Divide by the EXPECTED batch size: the optimizer must not divide by the
  padded size (or by the random real size, which would leak it). Build the
  optimizer with ``expected_batch_size=q * N``.
* Pick ``max_batch_size`` so that more than ``max_batch_size`` examples are
  drawn with negligible probability (:func:`suggest_max_batch_size`,
  :func:`overflow_probability`). On an overflow, ``overflow="raise"`` (default)
  stops training with :class:`PoissonOverflowError`; ``overflow="truncate"``
  keeps a uniformly random subset of ``max_batch_size`` examples. Either way
  the released model satisfies ``(eps, delta + (1 + e^eps) * p)``-DP, where
  ``(eps, delta)`` is the accountant's Poisson guarantee and ``p`` the
  probability of an overflow during the run (the run differs from ideal
  Poisson sampling only on that event, for both neighbouring datasets).
  ``suggest_max_batch_size`` keeps ``p`` below 1e-9 by default.

Example:
    >>> import numpy as np, keras_dp_lm as kdp
    >>> from keras_dp_lm.sampling import poisson_batches, suggest_max_batch_size
    >>> x, y = np.random.rand(1000, 8).astype("float32"), np.zeros(1000, "int32")
    >>> q = 32 / 1000
    >>> cap = suggest_max_batch_size(1000, q, steps=300)
    >>> ds = poisson_batches((x, y), q, max_batch_size=cap, seed=0, num_steps=100)
    >>> xb, yb, wb = next(iter(ds))
    >>> xb.shape[0] == cap, float(wb.numpy().sum()) == float((wb.numpy() > 0).sum())
    (True, True)
    >>> opt = kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
    ...                 expected_batch_size=q * 1000)
"""

import math
import numbers
import warnings

import numpy as np
import tensorflow as tf
from scipy import stats

__all__ = [
    "PoissonOverflowError",
    "iter_poisson_batches",
    "overflow_probability",
    "poisson_batches",
    "suggest_max_batch_size",
]

OVERFLOW_MODES = ("raise", "truncate")


class PoissonOverflowError(RuntimeError):
    """A Poisson draw had more examples than ``max_batch_size``."""


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_rate(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"`sampling_rate` must be in (0, 1], got {value!r}.")
    return float(value)


def overflow_probability(dataset_size, sampling_rate, max_batch_size, steps=1):
    """Probability that at least one of ``steps`` Poisson draws exceeds ``max_batch_size``.

    One draw has ``Binomial(dataset_size, sampling_rate)`` examples; its tail
    ``P(X > max_batch_size)`` comes from ``scipy.stats.binom.sf`` and the
    union over independent steps is ``1 - (1 - p)^steps``.

    Example:
        >>> overflow_probability(60000, 256 / 60000, 340, steps=2000) > 1e-4
        True
        >>> overflow_probability(60000, 256 / 60000, 378, steps=2000) < 1e-9
        True
    """
    dataset_size = _check_int("dataset_size", dataset_size)
    sampling_rate = _check_rate(sampling_rate)
    max_batch_size = _check_int("max_batch_size", max_batch_size)
    steps = _check_int("steps", steps, minimum=0)
    per_step = float(stats.binom.sf(max_batch_size, dataset_size, sampling_rate))
    if per_step <= 0 or steps == 0:
        return 0.0
    if per_step >= 1:
        return 1.0
    return float(-math.expm1(steps * math.log1p(-per_step)))


def suggest_max_batch_size(dataset_size, sampling_rate, steps, max_overflow_probability=1e-9):
    """Smallest ``max_batch_size`` whose overflow probability over ``steps`` draws
    is at most ``max_overflow_probability``.

    Computed for ``dataset_size + 1`` examples, so it also holds for the
    add-one neighbouring dataset of the privacy analysis.

    Example:
        >>> suggest_max_batch_size(60000, 256 / 60000, steps=2000)
        378
    """
    dataset_size = _check_int("dataset_size", dataset_size)
    sampling_rate = _check_rate(sampling_rate)
    steps = _check_int("steps", steps, minimum=0)
    if not 0 < max_overflow_probability < 1:
        raise ValueError("`max_overflow_probability` must be in (0, 1), got "
                         f"{max_overflow_probability!r}.")
    n = dataset_size + 1
    if steps == 0:
        return 1
    per_step = -math.expm1(math.log1p(-max_overflow_probability) / steps)
    size = int(stats.binom.isf(per_step, n, sampling_rate))
    size = max(size - 2, 1)
    while overflow_probability(n, sampling_rate, size, steps) > max_overflow_probability:
        size += 1
    while size > 1 and overflow_probability(n, sampling_rate, size - 1, steps) <= max_overflow_probability:
        size -= 1
    return min(size, n)


def _flatten_examples(data):
    """(structure, leaves, n) of an (x, y[, sample_weight]) tuple of arrays."""
    if isinstance(data, tf.data.Dataset):
        data = _materialize(data)
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError(
            "poisson_batches expects (x, y) or (x, y, sample_weight) (each an "
            "array or a dict/list of arrays), or a tf.data.Dataset of unbatched "
            f"such tuples; got {type(data).__name__}.")
    data = tuple(data)
    leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(data)]
    if not leaves:
        raise ValueError("poisson_batches got no arrays.")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "All arrays must have the same leading (example) dimension; got "
            f"sizes {sorted(s for s in sizes if s is not None)}.")
    return data, leaves, sizes.pop()


def _materialize(dataset):
    elements = list(dataset.as_numpy_iterator())
    if not elements:
        raise ValueError("The dataset is empty.")
    return tf.nest.map_structure(lambda *xs: np.stack(xs), *elements)


def _padding_like(leaf, size):
    shape = (size,) + leaf.shape[1:]
    if leaf.dtype.kind in "biufc":
        return np.zeros(shape, leaf.dtype)
    # strings / objects: repeat the first example (its weight is 0 anyway)
    return np.broadcast_to(leaf[:1], shape).copy()


def iter_poisson_batches(data, sampling_rate, max_batch_size, seed=None,
                         num_steps=None, overflow="raise", rng=None):
    """NumPy generator behind :func:`poisson_batches` (same arguments).

    Yields ``(x, y, sample_weight)`` with leading dimension ``max_batch_size``.

    Example:
        >>> import numpy as np
        >>> batches = iter_poisson_batches((np.arange(10.0), np.zeros(10)), 0.5, 10,
        ...                                seed=1, num_steps=2)
        >>> [b[2].shape for b in batches]
        [(10,), (10,)]
    """
    sampling_rate = _check_rate(sampling_rate)
    max_batch_size = _check_int("max_batch_size", max_batch_size)
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"`overflow` must be one of {OVERFLOW_MODES}, got {overflow!r}.")
    data, leaves, n = _flatten_examples(data)
    if num_steps is None:
        num_steps = math.ceil(1 / sampling_rate)
    num_steps = _check_int("num_steps", num_steps)
    has_weight = len(data) == 3
    if rng is None:
        rng = np.random.default_rng(seed)  # seed=None: OS entropy
    return _generate(data, leaves, n, sampling_rate, max_batch_size, num_steps,
                     overflow, has_weight, rng)


def _generate(data, leaves, n, q, cap, num_steps, overflow, has_weight, rng):
    for _ in range(num_steps):
        count = int(rng.binomial(n, q))
        if count > cap:
            if overflow == "raise":
                raise PoissonOverflowError(
                    f"Poisson sampling drew {count} examples, more than "
                    f"max_batch_size={cap}; truncating would break the privacy "
                    "analysis. Use a larger max_batch_size "
                    "(keras_dp_lm.sampling.suggest_max_batch_size) or "
                    "overflow='truncate' (see the module docstring).")
            count = cap
        # Poisson sampling == a Binomial(n, q) size and a uniform subset of it.
        # (With truncation: a uniform subset of `cap` of the drawn examples.)
        index = np.sort(rng.choice(n, size=count, replace=False))
        out = []
        for leaf in leaves:
            padded = _padding_like(leaf, cap)
            padded[:count] = leaf[index]
            out.append(padded)
        batch = tf.nest.pack_sequence_as(data, out)
        if has_weight:
            x, y, weight = batch
            leaf_weight = np.asarray(weight)
            if leaf_weight.dtype.kind not in "fc":
                weight = leaf_weight.astype("float32")
        else:
            x, y = batch
            weight = np.zeros((cap,), "float32")
            weight[:count] = 1.0
        yield x, y, weight


def poisson_batches(dataset_or_arrays, sampling_rate, max_batch_size, seed=None,
                    num_steps=None, overflow="raise"):
    """A ``tf.data.Dataset`` of Poisson-sampled batches padded to ``max_batch_size``.

    Each step includes every example independently with probability
    ``sampling_rate`` (a ``Binomial(N, q)`` count, then a uniform subset);
    batches are padded to a static ``max_batch_size`` and carry
    ``sample_weight`` 0 on padded slots (or the given sample weights, zeroed on
    padded slots, for per-token weights ``[N, T]``).

    Args:
        dataset_or_arrays: ``(x, y)`` or ``(x, y, sample_weight)``, each an
            array or a nested dict/list of arrays with N rows; or a finite
            ``tf.data.Dataset`` of such unbatched tuples (loaded into memory).
        sampling_rate: q.
        max_batch_size: static batch dimension; see :func:`suggest_max_batch_size`.
        seed: for tests only. ``None`` (default) seeds from OS entropy; a fixed
            seed makes a resumed run repeat the first run's draws.
        num_steps: batches per pass over the dataset object (= ``fit``'s steps
            per epoch); default ``ceil(1 / q)``, one expected epoch. Every pass
            draws fresh batches.
        overflow: ``"raise"`` (default) or ``"truncate"``; see the module docstring.

    The optimizer must divide by ``q * N``: ``DPAdam(..., expected_batch_size=q * N)``;
    tell the accountant ``PrivacyAccountant(..., sampling="poisson")``.

    Example:
        >>> import numpy as np
        >>> ds = poisson_batches((np.ones((100, 3)), np.zeros(100)), 0.1, 30, seed=0,
        ...                      num_steps=5)
        >>> int(ds.cardinality()), tuple(ds.element_spec[0].shape)
        (5, (30, 3))
    """
    sampling_rate = _check_rate(sampling_rate)
    max_batch_size = _check_int("max_batch_size", max_batch_size)
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"`overflow` must be one of {OVERFLOW_MODES}, got {overflow!r}.")
    data, leaves, n = _flatten_examples(dataset_or_arrays)
    if num_steps is None:
        num_steps = math.ceil(1 / sampling_rate)
    num_steps = _check_int("num_steps", num_steps)
    risk = overflow_probability(n, sampling_rate, max_batch_size, num_steps)
    if risk > 1e-6:
        warnings.warn(
            f"max_batch_size={max_batch_size} is exceeded with probability {risk:.2g} "
            f"in {num_steps} Poisson draws (overflow={overflow!r}); "
            "suggest_max_batch_size(...) gives "
            f"{suggest_max_batch_size(n, sampling_rate, num_steps)} for 1e-9.",
            stacklevel=2)
    rng = np.random.default_rng(seed)  # shared by every pass: fresh draws each epoch

    def spec(leaf):
        dtype = tf.string if leaf.dtype.kind in "SUO" else tf.as_dtype(leaf.dtype)
        return tf.TensorSpec((max_batch_size,) + leaf.shape[1:], dtype)

    leaf_specs = tf.nest.pack_sequence_as(data, [spec(leaf) for leaf in leaves])
    if len(data) == 3:
        x_spec, y_spec, w_spec = leaf_specs
        if w_spec.dtype not in (tf.float16, tf.float32, tf.float64):
            w_spec = tf.TensorSpec(w_spec.shape, tf.float32)
    else:
        x_spec, y_spec = leaf_specs
        w_spec = tf.TensorSpec((max_batch_size,), tf.float32)

    def generator():
        return _generate(data, leaves, n, sampling_rate, max_batch_size, num_steps,
                         overflow, len(data) == 3, rng)

    dataset = tf.data.Dataset.from_generator(
        generator, output_signature=(x_spec, y_spec, w_spec))
    return dataset.apply(tf.data.experimental.assert_cardinality(num_steps))
