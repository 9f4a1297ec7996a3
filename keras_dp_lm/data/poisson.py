"""Poisson-sampled, fixed-shape batches for DP-SGD.

The DP-SGD privacy analysis (``PoissonSampledDpEvent``) assumes that every
step includes each example independently with probability ``q``. Batches
then have a random size, which XLA/TPU and ``tf.function`` dislike, so
:func:`poisson_batches` pads every batch, to the next of a few bucket sizes
(default, padded compute <= 1.15x the sampled examples) or to a fixed
``max_batch_size``, and marks which slots are real (:func:`attach_real_slots`). The DP step owns that
mask: padding slots get a loss of exactly zero whatever the loss function or a
KerasHub preprocessor does with ``sample_weight``, so they change nothing.
Each batch also carries its rate ``q``, which the step records in the model's
privacy ledger and checks against the accountant's before the update.

Only the sampling happens in Python: per step the generator draws the
``Binomial(N, q)`` count, the uniform subset and the bucket, and yields just
those indices. The examples are held once as tensors and each batch is a
``tf.gather`` inside ``tf.data``. Raw records (e.g. a list of strings) can be
given with ``preprocessor=`` (e.g. a KerasHub ``CausalLMPreprocessor``): it
runs in ``dataset.map`` on each drawn batch only, so nothing is tokenized
before the first step, and the real-slot mask is attached after it (its own
``sample_weight``, such as a causal LM's ``[B, T]`` padding mask, is kept and
zeroed on padding slots). Batches come out preprocessed, so a KerasHub task
is fitted with ``task.preprocessor = None``::

    preprocessor, lm.preprocessor = lm.preprocessor, None
    cap = suggest_max_batch_size(N, q, steps)
    ds = poisson_batches(records, q, cap, num_steps=steps, preprocessor=preprocessor)
    lm.compile(optimizer=kdp.DPAdam(..., expected_batch_size=q * N), weighted_metrics=[])
    lm.fit(ds, callbacks=[kdp.PrivacyAccountant(delta=..., batches=ds)])
    lm.preprocessor = preprocessor  # for generate() / evaluation

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
    >>> from keras_dp_lm.data import poisson_batches, suggest_max_batch_size
    >>> x, y = np.random.rand(1000, 8).astype("float32"), np.zeros(1000, "int32")
    >>> q = 32 / 1000
    >>> cap = suggest_max_batch_size(1000, q, steps=300)
    >>> ds = poisson_batches((x, y), q, max_batch_size=cap, seed=0, num_steps=100)
    >>> xb, yb, marked = next(iter(ds))
    >>> real, rate, weight = split_real_slots(marked)
    >>> bool(xb.shape[0] <= 1.15 * max(real.numpy().sum(), 11)), weight is None
    (True, True)
    >>> bool(np.all(rate.numpy() == q))  # the rate, once per slot
    True
    >>> opt = kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
    ...                 expected_batch_size=q * 1000)

Raw strings through a KerasHub preprocessor, tokenized per drawn batch:

    >>> import keras_hub
    >>> from keras_dp_lm import testing
    >>> records = [line for line in testing.DEFAULT_TEXT.splitlines() if line] * 40
    >>> preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(
    ...     tokenizer=testing.llama_tokenizer(vocabulary_size=512), sequence_length=16)
    >>> ds = poisson_batches(records, 0.02, 60, seed=0, num_steps=10,
    ...                      preprocessor=preprocessor)
    >>> x, y, marked = next(iter(ds))
    >>> real, rate, weight = split_real_slots(marked)  # weight: the [B, 16] padding mask
    >>> sorted(x), tuple(y.shape) == tuple(weight.shape) == (len(real), 16)
    (['padding_mask', 'token_ids'], True)
    >>> float(weight.numpy()[real.numpy() == 0].sum())  # padding slots weigh nothing
    0.0
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_dp_lm.accounting.overflow import overflow_probability  # noqa: F401 (public here too)
from keras_dp_lm.accounting.overflow import suggest_max_batch_size  # noqa: F401
from keras_dp_lm.data.draws import OVERFLOW_MODES  # noqa: F401
from keras_dp_lm.data.draws import PADDING_MODES  # noqa: F401
from keras_dp_lm.data.draws import PoissonOverflowError  # noqa: F401
from keras_dp_lm.data.draws import _buckets
from keras_dp_lm.data.draws import _check_sampling
from keras_dp_lm.data.draws import _draws
from keras_dp_lm.data.draws import _index_batches
from keras_dp_lm.data.draws import _warn_overflow
from keras_dp_lm.data.draws import padding_buckets  # noqa: F401
from keras_dp_lm.data.real_slots import REAL_SLOTS_KEY  # noqa: F401
from keras_dp_lm.data.real_slots import SAMPLE_WEIGHT_KEY  # noqa: F401
from keras_dp_lm.data.real_slots import SAMPLING_RATE_KEY  # noqa: F401
from keras_dp_lm.data.real_slots import attach_real_slots
from keras_dp_lm.data.real_slots import split_real_slots  # noqa: F401

__all__ = [
    "PADDING_MODES",
    "PoissonOverflowError",
    "attach_real_slots",
    "iter_poisson_batches",
    "overflow_probability",
    "padding_buckets",
    "poisson_batches",
    "split_real_slots",
    "suggest_max_batch_size",
]


def _is_record_list(data):
    """A Python list/tuple of raw records (strings, bytes or numbers), not of arrays."""
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(
        isinstance(r, (str, bytes, numbers.Number, np.generic)) for r in data)


def _flatten_examples(data, raw=False):
    """(structure, leaves, n) of an (x, y[, sample_weight]) tuple of arrays.

    With ``raw`` (a preprocessor is given), ``data`` may also be the raw
    records alone: a list or array of strings (or a dict of arrays), read as
    ``(x,)``; and ``(x,)`` is accepted.
    """
    if isinstance(data, tf.data.Dataset):
        data = _materialize(data)
    if raw and (_is_record_list(data) or not isinstance(data, (tuple, list))):
        data = (data,)
    lengths = (1, 2, 3) if raw else (2, 3)
    if not isinstance(data, (tuple, list)) or len(data) not in lengths:
        raise ValueError(
            "poisson_batches expects (x, y) or (x, y, sample_weight) (each an "
            "array or a dict/list of arrays), or a tf.data.Dataset of unbatched "
            "such tuples; raw records (e.g. a list of strings) need "
            f"`preprocessor=`; got {type(data).__name__}.")
    # a component given as a Python list of records is one array, not a structure
    data = tuple(_as_array(part) if _is_record_list(part) else part for part in data)
    leaves = [_as_array(leaf) for leaf in tf.nest.flatten(data)]
    if not leaves:
        raise ValueError("poisson_batches got no arrays.")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "All arrays must have the same leading (example) dimension; got "
            f"sizes {sorted(s for s in sizes if s is not None)}.")
    return data, leaves, sizes.pop()


def _as_array(leaf):
    if isinstance(leaf, tf.Tensor):
        return leaf.numpy()
    if _is_record_list(leaf) and isinstance(leaf[0], (str, bytes)):
        # object array: memory follows each string's length, not N x the longest
        return np.array(leaf, dtype=object)
    return np.asarray(leaf)


def _materialize(dataset):
    elements = list(dataset.as_numpy_iterator())
    if not elements:
        raise ValueError("The dataset is empty.")
    return tf.nest.map_structure(lambda *xs: np.stack(xs), *elements)



def _padding_like(leaf, size):
    shape = (size,) + leaf.shape[1:]
    if leaf.dtype.kind in "biufc":
        return np.zeros(shape, leaf.dtype)
    # strings / objects: the empty string, a public constant (never a record)
    return np.full(shape, b"" if leaf.dtype.kind == "S" else "", dtype=leaf.dtype)



def iter_poisson_batches(data: Sequence[Any] | np.ndarray | tf.data.Dataset, sampling_rate: float,
                         max_batch_size: int, seed: int | None = None, num_steps: int | None = None,
                         overflow: str = "raise", rng: np.random.Generator | None = None,
                         padding: str = "max",
                         bucket_ratio: float = 1.15) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """NumPy generator behind :func:`poisson_batches` (same arguments).

    ``data``: ``(x, y)`` or ``(x, y, sample_weight)`` arrays with N rows (or a
    finite ``tf.data.Dataset`` of such tuples); ``sampling_rate``: q;
    ``overflow``: ``"raise"`` or ``"truncate"``; ``bucket_ratio``: the bucket
    spacing with ``padding="bucket"``; ``seed`` (None: OS entropy) seeds the
    draws unless ``rng``, a NumPy ``Generator``, is given to draw from;
    ``num_steps``: batches to yield (default ``ceil(1 / q)``). Yields
    ``(x, y, attach_real_slots(sample_weight, real_slots, q))``, padded to
    ``max_batch_size`` (``padding="max"``, the default here) or to a bucket.

    Example:
        >>> import numpy as np
        >>> batches = iter_poisson_batches((np.arange(10.0), np.zeros(10)), 0.5, 10,
        ...                                seed=1, num_steps=2)
        >>> [split_real_slots(b[2])[0].shape for b in batches]
        [(10,), (10,)]
    """
    sampling_rate, max_batch_size, num_steps = _check_sampling(
        sampling_rate, max_batch_size, overflow, num_steps)
    data, leaves, n = _flatten_examples(data)
    has_weight = len(data) == 3
    if rng is None:
        rng = np.random.default_rng(seed)  # seed=None: OS entropy
    buckets = _buckets(padding, n, sampling_rate, max_batch_size, bucket_ratio)
    return _generate(data, leaves, n, sampling_rate, max_batch_size, num_steps,
                     overflow, has_weight, rng, buckets)



def _generate(data, leaves, n, q, cap, num_steps, overflow, has_weight, rng, buckets):
    for index, size in _draws(n, q, cap, num_steps, overflow, rng, buckets):
        count = len(index)
        out = []
        for leaf in leaves:
            padded = _padding_like(leaf, size)
            padded[:count] = leaf[index]
            out.append(padded)
        batch = tf.nest.pack_sequence_as(data, out)
        real = np.zeros((size,), "float32")
        real[:count] = 1.0
        if has_weight:
            x, y, weight = batch
            leaf_weight = np.asarray(weight)
            if leaf_weight.dtype.kind not in "fc":
                weight = leaf_weight.astype("float32")
        else:
            (x, y), weight = batch, None
        yield x, y, attach_real_slots(weight, real, np.float64(q))




def _is_numeric(dtype):
    return not (dtype == tf.string or dtype == tf.variant or dtype == tf.resource)


def _gather_slots(tensors, slots, count):
    """The batch ``tensors[slots]`` with real-slot mask (the first ``count`` slots)."""
    real = tf.range(tf.shape(slots)[0], dtype=tf.int32) < count
    return _gather_masked(tensors, slots, tf.ensure_shape(real, slots.shape))


def _gather_masked(tensors, slots, real):
    """The batch ``tensors[slots]`` and its float32 real-slot mask ``real`` (bool).

    Padding slots hold public constants, never a record: 0 for numbers and the
    empty string for text. (Repeating a record would process it in every
    padded step, not with probability q: its content could then change the
    batch's shape or make the step fail.)
    """
    out = []
    for tensor in tensors:
        batch = tf.gather(tensor, slots)
        if _is_numeric(batch.dtype) or batch.dtype == tf.string:
            batch = tf.where(_rows(real, batch), batch, tf.zeros_like(batch))
        out.append(batch)
    return out, tf.cast(real, tf.float32)


def _rows(mask, like):
    """``mask`` [B] reshaped to broadcast over the rows of ``like``."""
    rank = like.shape.rank
    if rank is not None:
        return tf.reshape(mask, [-1] + [1] * (rank - 1))
    return tf.reshape(mask, tf.concat([[-1], tf.ones([tf.rank(like) - 1], tf.int32)], 0))


def _float_weight(weight):
    if weight is None:
        return None
    weight = tf.convert_to_tensor(weight)
    if not weight.dtype.is_floating:
        weight = tf.cast(weight, tf.float32)
    return weight


def _zero_padding_weight(weight, real):
    """``weight`` with padding rows 0 (the DP step masks them anyway)."""
    if weight is None:
        return None
    return weight * _rows(tf.cast(real, weight.dtype), weight)


def _check_static_rows(structure):
    """Refuse preprocessor outputs whose rows have a data-dependent shape."""
    for leaf in tf.nest.flatten(structure):
        shape = getattr(leaf, "shape", None)
        if shape is not None and shape.rank and not shape[1:].is_fully_defined():
            raise ValueError(
                "poisson_batches: the preprocessor returned a tensor of shape "
                f"{tuple(shape)}: each row's shape must not depend on the batch (a "
                "length padded to the longest drawn record would let one record change "
                "how every other example is normalised). Pad to a fixed length, e.g. "
                "a KerasHub preprocessor's `sequence_length`.")


def _check_rows(structure, size):
    """Assert a preprocessor kept one output row per input row."""
    checks = []
    for leaf in tf.nest.flatten(structure):
        if isinstance(leaf, tf.RaggedTensor):
            rows = leaf.nrows()
        elif isinstance(leaf, tf.Tensor) and leaf.shape.rank != 0:
            rows = tf.shape(leaf)[0]
        else:
            continue
        checks.append(tf.debugging.assert_equal(
            tf.cast(rows, tf.int32), size,
            message="poisson_batches: the preprocessor must return one row per input "
                    "row (row-wise preprocessing), or padding slots would be misplaced"))
    return checks


def poisson_batches(dataset_or_arrays: Sequence[Any] | np.ndarray | tf.data.Dataset,
                    sampling_rate: float, max_batch_size: int, seed: int | None = None,
                    num_steps: int | None = None, overflow: str = "raise", padding: str = "bucket",
                    bucket_ratio: float = 1.15,
                    preprocessor: Callable[..., Any] | None = None) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of Poisson-sampled, padded batches.

    Each step includes every example independently with probability
    ``sampling_rate`` (a ``Binomial(N, q)`` count, then a uniform subset).
    Python only draws the indices; the examples are held as tensors and
    gathered inside ``tf.data`` (``tf.gather``), and a ``preprocessor`` runs
    there too, on the drawn batch only: nothing is tokenized up front.
    With ``padding="bucket"`` (default) a batch is padded to the smallest of
    :func:`padding_buckets` that holds it (padded compute <= ``bucket_ratio``
    x the real one; the batch dimension is then unknown to ``tf.function``,
    which traces once, while XLA compiles once per bucket met); with
    ``padding="max"`` every batch has the static ``max_batch_size``. Which
    bucket a batch lands in is never released. Each element is
    ``(x, y, attach_real_slots(sample_weight, real_slots, q))``: the DP step
    takes the mask of real slots and the rate out of it (the given sample
    weights, if any, per example or per token ``[N, T]``, are passed on to the
    loss). The dataset has attributes ``sampling_rate`` and ``dataset_size``
    for ``PrivacyAccountant(batches=dataset)``.

    Args:
        dataset_or_arrays: ``(x, y)`` or ``(x, y, sample_weight)``, each an
            array or a nested dict/list of arrays with N rows; or a finite
            ``tf.data.Dataset`` of such unbatched tuples (loaded into memory).
            With a ``preprocessor``: the raw records, e.g. a list or 1-D array
            of N strings (or ``(x,)``, ``(x, y)``, ``(x, y, sample_weight)``).
        sampling_rate: q.
        max_batch_size: the largest batch; see :func:`suggest_max_batch_size`.
        seed: for tests only. ``None`` (default) seeds from OS entropy; a fixed
            seed makes a resumed run repeat the first run's draws.
        num_steps: batches per pass over the dataset object (= ``fit``'s steps
            per epoch); default ``ceil(1 / q)``, one expected epoch. Every pass
            draws fresh batches.
        overflow: ``"raise"`` (default) or ``"truncate"``; see the module docstring.
        padding: ``"bucket"`` (default) or ``"max"``.
        bucket_ratio: spacing of the buckets.
        preprocessor: optional callable mapping a padded batch of drawn raw
            examples, ``preprocessor(x)`` (or ``(x, y)``, ``(x, y, sample_weight)``
            as given), to ``(x, y, sample_weight)``, ``(x, y)`` or ``x``, in
            graph mode inside ``dataset.map``, row-wise (one output row per
            input row), e.g. a KerasHub ``CausalLMPreprocessor``. The real-slot
            mask is attached after it, and its ``sample_weight`` (e.g. the
            ``[B, T]`` padding mask) is zeroed on padding slots. Padding slots
            it sees hold the empty string (numeric inputs: zeros). Its outputs
            must have a fixed shape per row (pad to a fixed length). A KerasHub task
            fitted on these batches must have ``task.preprocessor = None``
            (the batches are already preprocessed).

    The optimizer must divide by ``q * N``: ``DPAdam(..., expected_batch_size=q * N)``;
    tell the accountant ``PrivacyAccountant(..., batches=dataset)``.

    Example:
        >>> import numpy as np
        >>> ds = poisson_batches((np.ones((100, 3)), np.zeros(100)), 0.1, 30, seed=0,
        ...                      num_steps=5)
        >>> int(ds.cardinality()), tuple(ds.element_spec[0].shape)
        (5, (None, 3))

        Raw strings, preprocessed only when drawn (``preprocess`` stands in
        for a KerasHub ``CausalLMPreprocessor``; see the module docstring):

        >>> import tensorflow as tf
        >>> records = [f"record {i}" for i in range(1000)]
        >>> def preprocess(text):
        ...     words = tf.strings.split(text).to_tensor("-1", shape=[None, 2])
        ...     number = tf.strings.to_number(words[:, 1], tf.int32)  # padding: ""
        ...     return {"number": number}, number, tf.ones_like(number, tf.float32)
        >>> ds = poisson_batches(records, 0.01, 40, seed=0, num_steps=3,
        ...                      preprocessor=preprocess)
        >>> x, y, marked = next(iter(ds))
        >>> real, rate, weight = split_real_slots(marked)
        >>> n = int(real.numpy().sum())  # about 10 drawn records, padded to a bucket
        >>> len(set(y.numpy()[:n].tolist())) == n, float(rate[0]) == 0.01
        (True, True)
        >>> weight.numpy().tolist() == real.numpy().tolist()  # padding slots weigh 0
        True
    """
    sampling_rate, max_batch_size, num_steps = _check_sampling(
        sampling_rate, max_batch_size, overflow, num_steps)
    if preprocessor is not None and not callable(preprocessor):
        raise ValueError(f"`preprocessor` must be callable, got {preprocessor!r}.")
    data, leaves, n = _flatten_examples(dataset_or_arrays, raw=preprocessor is not None)
    _warn_overflow(n, sampling_rate, max_batch_size, num_steps, overflow)
    rng = np.random.default_rng(seed)  # shared by every pass: fresh draws each epoch
    buckets = _buckets(padding, n, sampling_rate, max_batch_size, bucket_ratio)
    batch_dim = max_batch_size if len(buckets) == 1 else None
    # The examples, held once as tensors: every batch is a tf.gather from them.
    tensors = [tf.constant(leaf) for leaf in leaves]

    def generator():
        return _index_batches(n, sampling_rate, max_batch_size, num_steps, overflow,
                              rng, buckets)

    indices = tf.data.Dataset.from_generator(generator, output_signature=(
        tf.TensorSpec((batch_dim,), tf.int64), tf.TensorSpec((), tf.int32)))
    indices = indices.apply(tf.data.experimental.assert_cardinality(num_steps))
    rate = tf.constant(sampling_rate, tf.float64)

    def gather(slots, count):
        out, real = _gather_slots(tensors, slots, count)
        return _finish_batch(data, out, real, rate, preprocessor)

    dataset = indices.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    # Handed to PrivacyAccountant(batches=dataset): the rate is stated once.
    dataset.sampling_rate, dataset.dataset_size = sampling_rate, n
    # p of the module docstring over num_steps draws; the accountant adds
    # (1 + e^epsilon) p to its delta, p over the updates actually applied.
    dataset.overflow_cap = max_batch_size
    dataset.overflow_probability = overflow_probability(n, sampling_rate, max_batch_size,
                                                        num_steps)
    return dataset


def _finish_batch(data, out, real, rate, preprocessor, examples_per_user=None):
    """``(x, y, marked sample_weight)`` of gathered leaves ``out``: preprocessed
    (row-wise) when a preprocessor is given, padding weights zeroed, the
    real-slot mask (``[U, k]`` for user batches) and rate attached."""
    batch = tf.nest.pack_sequence_as(data, out)
    if preprocessor is None:
        if len(data) == 3:
            x, y, weight = batch
        else:
            (x, y), weight = batch, None
        weight = _float_weight(weight)
    else:
        x, y, weight = _unpack_preprocessed(preprocessor(*batch))
        _check_static_rows((x, y, weight))
        with tf.control_dependencies(_check_rows((x, y, weight), tf.shape(real)[0])):
            real = tf.identity(real)
        weight = _zero_padding_weight(_float_weight(weight), real)
    if examples_per_user is not None:
        real = tf.reshape(real, [-1, examples_per_user])
    return x, y, attach_real_slots(weight, real, rate)


def _unpack_preprocessed(data):
    """``(x, y, sample_weight)`` of a preprocessor's output (``x`` alone allowed)."""
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if len(data) == 1:
        return data[0], None, None
    if len(data) == 2:
        return data[0], data[1], None
    if len(data) == 3:
        return data
    raise ValueError(
        "A preprocessor must return x, (x, y) or (x, y, sample_weight); got a "
        f"tuple of {len(data)}.")
