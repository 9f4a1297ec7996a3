"""The one interface of per-example clipping: its result type, clip factors and errors.

Every engine returns a :class:`ClippedSum`: the sum over the batch of each
example's gradient scaled by ``min(1, C / ||g_i||)`` (no noise, not divided),
the per-example norms and losses. :func:`keras_dp_lm.clipping.clipped_sum`
(:mod:`keras_dp_lm.clipping.dispatch`) picks the engine: exact per-example
gradients (:mod:`keras_dp_lm.clipping.exact`) or per-layer fast rules with
exact fallback (:mod:`keras_dp_lm.clipping.fast`).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class ClippedSum(typing.NamedTuple):
    """Result of per-example clipping (a named tuple).

    Attributes:
        grads: list aligned with the variables: ``sum_i clip(g_i)`` (no noise, not divided).
        norms: ``[B]`` per-example gradient L2 norms before clipping.
        losses: ``[B]`` per-example losses.
        outputs: model outputs of a batched forward pass, or ``None`` when none was made.
        fast_norms: ``[B]`` the part of ``norms`` over the variables fast rules read
            (``None`` from the exact engine).
        exact: bools aligned with the variables, ``True`` where the engine took exact
            per-example gradients (``None`` from the exact engine).
        rounding: ``[B]`` the float32 rounding allowance included in ``norms**2`` (the
            fast engine's norms read from Gram matrices are made upper bounds of the
            norms of the vectors summed); ``None`` from the exact engine.
    """

    grads: list[tf.Tensor]
    norms: tf.Tensor
    losses: tf.Tensor
    outputs: Any = None
    fast_norms: tf.Tensor | None = None
    exact: list[bool] | None = None
    rounding: tf.Tensor | None = None


class UncoveredLayersError(ValueError):
    """Raised by ``method="fast"`` when some trainable variables have no fast rule.

    ``uncovered`` maps a layer description to the list of its variable paths;
    ``reason`` (optional) is a short phrase shown in parentheses in the message.
    """

    def __init__(self, uncovered: Mapping[str, Sequence[str]], reason: str | None = None) -> None:
        self.uncovered = dict(uncovered)
        lines = [f"  {layer}: {', '.join(paths)}"
                 for layer, paths in self.uncovered.items()]
        msg = ("Fast per-example clipping has no rule for these trainable "
               "variables" + (f" ({reason})" if reason else "") + ":\n"
               + "\n".join(lines)
               + "\nUse method='auto' to compute exact (slow) per-example "
               "gradients for just these variables, freeze them "
               "(layer.trainable = False), use covered layers (Dense, "
               "EinsumDense, MultiHeadAttention, Embedding, ReversibleEmbedding, "
               "PositionEmbedding, Conv1D, Conv2D, LayerNormalization, "
               "GroupNormalization, RMS norms, KerasHub MaskedLMHead; LoRA on "
               "Dense, EinsumDense and Embedding), or declare a "
               "rule with keras_dp_lm.clipping.register_clipping_rule.")
        super().__init__(msg)


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN kernels are on (decided at TF import)."""
    return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip() not in ("0", "false", "False")


def clip_factors(norms: tf.Tensor, l2_norm_clip: float | tf.Tensor,
                 slot_mask: tf.Tensor | None = None) -> tf.Tensor:
    """``min(1, C / norm)`` per example, in float32, for ``norms`` (``[B]``
    per-example gradient L2 norms) and ``l2_norm_clip`` (C, the clipping bound).

    1 for a zero gradient; 0 for a non-finite norm, and on padding slots when
    ``slot_mask`` (1 real, 0 padding) is given: with :func:`scale_examples`
    such examples add exactly nothing to the clipped sum.

    Example:
        >>> from keras_dp_lm.clipping import clip_factors
        >>> clip_factors([0.5, 2.0, 4.0, float("nan")], 1.0,
        ...              slot_mask=[1, 1, 0, 1]).numpy().tolist()
        [1.0, 0.5, 0.0, 0.0]
    """
    norms = tf.cast(norms, tf.float32)
    clip = tf.cast(l2_norm_clip, tf.float32)
    # A non-finite norm (a NaN / inf input, label, weight or overflow in one
    # example) gets factor 0: that example is dropped instead of making the
    # whole update NaN, which would reveal it with certainty.
    factors = tf.where(tf.math.is_finite(norms), clip / tf.maximum(norms, clip), 0.0)
    if slot_mask is not None:
        factors = tf.where(tf.cast(slot_mask, tf.float32) > 0, factors, 0.0)
    return factors


def sum_dtype(variable):
    """The dtype a clipped sum of ``variable``'s gradients is kept in: float32
    for 16-bit floating variables (a sum rounded to bfloat16 before the noise
    moves with one example by more than the clip norm, and bfloat16 noise takes
    a few thousand values), else the variable's own dtype.

    Example:
        >>> import keras
        >>> from keras_dp_lm.clipping.interface import sum_dtype
        >>> sum_dtype(keras.Variable(1.0, dtype="bfloat16")).name
        'float32'
    """
    dtype = tf.as_dtype(variable.dtype)
    return tf.float32 if dtype in (tf.bfloat16, tf.float16) else dtype


def scale_examples(per_example: tf.Tensor, factors: tf.Tensor) -> tf.Tensor:
    """``factors[i] * per_example[i]`` (float32), exactly 0 where ``factors[i] == 0``.

    ``0 * nan`` is ``nan``: a dropped example's rows are replaced, not multiplied.

    Example:
        >>> from keras_dp_lm.clipping import scale_examples
        >>> scale_examples([[2.0, float("inf")], [1.0, 3.0]], [0.0, 0.5]).numpy().tolist()
        [[0.0, 0.0], [0.5, 1.5]]
    """
    per_example = tf.cast(per_example, tf.float32)
    factors = tf.reshape(tf.cast(factors, tf.float32),
                         [-1] + [1] * (per_example.shape.rank - 1))
    # A broadcast scalar zero, not zeros_like: grappler would fold a full-size
    # zeros tensor into a constant that stays in memory between steps.
    return tf.where(factors > 0, per_example * factors, tf.zeros([], tf.float32))


def check_examples_per_user(examples_per_user):
    """``examples_per_user`` as a positive int (the rows of one privacy unit)."""
    k = examples_per_user
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"`examples_per_user` must be a positive integer, got {examples_per_user!r}.")
    return k


def sum_user_rows(per_example: tf.Tensor, examples_per_user: int) -> tf.Tensor:
    """``[B, ...] -> [B / k, ...]``: the sum of each user's ``k`` consecutive rows.

    ``per_example``: a ``[B, ...]`` tensor of per-row values; ``examples_per_user``:
    ``k``, a positive int dividing B (1 returns ``per_example`` unchanged). Rows
    ``u * k .. u * k + k - 1`` belong to user ``u`` (the layout of
    :func:`keras_dp_lm.data.poisson_user_batches`).

    Example:
        >>> from keras_dp_lm.clipping import sum_user_rows
        >>> sum_user_rows([[1.0], [2.0], [3.0], [4.0]], 2).numpy().tolist()
        [[3.0], [7.0]]
    """
    per_example = tf.convert_to_tensor(per_example)
    k = check_examples_per_user(examples_per_user)
    if k == 1:
        return per_example
    shape = tf.shape(per_example)
    grouped = tf.reshape(per_example, tf.concat([[-1, k], shape[1:]], 0))
    out = tf.reduce_sum(grouped, axis=1)
    rows = per_example.shape[0]
    out.set_shape([rows // k if rows is not None else None] + per_example.shape[1:])
    return out


def user_slot_mask(slot_mask: tf.Tensor, examples_per_user: int) -> tf.Tensor:
    """``[B] -> [B / k]``: 1 for a user with at least one real slot, else 0.

    ``slot_mask``: ``[B]``, 1 on real slots and 0 on padding; ``examples_per_user``:
    ``k``, the consecutive rows of one user (1 returns the mask as float32).

    Example:
        >>> from keras_dp_lm.clipping import user_slot_mask
        >>> user_slot_mask([1.0, 0.0, 0.0, 0.0], 2).numpy().tolist()
        [1.0, 0.0]
    """
    slot_mask = tf.cast(slot_mask, tf.float32)
    k = check_examples_per_user(examples_per_user)
    if k == 1:
        return slot_mask
    return tf.reduce_max(tf.reshape(slot_mask, [-1, k]), axis=1)


def batch_size_of(data: Any) -> int | tf.Tensor:
    """Leading dimension of the first non-None tensor in the nested structure
    ``data`` (a Python int when static, else a scalar tensor)."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def losses_and_outputs(result):
    """``loss_fn`` may return ``losses`` or ``(losses, model_outputs)``."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    return result, None
