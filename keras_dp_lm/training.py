"""The DP train step and its binding to models compiled with a DP optimizer.

After ``import keras_dp_lm``, ``model.compile(optimizer=<DP optimizer>, ...)``
binds :func:`dp_train_step` to the model as an instance attribute (Keras looks
the step up as ``self.train_step``), so plain ``model.fit`` trains privately.
The step, per logical batch:

1. splits the batch into ``gradient_accumulation_steps`` micro-batches;
2. per micro-batch, computes per-example losses from the compiled loss
   (:mod:`keras_dp_lm.losses`), per-example gradients, clips each to
   ``l2_norm_clip`` and sums them (:mod:`keras_dp_lm.clipping`);
3. hands the summed clipped gradient to the optimizer, which adds the noise
   once, divides by the logical batch size and applies it.

The loss and metrics shown by ``fit`` are computed on private data and are
**not** differentially private themselves: do not publish them.

Models whose class overrides ``train_step``, layers that mix examples in
training (``BatchNormalization``) and data-dependent losses (activity
regularisers) are refused, because the step could not guarantee the clipping
bound for them.
"""

import functools
import types

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.trainers import trainer as trainer_module
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dp_lm import clipping as clipping_module
from keras_dp_lm.losses import per_example_losses
from keras_dp_lm.losses import regularization_loss
from keras_dp_lm.optimizers import is_dp_optimizer


def _model_outputs(model, x):
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


def _has_metrics(model):
    return model._compile_metrics is not None or bool(model._metrics)


def _split_micro_batches(data, num_micro):
    """Reshape each leaf ``[B, ...]`` to ``[k, B / k, ...]``."""
    def split(t):
        if t is None:
            return None
        size = t.shape[0]
        if size is not None and size % num_micro:
            raise ValueError(
                f"The batch of {size} examples cannot be split into "
                f"gradient_accumulation_steps={num_micro} equal micro-batches. "
                "Use a batch size divisible by gradient_accumulation_steps "
                "(and drop_remainder=True in tf.data).")
        if size is None:
            tf.debugging.assert_equal(
                tf.shape(t)[0] % num_micro, 0,
                message="batch size must be divisible by gradient_accumulation_steps")
        shape = tf.concat([[num_micro, tf.shape(t)[0] // num_micro], tf.shape(t)[1:]], 0)
        return tf.reshape(t, shape)
    return tree.map_structure(split, data)


def _micro_batch(data, index):
    return tree.map_structure(lambda t: None if t is None else t[index], data)


def _update_metrics(model, part, outputs):
    """Update compiled metrics on one (micro-)batch; they are not DP."""
    if not _has_metrics(model):
        return
    px, py, psw = part
    if outputs is None:
        outputs = model(px, training=False) if model._call_has_training_arg else model(px)
    model.compute_metrics(px, py, outputs, sample_weight=psw)


def dp_clipped_gradient(model, data, update_metrics=False):
    """Summed clipped per-example gradients of one logical batch (no noise).

    Returns ``(grads, per_example_losses, per_example_norms, batch_size)``,
    processing ``optimizer.gradient_accumulation_steps`` micro-batches
    sequentially. With ``update_metrics``, compiled metrics are updated from the
    outputs of the first micro-batch (all of the batch when there is one), reusing
    the fast path's forward pass when it made one.
    """
    optimizer = model.optimizer
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    batch = tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight))

    def loss_fn(part):
        px, py, psw = part
        outputs = _model_outputs(model, px)
        return per_example_losses(model, px, py, outputs, psw), outputs

    def micro_clipped_sum(part):
        return clipping_module.clipped_sum(
            model, loss_fn, part, optimizer.l2_norm_clip, method=optimizer.clipping)

    num_micro = optimizer.dp_accumulation_steps
    batch_size = clipping_module.batch_size_of(batch)
    if num_micro == 1:
        result = micro_clipped_sum(batch)
        if update_metrics:
            _update_metrics(model, batch, result.outputs)
        return result.grads, result.losses, result.norms, batch_size

    micro = _split_micro_batches(batch, num_micro)
    # The first micro-batch runs outside the loop so metrics (whose variables
    # may be created on first use) are never built inside control flow.
    first_part = _micro_batch(micro, 0)
    first = micro_clipped_sum(first_part)
    if update_metrics:
        _update_metrics(model, first_part, first.outputs)

    def body(i, sums, losses, norms):
        result = micro_clipped_sum(_micro_batch(micro, i))
        sums = [s + g for s, g in zip(sums, result.grads)]
        return i + 1, sums, losses.write(i, result.losses), norms.write(i, result.norms)

    losses = tf.TensorArray(tf.float32, size=num_micro, infer_shape=False)
    norms = tf.TensorArray(tf.float32, size=num_micro, infer_shape=False)
    losses, norms = losses.write(0, first.losses), norms.write(0, first.norms)
    _, sums, losses, norms = tf.while_loop(
        lambda i, *_: i < num_micro, body,
        (tf.constant(1), list(first.grads), losses, norms), parallel_iterations=1)
    return sums, losses.concat(), norms.concat(), batch_size


def dp_train_step(model, data):
    """One DP update on one logical batch; the body of ``model.train_step``.

    The loss in the logs is the mean per-example loss of the whole logical
    batch; other compiled metrics are computed on the first micro-batch only
    (all of it without accumulation). Neither is differentially private.
    """
    optimizer = model.optimizer
    check_model_is_private_compatible(model)
    grads, losses, norms, batch_size = dp_clipped_gradient(model, data, update_metrics=True)
    optimizer._apply_clipped_sum(grads, model.trainable_variables, batch_size,
                                 public_gradients=_regularization_gradients(model))
    model._loss_tracker.update_state(
        tf.reduce_mean(losses), sample_weight=tf.cast(tf.size(losses), tf.float32))
    logs = model.get_metrics_result()
    if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # Keras 3.15 averages logs across workers with reduce(MEAN, axis=0),
        # which fails on scalars: hand it rank-1 values, it returns scalars.
        logs = {name: tf.reshape(value, [1]) for name, value in logs.items()}
    return logs


def _regularization_gradients(model):
    """Gradients of the weight regularisation (data independent), or None."""
    with tf.GradientTape() as tape:
        loss = regularization_loss(model)
    if loss is None:
        return None
    grads = tape.gradient(loss, model.trainable_variables)
    return [None if g is None else tf.convert_to_tensor(g) for g in grads]


def check_model_is_private_compatible(model):
    """Raise if a model cannot be trained privately by the DP step."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"Layer '{layer.name}' is BatchNormalization, which normalises each "
                "example with statistics of the whole batch: one example then "
                "changes every other example's gradient, so per-example clipping "
                "bounds nothing. Replace it with LayerNormalization or "
                "GroupNormalization, or freeze it (layer.trainable = False).")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer '{layer.name}' has an activity_regularizer: a loss on "
                "activations is not part of any single example's loss under "
                "Keras's batch reduction. Remove it (weight regularizers are fine).")


def _check_train_step_not_overridden(model):
    step = type(model).train_step
    if step is not TensorFlowTrainer.train_step:
        raise TypeError(
            f"{type(model).__name__} overrides train_step(), so model.fit would "
            "bypass per-example clipping and noise. Remove the override (put "
            "custom losses in `compute_per_example_loss(x, y, y_pred, "
            "sample_weight)`), or train with the step returned by "
            "`keras_dp_lm.make_private(model)` in a custom loop.")


def make_private(model):
    """Bind the DP train step to a model compiled with a DP optimizer.

    ``model.compile`` does this automatically once keras_dp_lm is imported.
    Returns a callable ``step(data) -> logs`` (a ``tf.function``) for custom
    training loops: it performs exactly the update ``fit`` would.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0,
        ...                                   noise_multiplier=1.0), loss="mse")
        >>> step = kdp.make_private(model)
        >>> logs = step((np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")))
        >>> int(model.optimizer.dp_updates.numpy())
        1
    """
    if not is_dp_optimizer(getattr(model, "optimizer", None)):
        raise ValueError(
            "make_private(model) needs a model compiled with a keras_dp_lm DP "
            "optimizer, e.g. model.compile(optimizer=keras_dp_lm.DPAdam(...), loss=...).")
    check_model_is_private_compatible(model)
    model.train_step = types.MethodType(dp_train_step, model)
    model.train_function = None

    @tf.function
    def step(data):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            logs = strategy.run(model.train_step, args=(data,))
            return strategy.experimental_local_results(logs)[0]
        return model.train_step(data)

    def run(data):
        if not model.built:
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
            model(x)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        return step(data)

    return run


_original_compile = trainer_module.Trainer.compile


@functools.wraps(_original_compile)
def _compile_with_dp_binding(self, *args, **kwargs):
    _original_compile(self, *args, **kwargs)
    if is_dp_optimizer(getattr(self, "optimizer", None)):
        _check_train_step_not_overridden(self)
        check_model_is_private_compatible(self)
        self.train_step = types.MethodType(dp_train_step, self)
    elif isinstance(self.__dict__.get("train_step"), types.MethodType) and \
            self.__dict__["train_step"].__func__ is dp_train_step:
        del self.__dict__["train_step"]  # recompiled without DP: unbind


_original_symbolic_build = TensorFlowTrainer._maybe_symbolic_build


def _symbolic_build_multi_worker_safe(self, iterator=None, data_batch=None):
    """Keras 3.15 averages a distributed batch with ``strategy.reduce`` before
    building, which fails under MultiWorkerMirroredStrategy in eager mode
    ("Attempt to convert a value (PerReplica...)"), even for plain Adam. Build
    from the first local replica's batch instead: only shapes matter."""
    strategy = self._distribute_strategy
    if (strategy is None or iterator is None or not isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy)):
        return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    for _, _, it in iterator:
        batch = next(it)
        data_batch = tree.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, batch)
        break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def install():
    """Patch ``keras.Model.compile`` so DP optimizers bind the DP step (idempotent).

    Also works around Keras's MultiWorkerMirroredStrategy build failure.
    """
    if trainer_module.Trainer.compile is not _compile_with_dp_binding:
        trainer_module.Trainer.compile = _compile_with_dp_binding
    if TensorFlowTrainer._maybe_symbolic_build is not _symbolic_build_multi_worker_safe:
        TensorFlowTrainer._maybe_symbolic_build = _symbolic_build_multi_worker_safe
