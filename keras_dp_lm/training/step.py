"""The DP train step.

After ``import keras_dp_lm``, ``model.compile(optimizer=<DP optimizer>, ...)``
binds :func:`dp_train_step` to the model as an instance attribute (Keras looks
the step up as ``self.train_step``; the binding is in
:mod:`keras_dp_lm.training.binding`), so plain ``model.fit`` trains privately.
The step, per logical batch:

1. splits the batch into ``gradient_accumulation_steps`` micro-batches;
2. per micro-batch, computes per-example losses from the compiled loss
   (:mod:`keras_dp_lm.training.losses`), per-example gradients, clips each to
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

from __future__ import annotations

import contextlib
import typing
import weakref
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from keras_dp_lm import clipping as clipping_module
from keras_dp_lm.training import fit_guards
from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.training import graph_refusals
from keras_dp_lm.training import refusals
from keras_dp_lm.training import save_guards
from keras_dp_lm.training.batches import _batch_rate
from keras_dp_lm.training.batches import _has_real_slots
from keras_dp_lm.training.batches import _loss_weights
from keras_dp_lm.training.batches import _micro_batch
from keras_dp_lm.training.batches import _micro_batch_rows
from keras_dp_lm.training.batches import _pad_to_multiple
from keras_dp_lm.training.batches import _split_micro_batches
from keras_dp_lm.training.batches import _unpack
from keras_dp_lm.training.model_ledgers import ledger_of
from keras_dp_lm.training.weight_marks import mark_dp_trained
from keras_dp_lm.training.weight_marks import models_registered
from keras_dp_lm.training.model_ledgers import sharing_ledgers
from keras_dp_lm.training.losses import _model_outputs
from keras_dp_lm.training.losses import _probe_losses
from keras_dp_lm.training.losses import _step_losses
from keras_dp_lm.training.losses import regularization_loss
from keras_dp_lm.training.probing import _MIXING_REFUSED
from keras_dp_lm.training.probing import _probe_engine
from keras_dp_lm.data.releases import recording_release_calls
from keras_dp_lm.errors import PrivacyRefusalError

if TYPE_CHECKING:
    import keras


class ClippedBatch(typing.NamedTuple):
    """The clipped sum of one logical batch (no noise).

    grads: list aligned with ``model.trainable_variables``: the sum over real units
        (examples, or users for user batches) of ``min(1, C / ||g_u||) g_u``;
        padding slots contribute exactly zero.
    losses: ``[B]`` per-example losses (0 on padding slots); in a user batch each
        is weighted by 1 / (its user's real examples), so a user's losses sum to
        the user's mean loss.
    norms: per-unit gradient norms before clipping (0 for padding): ``[B]``, or
        ``[B / k]`` per user for user batches.
    mask: ``[B]`` float32, 1 for real examples and 0 for padding slots (in a user
        batch, rows ``u*k .. u*k+k-1`` are user ``u``).
    rounding: like ``norms``, the float32 rounding allowance included in
        ``norms**2`` (``ClippedSum.rounding``; 0 for the exact engine).
    """

    grads: list[tf.Tensor]
    losses: tf.Tensor
    norms: tf.Tensor
    mask: tf.Tensor
    rounding: tf.Tensor | None = None


def _update_metrics(model, part, outputs):
    """Update compiled metrics on one (micro-)batch; they are not DP."""
    if not internals.has_compiled_metrics(model):
        return
    px, py, psw = part
    if outputs is None:
        outputs = _model_outputs(model, px)
    model.compute_metrics(px, py, outputs, sample_weight=psw)


def dp_clipped_gradient(model: keras.Model, data: Any,
                        update_metrics: bool = False) -> ClippedBatch:
    """Summed clipped per-example gradients of one logical batch (no noise).

    Returns a :class:`ClippedBatch`, processing
    ``optimizer.gradient_accumulation_steps`` micro-batches sequentially (a
    batch that does not divide evenly is padded with inert slots). Padding
    slots, marked by :func:`keras_dp_lm.data.attach_real_slots`, get a loss
    of exactly 0, so they add nothing whatever the loss or preprocessing does
    with ``sample_weight``. With ``update_metrics``, compiled metrics are
    updated from the outputs of the first micro-batch. A model compiled with
    ``jit_compile=True`` runs the step's XLA core, as ``fit`` does.
    """
    x, y, sample_weight, mask, _, per_user = _unpack(data)
    return _clipping_core(model)(model, model.optimizer.privacy_parameters,
                                 (x, y, sample_weight), mask, update_metrics, per_user or 1)


def _clipped_batch(model, params, batch, mask, update_metrics, examples_per_user=1):
    """The clipped sum of one logical batch at ``params`` (a frozen
    :class:`~keras_dp_lm.optimizers.PrivacyParameters`: C, micro-batches, method)."""
    k = examples_per_user
    weights = _loss_weights(mask, k)
    loss_fn = _step_losses(model, k)

    def micro_clipped_sum(part):
        result = clipping_module.clipped_sum(
            model, loss_fn, part, params.l2_norm_clip, method=params.clipping,
            slot_mask=part[1], examples_per_user=k)
        real_units = clipping_module.user_slot_mask(part[1], k) > 0
        zero = tf.zeros([], result.norms.dtype)
        rounding = (tf.zeros_like(result.norms) if result.rounding is None
                    else tf.cast(result.rounding, result.norms.dtype))
        return result._replace(norms=tf.where(real_units, result.norms, zero),
                               rounding=tf.where(real_units, rounding, zero))

    num_micro = params.accumulation_steps
    if num_micro == 1:
        result = refusals.without_state_updates(
            model, lambda: micro_clipped_sum((batch, weights)))
        if update_metrics:
            _update_metrics(model, batch, result.outputs)
        return ClippedBatch(result.grads, result.losses, result.norms, mask, result.rounding)

    # Micro-batches split on user boundaries: pad whole users, k rows each.
    batch, weights = _pad_to_multiple(batch, weights, num_micro * k)
    mask = tf.cast(weights > 0, tf.float32)
    micro = _split_micro_batches((batch, weights), num_micro)
    # The first micro-batch runs outside the loop so metrics (whose variables
    # may be created on first use) are never built inside control flow.
    first_part = _micro_batch(micro, 0)
    first = refusals.without_state_updates(model, lambda: micro_clipped_sum(first_part))
    if update_metrics:
        _update_metrics(model, first_part[0], first.outputs)

    def body(i, sums, losses, norms, rounding):
        result = micro_clipped_sum(_micro_batch(micro, i))
        sums = [s + g for s, g in zip(sums, result.grads)]
        return (i + 1, sums, losses.write(i, result.losses), norms.write(i, result.norms),
                rounding.write(i, result.rounding))

    def arrays(first_values):
        array = tf.TensorArray(tf.float32, size=num_micro, infer_shape=False)
        return array.write(0, first_values)

    _, sums, losses, norms, rounding = tf.while_loop(
        lambda i, *_: i < num_micro, body,
        (tf.constant(1), list(first.grads), arrays(first.losses), arrays(first.norms),
         arrays(first.rounding)), parallel_iterations=1)
    return ClippedBatch(sums, losses.concat(), norms.concat(), mask, rounding.concat())


# Per-model caches live in the model's own ``__dict__`` (not Keras-tracked):
# their values (traced functions) reference the model, so a module-level
# ``WeakKeyDictionary`` would keep every model that ever trained alive, and its
# traced graphs with it (millions of Python objects over a test suite).
_XLA_CORE = "_keras_dp_lm_xla_core"


def has_xla_core(model):
    """Whether ``model``'s DP step has compiled its clipping core with XLA."""
    return _XLA_CORE in model.__dict__


def _clipping_core(model):
    """``_clipped_batch``, compiled with XLA when the model is (``jit_compile``).

    A DP model compiled with ``jit_compile=True`` runs Keras's step as a plain
    graph (see ``binding._dp_make_train_function``) and only this core (the
    forward and backward passes and the clipping) as one XLA program. The
    checks around it (the independence probe, the ledger's limits) then stay
    outside XLA: their assertions raise as in graph mode, and the probe's
    model passes add nothing to the XLA program's peak memory.
    """
    if not model.jit_compile:
        return _clipped_batch
    # The core's trace reads the clip norm, the clipping method, the
    # accumulation steps and the trainable variables as Python values. A
    # recompile (a new optimizer) or another trainable set needs a new program:
    # a core traced for the old optimizer would clip at the old C while the
    # noise is drawn for the new one.
    owner = (model.optimizer, tuple(model.trainable_variables))
    cached = model.__dict__.get(_XLA_CORE)
    if cached is None or not _same_objects(cached[0], owner):
        core = tf.function(_clipped_batch, jit_compile=True, reduce_retracing=True,
                           autograph=False)
        model.__dict__[_XLA_CORE] = cached = (owner, core)
    return cached[1]


def _same_objects(a, b):
    optimizer_a, variables_a = a
    optimizer_b, variables_b = b
    return (optimizer_a is optimizer_b and len(variables_a) == len(variables_b)
            and all(x is y for x, y in zip(variables_a, variables_b)))


# Keras traces the train function with autograph on, and autograph converts
# every function a converted one calls that is not Keras's or TensorFlow's own.
# Nothing in the DP step needs it (its control flow is tf.cond / tf.while_loop),
# so the step is not converted, as Keras's own train_step is not: converting
# keras_dp_lm's source took a third of a 1-layer GPT-2's first DP fit.
@tf.autograph.experimental.do_not_convert
def dp_train_step(model: keras.Model, data: Any) -> dict[str, tf.Tensor]:
    """One DP update on one logical batch; the body of ``model.train_step``.

    Before the update the batch is checked against what the accountant
    assumes (the model's :class:`~keras_dp_lm.training.ledger.PrivacyLedger` limits):
    a batch with more real examples, a larger sampling rate or a smaller noise
    multiplier raises (graph mode) and in any case contributes nothing. The
    ledger then records the sigma, sampling rate and real batch size this
    traced step used.

    A user batch (real-slot mask ``[U, k]``, from
    :func:`keras_dp_lm.data.poisson_user_batches`) is trained at the user
    level: each user's gradient (the mean over its real examples) is clipped as
    one unit, the optimizer divides by the expected number of users, and the
    ledger counts users (and refuses to mix user and example updates).

    The loss in the logs is the mean per-example (per-user) loss over the real
    examples (users) of the logical batch; other compiled metrics are computed
    on the first micro-batch only. Neither is differentially private.
    """
    optimizer = model.optimizer
    fit_guards.check_optimizer_matches_step(model, compiled_for_dp=True)
    refusals.check_model(model)
    params = optimizer.freeze_privacy_parameters()  # every privacy value of this step
    if not optimizer.built:
        # Keras builds an unbuilt optimizer inside the traced step; under XLA
        # (jit_compile=True) the wrapped optimizer's slots would then be read
        # before they are initialised. Build them eagerly, outside the trace.
        with tf.init_scope():
            optimizer.build(model.trainable_variables)
    sigma = params.noise_multiplier
    ledger = ledger_of(model)
    x, y, sample_weight, mask, rate, per_user = _unpack(data)
    unit = "user" if per_user is not None else "example"
    if per_user is not None and rate is None:
        raise PrivacyRefusalError(
            "User batches (a [users, examples_per_user] real-slot mask) must carry the "
            "rate their users were Poisson-sampled at, so that the ledger and the "
            "accountant count users, never records: build them with "
            "keras_dp_lm.data.poisson_user_batches (or attach_real_slots(..., "
            "sampling_rate=q) with q the per-user inclusion probability).")
    if _has_real_slots(data) and params.expected_batch_size is None:
        raise PrivacyRefusalError(
            "These batches are padded (they carry a real-slot mask, e.g. from "
            "keras_dp_lm.data.poisson_batches), so the DP optimizer must divide "
            "by the expected batch size, never by the data-dependent number of real "
            "examples: pass expected_batch_size=sampling_rate * dataset_size to the "
            "DP optimizer.")
    independent = tf.constant(True)
    if params.clipping != "exact" and not refusals.probe_state(model).probed_before_step:
        # fit / train_on_batch probe before the first step, in a call of its
        # own (_train_function_probing_first); other callers probe here.
        independent = refusals.examples_independent(
            model, _probe_losses(model), (x, y, sample_weight), mask,
            rows=_micro_batch_rows(model, mask, per_user), engine=_probe_engine(model))
    refuse_mixing = tf.debugging.Assert(independent, [_MIXING_REFUSED])
    with tf.control_dependencies([refuse_mixing]), recording_release_calls() as called:
        result = _clipping_core(model)(model, params, (x, y, sample_weight), mask, True,
                                       per_user or 1)
    _refuse_unlisted_releases(model, called)
    # Real units: examples, or users (a user with any real slot) in a user batch.
    local_size = tf.reduce_sum(
        clipping_module.user_slot_mask(result.mask, per_user or 1))
    real = local_size
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        real = ctx.all_reduce(tf.distribute.ReduceOp.SUM, real)
    rate = _batch_rate(rate, ctx)
    passed = ledger.check_parts(sigma, rate, real, unit)
    ok = tf.reduce_all(passed) & independent
    nested = sharing_ledgers(model)  # other models whose weights it trains record it too
    model.__dict__[_TRACED_SHARING] = (models_registered(), weakref.WeakSet(nested))
    for inner in nested:
        ok = ok & inner.check(sigma, rate, real, unit)  # its unit: never mixed
    with tf.control_dependencies([refuse_mixing]):  # its message first
        ok = tf.identity(ok)
    # Read back by graph_refusals.as_privacy_refusal, which fit raises instead.
    check = tf.debugging.Assert(ok, [
        graph_refusals.LEDGER_REFUSAL, graph_refusals.PASSED, tf.cast(passed, tf.int32),
        graph_refusals.LIMITS, ledger.limits.value, graph_refusals.SIGMA, sigma,
        graph_refusals.RATE, rate, graph_refusals.REAL, real, graph_refusals.UNIT, unit],
        summarize=graph_refusals.SUMMARIZE)
    with tf.control_dependencies([check]):  # nothing below runs for a refused batch
        keep = tf.cast(ok, tf.float32)  # and under XLA, which drops asserts, it adds nothing
        grads = [g * tf.cast(keep, g.dtype) for g in result.grads]
        optimizer._apply_clipped_sum(params, grads, model.trainable_variables, local_size,
                                    ledger.updates_so_far(),
                                    public_gradients=_regularization_gradients(model))
        for inner in nested:  # at the rate the model's own ledger records
            inner.record(sigma, ledger.recorded_rate(rate), real, ok, unit)
        ledger.record(sigma, rate, real, ok, unit)
    # Mean loss per real unit (a user's weighted losses sum to its mean loss).
    # A non-finite loss counts as 0, as its example's gradient does: a NaN in
    # the log would show which batch held that example (TerminateOnNaN).
    finite_losses = tf.where(tf.math.is_finite(result.losses), result.losses,
                             tf.zeros_like(result.losses))
    internals.loss_tracker(model).update_state(
        tf.reduce_sum(finite_losses) / tf.maximum(local_size, 1.0),
        sample_weight=local_size)
    logs = model.get_metrics_result()
    _refuse_validation_names(logs)
    # Marked once the step is traced (fit, train_on_batch, make_private); a
    # trace that raised applies nothing and marks nothing.
    mark_dp_trained(model.trainable_variables, ledger)
    save_guards.guard_layers(internals.flatten_layers(model, include_self=True))
    if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # Keras 3.15 averages logs across workers with reduce(MEAN, axis=0),
        # which fails on scalars: hand it rank-1 values, it returns scalars.
        logs = {name: tf.reshape(value, [1]) for name, value in logs.items()}
    return logs


dp_train_step._keras_dp_lm_dp_step = True  # what binding.is_bound_to_dp_step reads


def _refuse_unlisted_releases(model, called):
    """Refuse, while the step is traced (before any update), a release layer
    (``DPFeatureNormalization``, ``DPClassMeans``) that the forward pass called but the model does
    not list among its layers: inside a ``keras.layers.Lambda``, or a layer held
    outside the model and called from a custom ``call``. The accountant finds
    release layers by walking the model, so it would leave that release out of
    the total it prints."""
    listed = internals.flatten_layers(model, include_self=True)
    unlisted = [layer for layer in called if all(layer is not seen for seen in listed)]
    if unlisted:
        names = ", ".join(repr(layer.name) for layer in unlisted)
        raise PrivacyRefusalError(
            f"keras_dp_lm refused the DP step: the forward pass calls {names} "
            "(a DPFeatureNormalization or DPClassMeans layer: a release of statistics of "
            "the training data) but the "
            "model does not list it among its layers, so the PrivacyAccountant "
            "cannot find it and would leave its release out of the total epsilon. "
            "Use the layer as a layer of the model (keras.Sequential / the functional "
            "API / an attribute of a custom layer), not inside a keras.layers.Lambda "
            "or from a variable outside the model. Refused before any update.")


def _refuse_validation_names(logs):
    """Refuse training values logged under a ``val_`` name (a metric or output
    the user named so): Keras writes validation values under those names only
    in epochs that validate (``validation_freq``), so in the others a callback
    or a reader would take a value computed on private examples for a held-out
    one."""
    names, stack = [], [logs]
    while stack:  # Keras flattens a metric's dict result into the logs
        for name, value in stack.pop().items():
            if isinstance(value, dict):
                stack.append(value)
            elif str(name).startswith("val_"):
                names.append(name)
    names.sort()
    if names:
        raise PrivacyRefusalError(
            f"keras_dp_lm refused the DP step: it would log {names}, values computed on "
            "private training examples, under names Keras uses for validation values. "
            "A callback or a reader of the history would take them for held-out values "
            "(in epochs without validation, e.g. with validation_freq, nothing "
            "replaces them). Rename the metric (or the model output) so that its name "
            "does not start with 'val_'.")


def _regularization_gradients(model):
    """Gradients of the weight regularisation (data independent), or None."""
    with tf.GradientTape() as tape:
        loss = regularization_loss(model)
    if loss is None:
        return None
    grads = tape.gradient(loss, model.trainable_variables)
    return [None if g is None else tf.convert_to_tensor(g) for g in grads]


_TRACED_SHARING = "_keras_dp_lm_traced_sharing"


def _sharing_grew(model):
    """Whether a model built since the DP step was traced holds weights the
    step trains: the traced step would not record its updates in that model's
    ledger, so the step must be traced again."""
    traced = model.__dict__.get(_TRACED_SHARING)
    if traced is None or traced[0] == models_registered():
        return False
    strategy = internals.distribute_strategy_of(model)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        ledgers = sharing_ledgers(model)  # a new model's ledger is created here
    grew = any(ledger not in traced[1] for ledger in ledgers)
    # recorded before the new trace, which records its own
    model.__dict__[_TRACED_SHARING] = (models_registered(), traced[1])
    return grew
