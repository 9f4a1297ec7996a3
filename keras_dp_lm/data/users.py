"""Poisson sampling of USERS, for user-level DP-SGD.

Many private corpora hold several records per person (a patient's notes, a
speaker's lines, a user's messages). Example-level DP protects one record;
a person with fifty records is then protected far less. User-level DP
protects everything one person contributed:

* every step includes each USER independently with probability ``q``
  (:func:`poisson_user_batches`: a ``Binomial(U, q)`` count, then a uniform
  subset of users), and feeds at most ``k = examples_per_user`` of a sampled
  user's records, drawn uniformly from that user's records afresh each step;
* the DP step clips each user's gradient (the mean over the user's real
  records in the batch) to ``C`` as one unit, so adding or removing one user
  with all their records moves the summed gradient by at most ``C``;
* the accountant then counts users: sampling rate ``q``, noise multiplier
  ``sigma``, steps; the reported epsilon is user-level
  (``PrivacyAccountant(batches=dataset)`` reads the user count and rate from
  the dataset).

This is the user-level batch selection of jax-privacy / Charles et al. (2024,
"Fine-tuning large language models with user-level differential privacy",
"ELS/ULS"): here the user-level sampling variant, where the unit that is
sampled and clipped is the user.

Layout: a batch has ``U_b * k`` rows, user ``j`` of the batch in rows
``j*k .. j*k+k-1`` (a user with fewer than ``k`` records fills the rest with
inert padding slots); the real-slot mask is attached with shape ``[U_b, k]``,
which is how the DP step recognises a user batch and learns ``k``. The
number of users ``U_b`` is padded to a few buckets like
:func:`~keras_dp_lm.data.poisson_batches`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from keras_dp_lm.accounting.overflow import overflow_probability
from keras_dp_lm.clipping.interface import check_examples_per_user
from keras_dp_lm.data.draws import _buckets
from keras_dp_lm.data.draws import _check_sampling
from keras_dp_lm.data.draws import _draws
from keras_dp_lm.data.draws import _warn_overflow
from keras_dp_lm.data.poisson import _finish_batch
from keras_dp_lm.data.poisson import _flatten_examples
from keras_dp_lm.data.poisson import _gather_masked
from keras_dp_lm.data.releases import user_index

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


def _user_rows(user_ids, n):
    """``[rows of user 0, rows of user 1, ...]`` (int64 arrays) for ``n`` records."""
    inverse, _ = user_index(user_ids, n)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    return [part.astype(np.int64) for part in np.split(order, bounds)]


def _user_draws(users, q, cap, k, num_steps, overflow, rng, buckets, num_replicas=1):
    """Per step ``(slots [B_b * k] int64, real [B_b * k] bool)``, ``B_b`` the
    bucket rounded up to a multiple of ``num_replicas``.

    The only randomness: a ``Binomial(U, q)`` number of users, a uniform subset
    of them, and for each a uniform subset of at most ``k`` of its records.
    """
    for chosen, size in _draws(len(users), q, cap, num_steps, overflow, rng, buckets,
                               unit=("users", "max_users")):
        size = _round_up(size, num_replicas)
        slots = np.zeros((size * k,), np.int64)
        real = np.zeros((size * k,), bool)
        for j, user in enumerate(chosen):
            rows = users[user]
            if len(rows) > k:
                rows = np.sort(rng.choice(rows, size=k, replace=False))
            slots[j * k:j * k + len(rows)] = rows
            real[j * k:j * k + len(rows)] = True
        yield slots, real


def _round_up(size, multiple):
    return -(-size // multiple) * multiple


def poisson_user_batches(dataset_or_arrays: Sequence[Any] | np.ndarray | tf.data.Dataset,
                         user_ids: ArrayLike, sampling_rate: float, max_users: int,
                         examples_per_user: int, seed: int | None = None,
                         num_steps: int | None = None, overflow: str = "raise",
                         padding: str = "bucket", bucket_ratio: float = 1.15,
                         preprocessor: Callable[..., Any] | None = None,
                         num_replicas: int = 1) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of Poisson-sampled USERS, for user-level DP training.

    Like :func:`~keras_dp_lm.data.poisson_batches`, but the unit sampled (and,
    in the DP step, clipped) is the user: each step includes each user with
    probability ``sampling_rate`` and up to ``examples_per_user`` of its
    records (uniformly drawn each step). See the module docstring for the
    guarantee and the layout.

    Args:
        dataset_or_arrays: the records, as for ``poisson_batches``.
        user_ids: one id per record (any hashable NumPy dtype): the privacy unit.
        sampling_rate: q, the probability that a user is in a step.
        max_users: the most users a batch holds; see
            :func:`~keras_dp_lm.data.suggest_max_batch_size` (called with the
            number of users).
        examples_per_user: k, the most records of one user in one step.
        seed, num_steps, overflow, padding, bucket_ratio, preprocessor: as for
            ``poisson_batches`` (``num_steps`` defaults to ``ceil(1 / q)``).
        num_replicas: under ``tf.distribute``, the strategy's
            ``num_replicas_in_sync``: every batch then holds a multiple of it
            user slots, so that splitting the batch across replicas keeps each
            user's rows together (the DP step refuses a split that does not).

    The optimizer divides by the expected number of USERS:
    ``DPAdam(..., expected_batch_size=q * num_users)``; the accountant reads
    ``dataset.sampling_rate`` and ``dataset.dataset_size`` (the number of
    users): ``PrivacyAccountant(..., batches=dataset)``.

    Example:
        >>> import numpy as np
        >>> from keras_dp_lm.data import poisson_user_batches, split_real_slots
        >>> x, y = np.arange(12.0).reshape(6, 2), np.zeros(6)
        >>> users = np.array(["ann", "ann", "bob", "cy", "cy", "cy"])
        >>> ds = poisson_user_batches((x, y), users, 0.9, max_users=3,
        ...                           examples_per_user=2, seed=0, num_steps=2)
        >>> xb, yb, marked = next(iter(ds))
        >>> real, rate, _ = split_real_slots(marked)
        >>> tuple(real.shape)[1], xb.shape[0] == 2 * real.shape[0], ds.dataset_size
        (2, True, 3)
    """
    sampling_rate, max_users, num_steps = _check_sampling(
        sampling_rate, max_users, overflow, num_steps)
    k = check_examples_per_user(examples_per_user)
    if preprocessor is not None and not callable(preprocessor):
        raise ValueError(f"`preprocessor` must be callable, got {preprocessor!r}.")
    data, leaves, n = _flatten_examples(dataset_or_arrays, raw=preprocessor is not None)
    users = _user_rows(user_ids, n)
    num_users = len(users)
    if max_users > num_users:
        max_users = num_users
    _warn_overflow(num_users, sampling_rate, max_users, num_steps, overflow,
                   unit=("users", "max_users"))
    rng = np.random.default_rng(seed)
    buckets = _buckets(padding, num_users, sampling_rate, max_users, bucket_ratio)
    if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"`num_replicas` must be a positive int, got {num_replicas!r}.")
    rows = _round_up(max_users, num_replicas) * k if len(buckets) == 1 else None
    tensors = [tf.constant(leaf) for leaf in leaves]

    def generator():
        return _user_draws(users, sampling_rate, max_users, k, num_steps, overflow, rng,
                           buckets, num_replicas)

    draws = tf.data.Dataset.from_generator(generator, output_signature=(
        tf.TensorSpec((rows,), tf.int64), tf.TensorSpec((rows,), tf.bool)))
    draws = draws.apply(tf.data.experimental.assert_cardinality(num_steps))
    rate = tf.constant(sampling_rate, tf.float64)

    def gather(slots, real):
        out, mask = _gather_masked(tensors, slots, real)
        return _finish_batch(data, out, mask, rate, preprocessor, examples_per_user=k)

    dataset = draws.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    dataset.sampling_rate, dataset.dataset_size = sampling_rate, num_users
    dataset.examples_per_user, dataset.num_records = k, n
    # p of the module docstring of keras_dp_lm.data.poisson over num_steps draws;
    # the accountant adds (1 + e^epsilon) p to its delta, p over the updates applied.
    dataset.overflow_cap = max_users
    dataset.overflow_probability = overflow_probability(num_users, sampling_rate, max_users,
                                                        num_steps)
    return dataset


def records_per_user(user_ids: ArrayLike) -> np.ndarray:
    """Sorted record counts per user (to choose ``examples_per_user``):
    ``user_ids`` holds one id per record (any hashable, sortable values).

    Example:
        >>> records_per_user(["a", "b", "a", "c", "a"]).tolist()
        [1, 1, 3]
    """
    _, counts = user_index(user_ids, len(user_ids))
    return np.sort(counts)


__all__ = ["poisson_user_batches", "records_per_user"]
