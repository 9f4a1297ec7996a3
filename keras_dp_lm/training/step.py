"""The DP train step and its binding to models compiled with a DP optimizer.

After ``import keras_dp_lm``, ``model.compile(optimizer=<DP optimizer>, ...)``
binds :func:`dp_train_step` to the model as an instance attribute (Keras looks
the step up as ``self.train_step``), so plain ``model.fit`` trains privately.
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

import collections
import contextlib
import functools
import itertools
import types
import weakref

import keras
import tensorflow as tf

from keras_dp_lm import clipping as clipping_module
from keras_dp_lm.training import fit_guards
from keras_dp_lm.training import keras_internals as internals
from keras_dp_lm.training import refusals
from keras_dp_lm.training.ledger import ledger_of
from keras_dp_lm.training.ledger import mark_dp_trained
from keras_dp_lm.training.ledger import models_registered
from keras_dp_lm.training.ledger import register_model
from keras_dp_lm.training.ledger import sharing_ledgers
from keras_dp_lm.training.ledger import saved_ledger
from keras_dp_lm.training.losses import per_example_losses
from keras_dp_lm.training.losses import regularization_loss
from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.data import attach_real_slots
from keras_dp_lm.data import split_real_slots
from keras_dp_lm.errors import PrivacyRefusalError

tree = internals.tree

ClippedBatch = collections.namedtuple("ClippedBatch",
                                      ["grads", "losses", "norms", "mask", "rounding"],
                                      defaults=(None,))
ClippedBatch.__doc__ = """The clipped sum of one logical batch (no noise).

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


def _model_outputs(model, x, training=True):
    """The model's outputs as Keras's own train (``training=True``) and test
    steps compute them: ``training`` is passed only when ``call`` takes it
    (a subclassed ``call(self, x)`` runs its dropout as Keras's ``fit`` does)."""
    if internals.call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


def _batch_size(batch):
    first = next(t for t in tree.flatten(batch) if t is not None)
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def _pad_to_multiple(data, mask, num_micro):
    """Pad every leaf (and the mask) with inert slots up to a multiple of k."""
    size = _batch_size(mask)
    if isinstance(size, int):
        pad = (-size) % num_micro
        if pad == 0:
            return data, mask
    else:
        pad = tf.math.floormod(-size, num_micro)

    def grow(t):
        if t is None:
            return None
        filler = tf.gather(t, tf.zeros([pad], tf.int32))  # copies of slot 0, masked out
        return tf.concat([t, filler], 0)

    return tree.map_structure(grow, data), tf.concat([mask, tf.zeros([pad], mask.dtype)], 0)


def _split_micro_batches(data, num_micro):
    """Reshape each leaf ``[B, ...]`` to ``[k, B / k, ...]``."""
    def split(t):
        if t is None:
            return None
        shape = tf.concat([[num_micro, tf.shape(t)[0] // num_micro], tf.shape(t)[1:]], 0)
        return tf.reshape(t, shape)
    return tree.map_structure(split, data)


def _micro_batch(data, index):
    return tree.map_structure(lambda t: None if t is None else t[index], data)


def _update_metrics(model, part, outputs):
    """Update compiled metrics on one (micro-)batch; they are not DP."""
    if not internals.has_compiled_metrics(model):
        return
    px, py, psw = part
    if outputs is None:
        outputs = _model_outputs(model, px)
    model.compute_metrics(px, py, outputs, sample_weight=psw)


def _has_real_slots(data):
    _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    return split_real_slots(sample_weight)[0] is not None


def _unpack(data):
    """``(x, y, sample_weight, real-slot mask [B], sampling rate, examples_per_user)``.

    A real-slot mask of shape ``[U, k]`` (from
    :func:`keras_dp_lm.data.poisson_user_batches`) marks a user batch:
    ``examples_per_user`` is then ``k``; else it is ``None``.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask, rate, sample_weight = split_real_slots(sample_weight)
    x, y, sample_weight = tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight))
    size = _batch_size((x, y, sample_weight))
    per_user = None
    if mask is None:
        mask = tf.ones([size], tf.float32)
    else:
        mask = tf.convert_to_tensor(mask)
        if mask.shape.rank is None:
            raise PrivacyRefusalError(
                "The real-slot mask has an unknown rank (Keras relaxed the traced shapes "
                "after batches of different kinds): a model trains on example batches "
                "(mask [B]) or on user batches (mask [users, examples_per_user], one "
                "examples_per_user), not both.")
        if mask.shape.rank == 2:
            per_user = mask.shape[1]
            if per_user is None:
                raise PrivacyRefusalError(
                    "A user batch's real-slot mask [users, examples_per_user] needs a "
                    "static examples_per_user (keras_dp_lm.data.poisson_user_batches "
                    "gives one).")
        elif mask.shape.rank != 1:
            raise PrivacyRefusalError(
                f"The real-slot mask must be [B] (examples) or [users, "
                f"examples_per_user]; got shape {tuple(mask.shape)}.")
        if per_user is not None and isinstance(size, int) and size % per_user:
            raise PrivacyRefusalError(
                f"A user batch with examples_per_user={per_user} has {size} rows, not "
                "a multiple of it: its rows no longer line up with its users. Under "
                "tf.distribute, pass num_replicas=strategy.num_replicas_in_sync to "
                "keras_dp_lm.data.poisson_user_batches, so that splitting the batch "
                "keeps each user's rows on one replica.")
        # A slot is real or padding: 0/1, whatever values the mask holds (a
        # fractional mask must not shrink the counted batch).
        mask = tf.cast(tf.reshape(mask, [-1]) > 0, tf.float32)
        mask_size = mask.shape[0]
        if isinstance(size, int) and mask_size is not None and mask_size != size:
            raise PrivacyRefusalError(
                f"The batch has {size} slots but its real-slot mask has {mask_size}: "
                "a preprocessing step changed the number of rows. keras_dp_lm "
                "needs row-wise preprocessing (one output row per input row).")
        if not isinstance(size, int) or mask_size is None:
            mask = _one_per_row(mask, size)
    return x, y, sample_weight, mask, rate, per_user


def _batch_rate(rate, ctx):
    """The batch's Poisson rate: the largest attached to any of its rows, on
    any replica (0 when none is attached). Rates travel one per row so that
    ``tf.distribute`` can split a batch; a replica may get no rows."""
    if rate is None:
        return tf.constant(0.0, tf.float64)
    rate = tf.reshape(tf.cast(rate, tf.float64), [-1])
    rate = tf.reduce_max(tf.concat([rate, tf.zeros([1], tf.float64)], 0))
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        rate = tf.reduce_max(ctx.all_gather(tf.reshape(rate, [1]), axis=0))
    return rate


def _one_per_row(mask, rows):
    """``mask`` checked at run time to have one entry per row.

    A smaller mask must never broadcast over the rows (one user's slot would
    then cover all of them). In graph mode a mismatch raises; under XLA, which
    drops assertions, the mask becomes all padding, so the step adds nothing
    but noise. (``tf.reshape(mask, [rows])`` is not enough: grappler removes
    a reshape between two shapes it cannot tell apart.)
    """
    count = tf.size(mask)
    check = tf.debugging.assert_equal(
        count, rows, message="keras_dp_lm: the real-slot mask must have one entry per "
                             "row (example batches) or per examples_per_user rows (user "
                             "batches) of the batch: preprocess row-wise, and under "
                             "tf.distribute pass num_replicas= to poisson_user_batches")
    with tf.control_dependencies([check]):
        index = tf.minimum(tf.range(rows), tf.maximum(count - 1, 0))
        return tf.gather(mask, index) * tf.cast(tf.equal(count, rows), mask.dtype)


def _loss_weights(mask, examples_per_user):
    """Per-row loss weights: the real-slot mask, divided in a user batch by the
    user's number of real rows (each user's gradient is the mean over its
    examples, computed from that user's rows alone)."""
    k = examples_per_user
    if k == 1:
        return mask
    per_user = tf.reshape(mask, [-1, k])
    counts = tf.reduce_sum(per_user, axis=1, keepdims=True)
    return tf.reshape(per_user / tf.maximum(counts, 1.0), [-1])


def dp_clipped_gradient(model, data, update_metrics=False):
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
    return _clipping_core(model)(model, (x, y, sample_weight), mask, update_metrics,
                                 per_user or 1)


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


def _probe_engine(model):
    """The DP step's clipping engine as the independence probe checks it:
    ``(batch, mask, slot_mask, l2_norm_clip) -> ClippedSum``: the step's losses
    on the real rows of ``mask``, clipped at ``l2_norm_clip`` and summed over the
    rows of ``slot_mask`` only."""
    loss_fn = _step_losses(model)

    def engine(batch, mask, slot_mask, l2_norm_clip):
        return clipping_module.clipped_sum(
            model, loss_fn, (batch, mask), l2_norm_clip, method=model.optimizer.clipping,
            slot_mask=slot_mask)
    return engine


def _clipped_batch(model, batch, mask, update_metrics, examples_per_user=1):
    optimizer = model.optimizer
    k = examples_per_user
    weights = _loss_weights(mask, k)
    loss_fn = _step_losses(model, k)

    def micro_clipped_sum(part):
        result = clipping_module.clipped_sum(
            model, loss_fn, part, optimizer.l2_norm_clip, method=optimizer.clipping,
            slot_mask=part[1], examples_per_user=k)
        real_units = clipping_module.user_slot_mask(part[1], k) > 0
        zero = tf.zeros([], result.norms.dtype)
        rounding = (tf.zeros_like(result.norms) if result.rounding is None
                    else tf.cast(result.rounding, result.norms.dtype))
        return result._replace(norms=tf.where(real_units, result.norms, zero),
                               rounding=tf.where(real_units, rounding, zero))

    num_micro = optimizer.dp_accumulation_steps
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
_PROBE = "_keras_dp_lm_probe"


def has_xla_core(model):
    """Whether ``model``'s DP step has compiled its clipping core with XLA."""
    return _XLA_CORE in model.__dict__


def _clipping_core(model):
    """``_clipped_batch``, compiled with XLA when the model is (``jit_compile``).

    A DP model compiled with ``jit_compile=True`` runs Keras's step as a plain
    graph (see ``_dp_make_train_function``) and only this core (the
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
    # noise is drawn for the new one (r34 F2).
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


_MIXING_REFUSED = (
    "keras_dp_lm refused the batch: one example's loss or gradient depends on other "
    "examples of the batch (a layer or loss mixes examples: batch statistics, a "
    "batch maximum, weights normalised over the batch, attention or similarity "
    "across the batch axis, a straight-through estimator or custom gradient over "
    "the batch), or its training pass or gradients are not finite on the examples "
    "the check compares (a layer dividing by a batch statistic without an "
    "epsilon), or the training pass draws randomness "
    "outside Keras's seed generators (tf.random.* in a layer's call), which the "
    "check cannot replay and which could hide such mixing, or fast clipping's own "
    "per-example gradient of an example is not that example's gradient (a backward "
    "pass that moves gradient between examples, or a clipping rule registered with "
    "register_clipping_rule for a layer whose call it does not describe). Fast "
    "clipping cannot bound such a model. Make each example's loss depend on that "
    "example alone, draw randomness with keras.random and a "
    "keras.random.SeedGenerator (as keras.layers.Dropout does), register rules only "
    "for layers that compute what the rule's layer computes, or compile the DP "
    "optimizer with clipping='exact' (each example differentiated alone).")


def _micro_batch_rows(model, mask, examples_per_user=None):
    """The rows of one micro-batch of ``mask``'s batch (the size the model is
    trained at with gradient accumulation): the probe runs at that size."""
    unit = (examples_per_user or 1) * model.optimizer.dp_accumulation_steps
    units = (tf.shape(mask)[0] + unit - 1) // unit
    return units * (examples_per_user or 1)


def _probe_losses(model):
    """``(part, training) -> [B]`` per-example losses (the probe's passes): the
    model called as the step calls it (:func:`_model_outputs`)."""
    def losses(part, training):
        px, py, psw = part
        return per_example_losses(model, px, py, _model_outputs(model, px, training), psw)
    return losses


def _dp_make_train_function(model):
    """``model.make_train_function`` for a DP model.

    * With ``jit_compile=True`` Keras's step is built without XLA and the DP
      step compiles its own core instead (:func:`_clipping_core`);
      ``model.jit_compile`` stays what the user set.
    * The train function it returns runs fast clipping's independence probe
      before the first step, as a call of its own
      (:func:`_train_function_probing_first`).
    """
    make = model.make_train_function

    def build(force):
        if not model.jit_compile:
            return make(force)
        model.jit_compile = False
        try:
            return make(force)
        finally:
            model.jit_compile = True

    def make_train_function(force=False):
        build(force)  # sets model.train_function, which fit and train_on_batch call
        function = model.train_function
        if not getattr(function, "_keras_dp_lm_probes_first", False):
            function = model.train_function = _train_function_probing_first(model, function)
        return function

    make_train_function._keras_dp_lm_binding = True
    return make_train_function


def _probe_batch(model, data, spec=None):
    """Run the independence probe on ``data`` (a batch as the step gets it,
    traced at ``spec`` if given); raise before any update if the model mixes
    examples or its forward pass writes model variables."""
    probe = model.__dict__.get(_PROBE)
    if probe is None:
        def run(batch):
            x, y, sample_weight, mask, _, per_user = _unpack(batch)
            # refused on the traced graph, before it runs, if it writes variables
            return refusals.without_state_updates(model, lambda: refusals.model_probe(
                model, _probe_losses(model), (x, y, sample_weight), mask,
                rows=_micro_batch_rows(model, mask, per_user), engine=_probe_engine(model)))
        probe = model.__dict__[_PROBE] = tf.function(run, reduce_retracing=True,
                                                     autograph=False)
    if spec is not None:
        probe = probe.get_concrete_function(spec)
    ok, meaningful = probe(data)
    if not bool(ok):
        raise PrivacyRefusalError(_MIXING_REFUSED)
    if bool(meaningful):
        state = refusals.probe_state(model)
        state.independence_checked.assign(1)
        state.probed_before_step = True
        model.__dict__.pop(_PROBE, None)  # its graph is not needed again


def _train_function_probing_first(model, train_function):
    """``train_function`` that runs the independence probe on the first batch
    as its own call, before the step.

    The probe (:func:`keras_dp_lm.training.refusals.examples_independent`)
    is two inference passes; inside the step's graph it costs its whole
    program on every step even when it is skipped: on SmolLM2-135M with LoRA,
    415 MB of peak RSS and 27 s of the first step's compile time. Once a probe
    has passed, the step is traced without it
    (``probe_state(model).probed_before_step``). The batch the probe ran on is then
    trained on as usual. Under a ``tf.distribute`` strategy, with
    ``run_eagerly=True`` and in custom loops (:func:`make_private`) the step
    probes inside itself instead.
    """
    def run(iterator):
        if (refusals.probe_state(model).probed_before_step
                or model.optimizer.clipping == "exact"
                or model.run_eagerly
                or isinstance(iterator, tf.distribute.DistributedIterator)
                or tf.distribute.has_strategy()
                or internals.distribute_strategy_of(model) is not None):
            return train_function(iterator)
        steps = max(1, int(model.steps_per_execution))
        if isinstance(iterator, tf.data.Iterator):
            batches = []
            for _ in range(steps):
                element = iterator.get_next_as_optional()
                if not element.has_value():
                    break
                batches.append(element.get_value())
            if not batches:
                raise StopIteration
            _probe_batch(model, batches[0], iterator.element_spec)
            # The same element spec as the dataset's, so Keras's traced loop
            # over the iterator is reused (not traced again for this call).
            replay = tf.data.Dataset.from_generator(
                lambda: iter(batches), output_signature=iterator.element_spec)
            return train_function(iter(replay))
        iterator = iter(iterator)
        first = next(iterator)
        _probe_batch(model, first)
        return train_function(itertools.chain([first], iterator))

    run._keras_dp_lm_probes_first = True
    return run


# Keras traces the train function with autograph on, and autograph converts
# every function a converted one calls that is not Keras's or TensorFlow's own.
# Nothing in the DP step needs it (its control flow is tf.cond / tf.while_loop),
# so the step is not converted, as Keras's own train_step is not: converting
# keras_dp_lm's source took a third of a 1-layer GPT-2's first DP fit.
@tf.autograph.experimental.do_not_convert
def dp_train_step(model, data):
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
    optimizer.freeze_privacy_parameters()
    if not optimizer.built:
        # Keras builds an unbuilt optimizer inside the traced step; under XLA
        # (jit_compile=True) the wrapped optimizer's slots would then be read
        # before they are initialised. Build them eagerly, outside the trace.
        with tf.init_scope():
            optimizer.build(model.trainable_variables)
    sigma = float(optimizer.noise_multiplier)
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
    if _has_real_slots(data) and optimizer.expected_batch_size is None:
        raise PrivacyRefusalError(
            "These batches are padded (they carry a real-slot mask, e.g. from "
            "keras_dp_lm.data.poisson_batches), so the DP optimizer must divide "
            "by the expected batch size, never by the data-dependent number of real "
            "examples: pass expected_batch_size=sampling_rate * dataset_size to the "
            "DP optimizer.")
    independent = tf.constant(True)
    if optimizer.clipping != "exact" and not refusals.probe_state(model).probed_before_step:
        # fit / train_on_batch probe before the first step, in a call of its
        # own (_train_function_probing_first); other callers probe here.
        independent = refusals.examples_independent(
            model, _probe_losses(model), (x, y, sample_weight), mask,
            rows=_micro_batch_rows(model, mask, per_user), engine=_probe_engine(model))
    refuse_mixing = tf.debugging.Assert(independent, [_MIXING_REFUSED])
    with tf.control_dependencies([refuse_mixing]):
        result = _clipping_core(model)(model, (x, y, sample_weight), mask, True,
                                       per_user or 1)
    # Real units: examples, or users (a user with any real slot) in a user batch.
    local_size = tf.reduce_sum(
        clipping_module.user_slot_mask(result.mask, per_user or 1))
    real = local_size
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        real = ctx.all_reduce(tf.distribute.ReduceOp.SUM, real)
    rate = _batch_rate(rate, ctx)
    ok = ledger.check(sigma, rate, real, unit) & independent
    nested = sharing_ledgers(model)  # other models whose weights it trains record it too
    model.__dict__[_TRACED_SHARING] = (models_registered(), weakref.WeakSet(nested))
    for inner in nested:
        ok = ok & inner.check(sigma, rate, real, unit)  # its unit: never mixed
    with tf.control_dependencies([refuse_mixing]):  # its message first
        ok = tf.identity(ok)
    check = tf.debugging.Assert(ok, [
        "keras_dp_lm refused a batch beyond what the accountant assumes "
        "(limits: noise_multiplier >=, sampling_rate <=, real fixed-size batch <=, "
        "real Poisson batch <=; then this "
        "batch's values), or of another privacy unit than the model's earlier "
        "updates (example batches and user batches never mix in one ledger). Pass "
        "the real batch_size / sampling_rate to PrivacyAccountant, or feed batches "
        "that match it:",
        ledger.limits.value, sigma, rate, real, "unit: " + unit])
    with tf.control_dependencies([check]):  # nothing below runs for a refused batch
        keep = tf.cast(ok, tf.float32)  # and under XLA, which drops asserts, it adds nothing
        grads = [g * tf.cast(keep, g.dtype) for g in result.grads]
        optimizer._apply_clipped_sum(grads, model.trainable_variables, local_size,
                                     ledger.updates_so_far(),
                                     public_gradients=_regularization_gradients(model))
        for inner in nested:  # at the rate the model's own ledger records
            inner.record(sigma, ledger.recorded_rate(rate), real, ok, unit)
        ledger.record(sigma, rate, real, ok, unit)
    # Mean loss per real unit (a user's weighted losses sum to its mean loss).
    # A non-finite loss counts as 0, as its example's gradient does: a NaN in
    # the log would show which batch held that example (TerminateOnNaN, r34 F3).
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
    if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # Keras 3.15 averages logs across workers with reduce(MEAN, axis=0),
        # which fails on scalars: hand it rank-1 values, it returns scalars.
        logs = {name: tf.reshape(value, [1]) for name, value in logs.items()}
    return logs


def _refuse_validation_names(logs):
    """Refuse training values logged under a ``val_`` name (a metric or output
    the user named so): Keras writes validation values under those names only
    in epochs that validate (``validation_freq``), so in the others a callback
    or a reader would take a value computed on private examples for a held-out
    one (r34d D3)."""
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


check_model_is_private_compatible = refusals.check_model


def _check_train_step_not_overridden(model):
    step = type(model).train_step
    if step is not internals.TensorFlowTrainer.train_step:
        raise PrivacyRefusalError(
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
        >>> kdp.ledger_of(model).updates
        1
    """
    if not is_dp_optimizer(getattr(model, "optimizer", None)):
        raise ValueError(
            "make_private(model) needs a model compiled with a keras_dp_lm DP "
            "optimizer, e.g. model.compile(optimizer=keras_dp_lm.DPAdam(...), loss=...).")
    refusals.check_model(model)
    ledger_of(model)
    model.train_step = types.MethodType(dp_train_step, model)
    model.train_function = None

    def one_step(data):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            logs = strategy.run(model.train_step, args=(data,))
            return strategy.experimental_local_results(logs)[0]
        return model.train_step(data)

    traced = [tf.function(one_step, autograph=False)]

    def run(data):
        if not model.built:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            model(x)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if _sharing_grew(model):  # traced anew, so that model's ledger records it
            traced[0] = tf.function(one_step, autograph=False)
        return traced[0](data)

    return run


def _keep_real_slots_through(preprocess):
    """Wrap a KerasHub ``preprocess_samples`` so the real-slot mask survives it.

    KerasHub preprocessors build their own ``sample_weight`` (the padding
    mask) and drop the one they are given: without this, padding slots of a
    Poisson batch of raw strings would train with full weight.
    """
    if getattr(preprocess, "_keras_dp_lm_keeps_slots", False):
        return preprocess

    def wrapped(x, y=None, sample_weight=None):
        mask, rate, sample_weight = split_real_slots(sample_weight)
        out = preprocess(x, y, sample_weight)
        if mask is None:
            return out
        px, py, psw = keras.utils.unpack_x_y_sample_weight(out)
        return px, py, attach_real_slots(psw, mask, rate)

    wrapped._keras_dp_lm_keeps_slots = True
    return wrapped


_original_compile = internals.Trainer.compile


@functools.wraps(_original_compile)
def _compile_with_dp_binding(self, *args, **kwargs):
    _original_compile(self, *args, **kwargs)
    own = self.__dict__
    if is_dp_optimizer(getattr(getattr(self, "optimizer", None), "inner_optimizer", None)):
        raise PrivacyRefusalError(
            "Keras wrapped the DP optimizer in a LossScaleOptimizer (the "
            "'mixed_float16' policy). Dynamic loss scaling multiplies the loss before "
            "per-example clipping and skips or rescales updates, so the clipping bound "
            "and the noise no longer match what is accounted. Use the "
            "'mixed_bfloat16' policy (supported: clipping arithmetic runs in float32) "
            "or float32.")
    if is_dp_optimizer(getattr(self, "optimizer", None)):
        _check_train_step_not_overridden(self)
        refusals.check_model(self)
        sharing_ledgers(self)  # created in the strategy scope compile runs in
        self.train_step = types.MethodType(dp_train_step, self)
        # A new loss (or model) is probed again, by a probe traced anew.
        refusals.probe_state(self).reset()
        self.__dict__.pop(_PROBE, None)
        self.__dict__.pop(_XLA_CORE, None)
        if not getattr(own.get("make_train_function"), "_keras_dp_lm_binding", False):
            self.make_train_function = _dp_make_train_function(self)
        if hasattr(self, "preprocess_samples"):
            self.preprocess_samples = _keep_real_slots_through(self.preprocess_samples)
    elif _bound_to_dp_step(self):
        del own["train_step"]  # recompiled without DP: unbind
        own.pop("make_train_function", None)
    fit_guards.forget_permission(self)


_original_symbolic_build = internals.TensorFlowTrainer._maybe_symbolic_build


def _symbolic_build_distributed_safe(self, iterator=None, data_batch=None):
    """Keras 3.15 averages a distributed batch with ``strategy.reduce`` before
    building. That fails under MultiWorkerMirroredStrategy in eager mode
    ("Attempt to convert a value (PerReplica...)"), even for plain Adam, and
    under any strategy when the replicas' shares differ in size (a Poisson
    batch of 21 rows on 2 replicas). Build from the first local replica's
    batch instead, without its real-slot marks: only shapes matter.

    Without a strategy Keras builds a model lazily, in its train function's
    first trace; a DP model with layers not yet built (a subclassed model
    never called before ``fit``) is built here instead, before the
    independence probe (which would create the variables in a trace of its
    own), from the dataset's element spec: no batch is drawn."""
    strategy = self._distribute_strategy
    if strategy is None:
        if not _unbuilt_dp_model(self):
            return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            data_batch = internals.epoch_iterator_element_spec(iterator)
        if data_batch is None:
            return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    elif iterator is None:
        return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    else:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v, batch)
            break
    # Keras computes the loss on it: hand it the loss's own sample_weight,
    # not the real-slot marks.
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
    data_batch = keras.utils.pack_x_y_sample_weight(x, y, split_real_slots(sample_weight)[2])
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        self._symbolic_build(data_batch=data_batch)


def _unbuilt_dp_model(model):
    """A model with a DP optimizer and layers not built yet."""
    return is_dp_optimizer(getattr(model, "optimizer", None)) and not all(
        layer.built for layer in internals.flatten_layers(model, include_self=True))


_original_fit = internals.TensorFlowTrainer.fit


@functools.wraps(_original_fit)
def _fit_releasing_limits(self, *args, **kwargs):
    """``fit``, after which the limits a :class:`PrivacyAccountant` registered
    on the model's ledger are cleared also when the fit raised (Keras then
    skips ``on_train_end``): stale limits would check, and record the rate
    of, later fits that have no accountant. Training the ledger could not
    count is refused first
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`)."""
    fit_guards.check_training_is_private(
        self, _bound_to_dp_step(self),
        kwargs.get("callbacks", args[5] if len(args) > 5 else None),
        kwargs.get("validation_split", args[6] if len(args) > 6 else 0.0),
        kwargs.get("validation_data", args[7] if len(args) > 7 else None))
    try:
        return _original_fit(self, *args, **kwargs)
    finally:
        ledger = ledger_of(self, create=False)
        if ledger is not None:
            ledger.clear_limits()


def _bound_to_dp_step(model):
    """Whether ``model`` was compiled for DP (its ``train_step`` is the DP step)."""
    bound = model.__dict__.get("train_step")
    return isinstance(bound, types.MethodType) and bound.__func__ is dp_train_step


_original_train_on_batch = internals.TensorFlowTrainer.train_on_batch


@functools.wraps(_original_train_on_batch)
def _train_on_batch_checked(self, *args, **kwargs):
    """``train_on_batch``, refused first if the ledger could not count it
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`)."""
    fit_guards.check_training_is_private(self, _bound_to_dp_step(self))
    return _original_train_on_batch(self, *args, **kwargs)


_original_make_train_function = internals.TensorFlowTrainer.make_train_function


_TRACED_SHARING = "_keras_dp_lm_traced_sharing"


def _sharing_grew(model):
    """Whether a model built since the DP step was traced holds weights the
    step trains: the traced step would not record its updates in that model's
    ledger (r36 F1), so the step must be traced again."""
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


class _CheckedTrainFunction:
    """A model's train function that refuses, before each call, training the
    ledger could not count; its other attributes are the wrapped function's
    (TensorBoard reads a ``tf.function``'s graph)."""

    _keras_dp_lm_checked = True

    def __init__(self, model, function):
        self._model = model
        self._function = function

    def __call__(self, *args, **kwargs):
        model = self._model
        dp = _bound_to_dp_step(model)
        fit_guards.check_training_is_private(model, dp)
        if dp and _sharing_grew(model):
            model.make_train_function(force=True)
            return model.train_function(*args, **kwargs)
        return self._function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._function, name)


@functools.wraps(_original_make_train_function)
def _make_checked_train_function(self, force=False):
    """``make_train_function``, whose train function refuses, before each call,
    training the ledger could not count
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`): ``fit``
    and ``train_on_batch`` call it, and so may a user (r34c C5)."""
    _original_make_train_function(self, force)
    function = self.train_function
    if function is not None and not getattr(function, "_keras_dp_lm_checked", False):
        function = self.train_function = _CheckedTrainFunction(self, function)
    return function


_original_trainer_init = internals.TensorFlowTrainer.__init__


@functools.wraps(_original_trainer_init)
def _trainer_init_registering(self, *args, **kwargs):
    """Keras's trainer ``__init__``; the model is then registered (weakly) so
    that DP steps training its weights through another model record them in
    its ledger (:func:`~keras_dp_lm.training.ledger.sharing_ledgers`)."""
    _original_trainer_init(self, *args, **kwargs)
    register_model(self)


_original_train_step = internals.TensorFlowTrainer.train_step


@functools.wraps(_original_train_step)
def _checked_train_step(self, data):
    """Keras's ``train_step``, refused first if the ledger could not count it
    (a custom loop calling ``model.train_step`` on DP-trained weights with a
    non-DP optimizer, r34c C5); inside ``fit`` it runs when the step is traced
    (the ledger is read eagerly)."""
    with tf.init_scope():
        fit_guards.check_training_is_private(self, _bound_to_dp_step(self))
    return _original_train_step(self, data)


def install():
    """Patch ``keras.Model.compile`` so DP optimizers bind the DP step (idempotent).

    Also gives every model a ``dp_ledger`` property, so the privacy ledger is
    saved and loaded with the model's weights (``.keras``, ``.weights.h5``),
    clears an accountant's limits after every ``fit`` (also one that raised),
    refuses training the ledger could not count in ``fit``, ``train_on_batch``,
    every train function (also one made and called by hand) and Keras's own
    ``train_step`` (:mod:`keras_dp_lm.training.fit_guards`), registers every
    model (weakly) so that a DP step records its updates in the ledger of every
    model whose weights it trains, and works around Keras's distributed build failure (uneven replica
    shares, MultiWorkerMirroredStrategy).
    """
    trainer = internals.Trainer
    if trainer.compile is not _compile_with_dp_binding:
        trainer.compile = _compile_with_dp_binding
    if not isinstance(getattr(trainer, "dp_ledger", None), property):
        trainer.dp_ledger = property(
            saved_ledger, doc="The model's privacy ledger (keras_dp_lm.ledger_of).")
    tf_trainer = internals.TensorFlowTrainer
    if tf_trainer.fit is not _fit_releasing_limits:
        tf_trainer.fit = _fit_releasing_limits
    if tf_trainer.train_on_batch is not _train_on_batch_checked:
        tf_trainer.train_on_batch = _train_on_batch_checked
    if tf_trainer.__init__ is not _trainer_init_registering:
        tf_trainer.__init__ = _trainer_init_registering
    if tf_trainer.make_train_function is not _make_checked_train_function:
        tf_trainer.make_train_function = _make_checked_train_function
    if tf_trainer.train_step is not _checked_train_step:
        tf_trainer.train_step = _checked_train_step
    if tf_trainer._maybe_symbolic_build is not _symbolic_build_distributed_safe:
        tf_trainer._maybe_symbolic_build = _symbolic_build_distributed_safe
