"""Per-example losses derived from a model's compiled loss.

Keras reduces a batch's loss to one scalar, and some of its reductions mix
examples (a padding mask is normalised by the number of valid tokens in the
whole batch). DP-SGD needs one loss per example that depends on that example
alone. The definition used throughout keras_dp_lm: **an example's loss is the
compiled loss evaluated on a batch holding only that example** (weight
regularisation, which depends on no example, is handled separately). :func:`per_example_losses` computes all of them in one
batched pass, and the tests check it against that definition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf
from keras import ops

from keras_dp_lm._keras_internals import Trainer
from keras_dp_lm._keras_internals import call_has_training_arg
from keras_dp_lm._keras_internals import compiled_loss_terms
from keras_dp_lm._keras_internals import get_keras_mask
from keras_dp_lm._keras_internals import squeeze_or_expand_to_same_rank
from keras_dp_lm._keras_internals import standardize_reduction
from keras_dp_lm._keras_internals import tree
from keras_dp_lm.errors import PrivacyRefusalError

if TYPE_CHECKING:
    import keras

_MEAN_REDUCTIONS = ("mean", "sum_over_batch_size")


def _per_example_sum(values):
    rank = len(values.shape)
    if rank <= 1:
        return values
    return ops.sum(values, axis=tuple(range(1, rank)))


def _elements_per_example(values):
    if len(values.shape) <= 1:
        return ops.ones((), dtype=values.dtype)
    shape = ops.shape(values)[1:]
    count = 1
    for dim in shape:
        count = count * dim
    return ops.cast(count, values.dtype)


def reduce_per_example(values: tf.Tensor, sample_weight: tf.Tensor | None = None,
                       mask: tf.Tensor | None = None,
                       reduction: str | None = "sum_over_batch_size") -> tf.Tensor:
    """Reduce elementwise loss values ``[B, ...]`` to ``[B]``, one example at a time.

    Mirrors ``keras.losses.Loss.__call__`` applied to a batch of one example, so a
    mask or a ``mean_with_sample_weight`` reduction normalises by the example's
    own tokens, never by a count taken over the batch. ``sample_weight`` (per
    example or per element, e.g. ``[B, T]``; None: all 1) multiplies the values
    before the reduction, and is the divisor of ``"mean_with_sample_weight"``.
    """
    reduction = standardize_reduction(reduction)
    if reduction in (None, "none"):
        raise PrivacyRefusalError(
            "A DP optimizer needs a scalar loss per example; the compiled loss "
            "has reduction='none'. Use 'sum_over_batch_size' (the default)."
        )
    if mask is None and _normalises_by_length(values, sample_weight, reduction):
        raise PrivacyRefusalError(
            "keras_dp_lm refused the loss: its per-example value is divided by the "
            f"padded length of the batch (values of shape {tuple(values.shape)}, "
            f"reduction={reduction!r}), which is unknown until the batch is built and "
            "depends on the other examples (the longest one sets it): one example "
            "would then rescale every other example's gradient. Pad every batch to a "
            "fixed length (e.g. a preprocessor's `sequence_length`), or use "
            "reduction='mean_with_sample_weight' with the padding mask as sample_weight.")
    if mask is not None:
        mask = ops.cast(mask, values.dtype)
        if reduction in _MEAN_REDUCTIONS:
            total = _elements_per_example(mask)
            valid = _per_example_sum(mask)
            weight = ops.divide_no_nan(total, valid)
            weight = ops.reshape(weight, (-1,) + (1,) * (len(mask.shape) - 1))
            mask = mask * weight
        if sample_weight is not None:
            sample_weight = ops.cast(sample_weight, values.dtype)
            mask, sample_weight = squeeze_or_expand_to_same_rank(mask, sample_weight)
            sample_weight = sample_weight * mask
        else:
            sample_weight = mask
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, values.dtype)
        values, sample_weight = squeeze_or_expand_to_same_rank(values, sample_weight)
        values = values * sample_weight
    summed = _per_example_sum(values)
    if reduction == "sum":
        return summed
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        return ops.divide_no_nan(summed, _per_example_sum(sample_weight))
    return ops.divide_no_nan(summed, _elements_per_example(values))


def _normalises_by_length(values, sample_weight, reduction):
    """True if the per-example value divides by a non-static element count."""
    per_example = values.shape[1:]
    if per_example.is_fully_defined():
        return False
    if reduction in _MEAN_REDUCTIONS:
        return True
    return reduction == "mean_with_sample_weight" and sample_weight is None


def _resolve(path, structure):
    for key in path:
        structure = structure[key]
    return structure


def _compiled_per_example_losses(model, y, y_pred, sample_weight):
    compile_loss = model._compile_loss
    if compile_loss is None:
        raise PrivacyRefusalError(
            "The model was compiled without a loss. A DP optimizer derives "
            "per-example losses from the compiled loss: pass `loss=` to compile()."
        )
    if not compile_loss.built:
        compile_loss.build(y, y_pred)
    nested = tree.is_nested(y_pred) or tree.is_nested(y)
    if nested:
        try:
            tree.assert_same_structure(y_pred, y)
        except (ValueError, TypeError) as error:
            raise PrivacyRefusalError(
                "keras_dp_lm derives per-example losses for multi-output models "
                "only when `y` has exactly the structure of the model's outputs."
            ) from error
    total = None
    for path, loss_fn, loss_weight in compiled_loss_terms(model):
        y_t = _resolve(path, y) if nested else y
        y_p = _resolve(path, y_pred) if nested else y_pred
        if sample_weight is not None and tree.is_nested(sample_weight):
            s_w = _resolve(path, sample_weight)
        else:
            s_w = sample_weight
        in_mask = get_keras_mask(y_p)
        y_p = ops.convert_to_tensor(y_p, dtype=loss_fn.dtype)
        y_t = ops.convert_to_tensor(y_t, dtype=loss_fn.dtype)
        values = loss_fn.call(y_t, y_p)
        _check_per_example(values, y_p, f"The loss {_loss_name(loss_fn)}")
        out_mask = get_keras_mask(values)
        if in_mask is not None and out_mask is not None:
            mask = ops.logical_and(in_mask, out_mask)
        else:
            mask = in_mask if in_mask is not None else out_mask
        value = reduce_per_example(values, s_w, mask, loss_fn.reduction)
        value = ops.cast(value, compile_loss.dtype)
        if loss_weight is not None:
            value = value * loss_weight
        total = value if total is None else total + value
    return total


def _loss_name(loss_fn):
    fn = getattr(loss_fn, "fn", None)
    return repr(getattr(fn, "__name__", None) or type(loss_fn).__name__)


def _batch_dim(tensor):
    tensor = tf.convert_to_tensor(tensor)
    return tensor.shape[0] if tensor.shape.rank else None


def _check_per_example(values, reference, what):
    """Refuse loss values that are not ``[B, ...]`` for a batch of ``B``.

    A loss function that reduces over the batch (``reduce_mean`` over all
    axes) gives every example the same batch-wide value: one example then
    moves every other example's gradient, and clipping bounds nothing.
    """
    values = tf.convert_to_tensor(values)
    batch = _batch_dim(reference)
    fix = (" Return one value per example (or per element with a leading batch "
           "axis): do not reduce over the batch axis inside the loss function (let "
           "the Loss class reduce), or define `compute_per_example_loss(x, y, "
           "y_pred, sample_weight)` on the model returning a [batch] tensor.")
    if values.shape.rank == 0:
        raise PrivacyRefusalError(f"{what} returned a scalar: it reduces over the batch.{fix}")
    if batch is not None and values.shape[0] is not None and values.shape[0] != batch:
        raise PrivacyRefusalError(
            f"{what} returned shape {tuple(values.shape)} for a batch of {batch}: its "
            f"leading axis is not the batch axis.{fix}")
    if batch is None or values.shape[0] is None:
        tf.debugging.assert_equal(
            tf.shape(values)[0], tf.shape(tf.convert_to_tensor(reference))[0],
            message=f"keras_dp_lm refused the loss: {what} must keep the batch axis "
                    f"first.{fix}")


def _data_dependent_losses(model):
    found = []
    for layer in model._flatten_layers(include_self=True):
        if getattr(layer, "_losses", None):
            found.append(layer.name)
    return found


def per_example_losses(model: keras.Model, x: Any, y: Any, y_pred: Any,
                       sample_weight: Any = None) -> tf.Tensor:
    """Return one loss per example, shape ``[B]``.

    Uses ``model.compute_per_example_loss(x, y, y_pred, sample_weight)`` when
    the model defines it (the hook for custom losses), else the compiled loss.
    Weight regularisation is not included (see :func:`regularization_loss`).
    Data-dependent extra losses (activity regularisers, ``add_loss`` on
    activations) would mix examples and are refused.

    Example:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(loss="mse")
        >>> x, y = np.ones((4, 3)), np.zeros((4, 1))
        >>> per_example_losses(model, x, y, model(x)).shape
        TensorShape([4])
    """
    custom = getattr(model, "compute_per_example_loss", None)
    if custom is not None:
        losses = custom(x, y, y_pred, sample_weight)
    else:
        if type(model).compute_loss is not Trainer.compute_loss:
            raise PrivacyRefusalError(
                f"{type(model).__name__} overrides compute_loss(), so keras_dp_lm "
                "cannot tell how each example contributes. Define "
                "`compute_per_example_loss(x, y, y_pred, sample_weight)` returning "
                "a [batch] tensor in which each entry depends on one example only."
            )
        losses = _compiled_per_example_losses(model, y, y_pred, sample_weight)
    if ops.ndim(losses) != 1:
        raise PrivacyRefusalError(
            f"Per-example losses must have shape [batch], got {tuple(losses.shape)}"
            + (" from compute_per_example_loss" if custom is not None else "") + ".")
    reference = tree.flatten(y_pred)[0] if tree.is_nested(y_pred) else y_pred
    _check_per_example(losses, reference, "The per-example loss"
                       + (" (compute_per_example_loss)" if custom is not None else ""))
    offenders = _data_dependent_losses(model)
    if offenders:
        raise PrivacyRefusalError(
            "Layers " + ", ".join(offenders) + " added data-dependent losses "
            "(activity regularizers or add_loss on activations) during the "
            "forward pass. They mix examples and break the per-example "
            "sensitivity bound. Remove them, or fold them into "
            "`compute_per_example_loss`."
        )
    return losses


def regularization_loss(model: keras.Model) -> tf.Tensor | None:
    """Sum of the model's weight-regularisation losses (data independent), or None.

    The DP step differentiates it separately and adds its gradient after the
    noised average: it depends on no example, so it costs no privacy and is
    neither clipped nor noised (as in non-private Keras, where the loss is the
    batch mean plus the regularisation).
    """
    terms = [ops.sum(ops.cast(loss, "float32")) for loss in model.losses]
    if not terms:
        return None
    return ops.sum(ops.stack(terms))


__all__ = ["per_example_losses", "reduce_per_example", "regularization_loss"]


# The DP step's losses: the model called as Keras's train step calls it.

def _model_outputs(model, x, training=True):
    """The model's outputs as Keras's own train (``training=True``) and test
    steps compute them: ``training`` is passed only when ``call`` takes it
    (a subclassed ``call(self, x)`` runs its dropout as Keras's ``fit`` does)."""
    if call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


def _step_losses(model, examples_per_user=1):
    """The DP step's ``loss_fn(((x, y, sample_weight), weights)) -> (losses,
    outputs)``: per-example losses of a training-mode pass, 0 on padding."""
    k = examples_per_user

    def loss_fn(part):
        (px, py, psw), pweight = part
        outputs = _model_outputs(model, px)
        losses = per_example_losses(model, px, py, outputs, psw)
        if k > 1:
            losses = losses * tf.cast(pweight, losses.dtype)
        return tf.where(pweight > 0, losses, tf.zeros_like(losses)), outputs
    return loss_fn


def _probe_losses(model):
    """``(part, training) -> [B]`` per-example losses (the probe's passes): the
    model called as the step calls it (:func:`_model_outputs`)."""
    def losses(part, training):
        px, py, psw = part
        return per_example_losses(model, px, py, _model_outputs(model, px, training), psw)
    return losses
