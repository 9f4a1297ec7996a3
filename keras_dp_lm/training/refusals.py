"""What the DP step refuses, and why: models whose examples can influence each other.

Per-example clipping bounds one example's influence only if each example's
loss depends on that example alone and nothing carries one example's data
into another example's gradient or into the weights outside the clipped sum.
These break that, so the DP step refuses them before any update:

* layers that mix examples of a batch in training: ``BatchNormalization``
  (trainable), ``MixUp``, ``CutMix``, normalisation over the batch axis;
* state that crosses examples or steps: RNN layers with ``stateful=True``,
  and more generally any non-trainable variable that the forward pass writes
  in training (moving statistics, caches, counters), found when the step is
  traced;
* data-dependent losses: activity regularizers and ``add_loss`` on
  activations (see :mod:`keras_dp_lm.training.losses`);
* for fast clipping, which takes every example's gradient from one batched
  pass, any model or loss in which one example's per-example loss or gradient
  depends on another example (a ``Lambda`` subtracting the batch mean,
  attention across the batch axis, an in-batch contrastive loss, a
  straight-through estimator over a batch statistic): found by
  :func:`examples_independent` on the first batch, a test and not a proof
  (``clipping="exact"`` differentiates each example alone and is not
  affected).

Random-number state (dropout's seed generators) is written too, but it
depends on no data and is allowed.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dp_lm.clipping.exact import tf_variable
from keras_dp_lm.clipping.interface import clip_factors
from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.training.state_writes import seed_states
from keras_dp_lm.training.state_writes import without_state_updates
from keras_dp_lm.errors import PrivacyRefusalError

_MIXING_LAYERS = tuple(getattr(keras.layers, name) for name in ("MixUp", "CutMix")
                       if hasattr(keras.layers, name))
_NORMALIZATIONS = tuple(getattr(keras.layers, name) for name in (
    "LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization")
    if hasattr(keras.layers, name))


def _axes(axis):
    return axis if isinstance(axis, (list, tuple)) else [axis]


def check_model(model: keras.Model) -> None:
    """Raise ``ValueError`` if ``model`` has a layer the DP step cannot make private."""
    _check_something_trains(model)
    for layer in internals.flatten_layers(model):
        name = f"Layer '{layer.name}' ({type(layer).__name__})"
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise PrivacyRefusalError(
                f"{name} normalises each example with statistics of the whole "
                "batch: one example then changes every other example's gradient, "
                "so per-example clipping bounds nothing. Replace it with "
                "LayerNormalization or GroupNormalization, or freeze it "
                "(layer.trainable = False).")
        if _MIXING_LAYERS and isinstance(layer, _MIXING_LAYERS):
            raise PrivacyRefusalError(
                f"{name} mixes examples of a batch into each other, so one "
                "example reaches other examples' gradients. Apply it outside the "
                "model to public data only, or remove it.")
        if isinstance(layer, _NORMALIZATIONS) and 0 in _axes(getattr(layer, "axis", -1)):
            raise PrivacyRefusalError(
                f"{name} normalises over axis 0, the batch axis, which mixes "
                "examples. Normalise over feature axes only.")
        if getattr(layer, "stateful", False) and isinstance(layer, keras.layers.RNN):
            raise PrivacyRefusalError(
                f"{name} has stateful=True: its state carries one batch's data "
                "into the next batches' forward passes, outside any clipped "
                "gradient. Use stateful=False (pass initial states explicitly).")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise PrivacyRefusalError(
                f"{name} has an activity_regularizer: a loss on activations is "
                "not part of any single example's loss under Keras's batch "
                "reduction. Remove it (weight regularizers are fine).")


def _check_something_trains(model):
    """Refuse a built model with no trainable variable (before Keras fails on
    it inside ``fit``); name LoRA targets when ``enable_lora`` found none."""
    if not getattr(model, "built", False) or model.trainable_variables:
        return
    for layer in internals.flatten_layers(model, include_self=True):
        if internals.keras_hub_lora_found_nothing(layer):
            targets = []
            for sub in internals.flatten_layers(layer):
                if (hasattr(sub, "enable_lora") and sub.weights
                        and not isinstance(sub, keras.layers.Embedding)
                        and sub.name not in targets):
                    targets.append(sub.name)
            # attention projections first: the usual LoRA targets
            targets.sort(key=lambda n: 0 if "query" in n or "qkv" in n else
                         1 if "value" in n or "attention" in n else 2)
            rank = getattr(layer, "_lora_rank", "rank")
            raise PrivacyRefusalError(
                f"{type(layer).__name__} '{layer.name}': enable_lora({rank}) found no layer "
                f"named {', '.join(layer.default_lora_layer_names())}, so no layer has LoRA "
                "adapters, and it froze every weight: the model has no trainable variable "
                "and a DP step would train nothing. Pass the names of this backbone's "
                f"Dense / EinsumDense layers to enable LoRA on, e.g. "
                f"backbone.enable_lora({rank}, target_layer_names={targets[:2]!r}) "
                f"(its layers: {', '.join(targets)}).")
    raise PrivacyRefusalError(
        f"Model '{model.name}' has no trainable variable: a DP step would train nothing "
        "(and count privacy for it). Unfreeze the layers to train (layer.trainable = True, "
        "or backbone.enable_lora(rank)) and compile again.")


def _probe_rows(batch, mask, rows):
    """The first ``rows`` slots of ``batch`` and ``mask`` (all when ``None``)."""
    if rows is None:
        return batch, mask
    cut = lambda t: t if t is None or t.shape.rank == 0 else t[:rows]  # noqa: E731
    return tf.nest.map_structure(cut, batch), mask[:rows]


def _gather_rows(structure, indices):
    """Every tensor of ``structure`` with its slots gathered at ``indices``."""
    return tf.nest.map_structure(
        lambda t: t if t is None or t.shape.rank == 0 else tf.gather(t, indices), structure)


# Gradient of a sum vs sum of gradients: in bfloat16 the two round differently
# (~4e-3); a backward pass that is not linear in the upstream gradient (a
# custom gradient normalised over the batch) is off by O(1).
_LINEARITY_RTOL = 3e-2
# One example's gradient in the batch and among copies of itself: the same
# per-row arithmetic, so equal up to summation order.
_ISOLATION_GRADIENT_RTOL = 1e-3
# Rows of the probe's training passes (they differentiate and hold activations).
_TRAINING_ROWS = 8
# Fast clipping's per-example gradient against the true one: different
# arithmetic (Gram matrices, per-layer sums), ~1e-6 apart in float32, up to
# ~1e-2 when the layers compute in bfloat16 / float16.
_ENGINE_RTOL_FLOAT32 = 1e-3
_ENGINE_RTOL_LOW_PRECISION = 3e-2
# Rows the engine check runs on: its pass records every covered layer's
# input and output gradient on top of the activations (SmolLM2-135M LoRA,
# batch 16: +50 MB of peak RSS at 8 rows, none measurable at 4).
_ENGINE_ROWS = 4


def _pass_rows(n):
    """Index vectors ``[n]`` of the probe's batches: the batch, example 0
    replaced by example 1, a batch of copies of example 0, of example 1."""
    identity = tf.range(n)
    return {"batch": identity, "swapped": tf.where(identity == 0, 1, identity),
            "copies 0": tf.zeros_like(identity), "copies 1": tf.ones_like(identity)}


def _norm(tensors):
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))
                             for t in tensors]))


def independence_probe(losses_fn, batch, mask, rtol=1e-4, seed_states=(), variables=(),
                       rows=None, engine=None, engine_rtol=_ENGINE_RTOL_FLOAT32):
    """``(ok, meaningful)``: whether each example's loss and gradient depend on
    that example alone, and whether the probe could tell.

    ``losses_fn(batch, training) -> [B]``; the model runs on the first ``rows``
    slots of ``batch`` (all when ``None``; the step passes its micro-batch size,
    the batch size the model is trained at). Compared on the first two rows
    (``meaningful`` needs them real, finite and of different losses):

    * inference mode (dropout draws nothing): with example 0 replaced by
      example 1, every other example's loss must stay the same and example
      0's must become example 1's; and examples 0 and 1 must have the same
      loss in a batch of copies of themselves as in the batch. A layer or
      loss that mixes examples (batch statistics, a maximum or a weight
      normalised over the batch, attention or similarity across the batch)
      changes them.
    * training mode, on the first 8 of those rows (its passes differentiate
      and hold activations), with the random ``seed_states`` (dropout's)
      restored before every pass so that each pass draws the same masks:
      the same two comparisons of losses. This sees mixing that happens only
      in training (a layer subtracting the batch mean when ``training=True``). Two passes
      on the same rows must agree: randomness outside Keras's seed
      generators (``tf.random.*`` in a layer's ``call``) cannot be replayed,
      would hide such mixing, and is refused too.
    * gradients of the training pass (``variables``; fast clipping
      differentiates it): the gradient of example 0's (1's) loss must be the
      same in the batch and in the batch of its copies, and the gradient of
      the two losses' sum the sum of their gradients. This sees mixing done
      only in the backward pass (straight-through estimators over batch
      statistics, custom gradients normalised over the batch), which fast
      clipping would read as each example's own gradient.
    * the clipping ``engine`` itself (``engine(batch, mask, slot_mask,
      l2_norm_clip) -> ClippedSum``, the DP step's, run on the first 4 of
      those rows): its clipped sum of examples 0 and 1 (``slot_mask``
      selecting them, clipped at the smaller of their true norms, so their
      factors differ) must be the same combination of their true gradients,
      and its norms of each their true gradients' norms, over the variables
      its fast rules read, to ``engine_rtol``. This sees a backward pass that
      mixes examples without changing any total gradient (a straight-through
      estimator on a branch equal for every example), which fast clipping
      reads row by row, and a clipping rule registered for a layer that it
      does not describe.

    A test, not a proof: the README ("Fails closed") lists what it cannot see.
    """
    batch, mask = _probe_rows(batch, mask, rows)
    if mask.shape[0] is not None and mask.shape[0] < 2:
        return _passed_untold()  # one example: nothing to mix with

    def close(a, b, real):
        tolerance = rtol * (tf.abs(a) + 1e-6)
        return tf.reduce_all(tf.where(real, tf.abs(b - a) <= tolerance, True))

    def compare():
        rows = _pass_rows(tf.shape(mask)[0])
        losses = _run_passes(
            lambda part: losses_fn(part, False), batch,
            tf.stack([rows[name] for name in ("batch", "swapped", "copies 0", "copies 1")]))
        expected = tf.concat([losses[0, 1:2], losses[0, 1:]], axis=0)
        tolerance = rtol * (tf.abs(expected) + 1e-6)
        # Only real slots with finite losses are compared: a NaN / inf example
        # (dropped by the clipping) must not refuse the run, a data-dependent
        # outcome that would itself reveal it.
        finite = tf.math.is_finite(expected) & tf.math.is_finite(losses[1])
        real = (tf.cast(mask, tf.float32) > 0) & finite
        both_real = real[0] & real[1]
        alone = tf.stack([losses[2, 0], losses[3, 1]])
        same = close(expected, losses[1], real) & close(losses[0, :2], alone, real[:2])
        # a meaningful probe: slot 0 and slot 1 differ in loss
        distinct = both_real & (tf.abs(losses[0, 0] - losses[0, 1]) > tolerance[0])
        ok = tf.logical_or(same, tf.logical_not(both_real))
        # The training passes differentiate, and hold activations: on the
        # first rows only (SmolLM2-135M LoRA, batch 16: ~260 MB less peak RSS
        # at 8 rows than at all 16). A row with a non-finite
        # loss is replaced by a copy of row 0 there: its NaN would make every
        # gradient NaN (0 * NaN in the weight gradient).
        train_batch, train_mask = _probe_rows(batch, mask, _TRAINING_ROWS)
        usable = (real & tf.math.is_finite(losses[0]))[:_TRAINING_ROWS]
        keep = tf.where(usable, tf.range(tf.shape(usable)[0]), 0)
        train_ok, train_told = _training_independent(
            losses_fn, _gather_rows(train_batch, keep), tf.gather(train_mask, keep), close,
            seed_states, [tf_variable(v) for v in variables], compared=both_real,
            engine=engine, engine_rtol=engine_rtol)
        return ok & train_ok, distinct & train_told

    return tf.cond(tf.shape(mask)[0] >= 2, compare, _passed_untold)


def _run_passes(forward, batch, indices, variables=(), plan=None):
    """Run ``forward`` on ``batch`` gathered at each row of ``indices`` ``[K, n]``,
    one pass after another in a ``tf.while_loop``: the model is traced once
    (not K times: on SmolLM2-135M each traced copy of a pass cost ~250 MB of
    peak memory)
    and one pass's activations are held at a time, as in a training step.

    Returns ``losses [K, n]`` (float32); with ``variables``, ``(losses, diffs,
    scales, references)``: pass ``k`` also differentiates ``sum(weights[k] *
    losses)`` (``plan = (weights, keep, refs)``), keeps that gradient as
    reference 0 or 1 when ``keep[k]`` is 0 or 1, and compares it with
    ``refs[k] . (reference 0, reference 1)``: ``diffs [K]`` is the norm of the
    difference, ``scales [K]`` the sum of the two sides' norms and
    ``references`` the kept gradients ``(reference 0, reference 1)``.
    """
    num = indices.shape[0]
    rows_of = lambda k: _gather_rows(batch, indices[k])  # noqa: E731
    losses_out = tf.TensorArray(tf.float32, size=num, element_shape=tf.TensorShape([None]))
    if not variables:
        def body(k, out):
            return k + 1, out.write(k, tf.cast(forward(rows_of(k)), tf.float32))
        _, losses_out = tf.while_loop(lambda k, _: k < num, body, (0, losses_out),
                                      parallel_iterations=1)
        return losses_out.stack()

    weights, keep, refs = (tf.constant(part, tf.float32) for part in plan)
    zeros = [tf.zeros(v.shape, tf.float32) for v in variables]
    stats = [tf.TensorArray(tf.float32, size=num) for _ in range(2)]

    def body(k, out, diffs, scales, kept0, kept1):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            losses = tf.cast(forward(rows_of(k)), tf.float32)
            slots = tf.shape(losses)[0]
            w = tf.pad(weights[k], [[0, tf.maximum(slots - 2, 0)]])[:slots]
            target = tf.reduce_sum(tf.where(w != 0, w * losses, 0.0))
        grad = tape.gradient(target, variables,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # dense (an embedding's gradient is IndexedSlices) and float32
        grad = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grad]
        a, b = refs[k, 0], refs[k, 1]
        diff = _norm([g - a * x - b * y for g, x, y in zip(grad, kept0, kept1)])
        scale = _norm(grad) + tf.abs(a) * _norm(kept0) + tf.abs(b) * _norm(kept1)
        kept0 = [tf.where(keep[k] == 0, g, x) for g, x in zip(grad, kept0)]
        kept1 = [tf.where(keep[k] == 1, g, x) for g, x in zip(grad, kept1)]
        return (k + 1, out.write(k, losses), diffs.write(k, diff), scales.write(k, scale),
                kept0, kept1)

    _, losses_out, diffs, scales, kept0, kept1 = tf.while_loop(
        lambda k, *_: k < num, body, (0, losses_out, *stats, zeros, list(zeros)),
        parallel_iterations=1)
    return losses_out.stack(), diffs.stack(), scales.stack(), (kept0, kept1)


# The probe's training passes: (rows, gradient weights of rows 0 and 1, keep
# the gradient as reference 0 / 1 (-1: no), compare it with a * ref 0 + b * ref 1,
# to a relative tolerance).
_TRAINING_PASSES = (
    ("batch", (1, 0), 0, (0, 0), 0.0),       # example 0's gradient
    ("batch", (0, 1), 1, (0, 0), 0.0),       # example 1's (and a replay)
    ("batch", (1, 1), -1, (1, 1), _LINEARITY_RTOL),  # their sum's: the sum of theirs
    ("swapped", (0, 0), -1, (0, 0), 0.0),
    ("copies 0", (1, 0), -1, (1, 0), _ISOLATION_GRADIENT_RTOL),  # 0 among its copies
    ("copies 1", (0, 1), -1, (0, 1), _ISOLATION_GRADIENT_RTOL),
)


def _training_independent(losses_fn, batch, mask, close, seed_states, variables, compared,
                          engine=None, engine_rtol=_ENGINE_RTOL_FLOAT32):
    """The training-mode half of :func:`independence_probe`, with the
    gradient checks (fast clipping differentiates the training pass) and the
    check of the clipping ``engine``: ``(ok, told)``.

    ``compared``: examples 0 and 1 are real with finite inference losses. Then
    their training losses and gradients must be finite too, or the probe
    fails closed: a layer that is non-finite only in training on the probe's
    rows (a batch whitening without epsilon on 8 rows) or a custom gradient
    that is NaN on them would otherwise leave every batch unprobed."""
    saved = [tf.identity(state.value) for state in seed_states]

    def replayed(run):
        """``run()``, then the seed states as before it: the next pass draws
        the same dropout masks (and the probe none)."""
        result = run()
        restore = [state.assign(value) for state, value in zip(seed_states, saved)]
        tensors = [t for t in tf.nest.flatten(result) if tf.is_tensor(t)]
        with tf.control_dependencies(tensors + [r for r in restore if r is not None]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if tf.is_tensor(t) else t, result)

    def train_pass(rows):
        return replayed(lambda: tf.cast(losses_fn(rows, True), tf.float32))

    rows = _pass_rows(tf.shape(mask)[0])
    plan = [[p[i] for p in _TRAINING_PASSES] for i in (1, 2, 3)]
    indices = tf.stack([rows[p[0]] for p in _TRAINING_PASSES])
    if variables:
        losses, diffs, scales, references = _run_passes(
            train_pass, batch, indices, variables, plan)
    else:
        losses = _run_passes(train_pass, batch, indices)
    first, again, swapped_losses = losses[0], losses[1], losses[3]
    alone = tf.stack([losses[4, 0], losses[5, 1]])
    finite = (tf.math.is_finite(first) & tf.math.is_finite(again)
              & tf.math.is_finite(losses[2]) & tf.math.is_finite(swapped_losses))
    real = (tf.cast(mask, tf.float32) > 0) & finite
    others = real & (tf.range(tf.shape(real)[0]) > 0)
    pair = real[:2] & tf.math.is_finite(alone)
    # Not reproducible: the comparison cannot tell, so the probe fails closed.
    ok = (close(first, again, real) & close(first, losses[2], real)
          & close(first, swapped_losses, others) & close(first[:2], alone, pair))
    finite = tf.reduce_all(pair)
    if variables:
        tolerance = tf.constant([p[4] for p in _TRAINING_PASSES], tf.float32)
        ok = ok & tf.reduce_all(tf.where(tolerance > 0,
                                         diffs <= tolerance * scales + 1e-12, True))
        # the passes whose gradient is used (pass 3 differentiates zero)
        used = tf.constant([p[2] >= 0 or p[4] > 0 for p in _TRAINING_PASSES])
        finite = finite & tf.reduce_all(
            tf.where(used, tf.math.is_finite(diffs) & tf.math.is_finite(scales), True))
        if engine is not None:
            part, part_mask = _probe_rows(batch, tf.cast(mask, tf.float32), _ENGINE_ROWS)
            rows_01 = tf.cast(tf.range(tf.shape(part_mask)[0]) < 2, tf.float32) * part_mask
            # Clipped at the smaller of the two true norms: the two examples are
            # summed with different factors, as the step sums them (a backward
            # pass that exchanges gradient between them keeping their sum and
            # norms shows only then).
            clip = tf.maximum(tf.minimum(_norm(references[0]), _norm(references[1])), 1e-30)
            engine_ok, engine_finite = _engine_agrees(
                replayed(lambda: engine(part, part_mask, rows_01, clip)), references,
                engine_rtol, clip)
            # its references are examples 0 and 1: compared only when they are real
            ok, finite = ok & (engine_ok | ~compared), finite & engine_finite
    # Compared examples must stay finite in training: else nothing was checked,
    # and it would be so on every batch (fail closed).
    return ok & (finite | ~compared), compared & finite


def _engine_agrees(result, references, rtol, clip):
    """``(ok, finite)``: the clipping engine's ``result`` (``ClippedSum`` of
    rows 0 and 1 only, clipped at ``clip``) reads examples 0 and 1 as their
    true gradients ``references`` do: their sum with the engine's own clip
    factors, and each one's norm, over the variables fast rules read (the
    exact fallback draws its own dropout masks, one example at a time: not
    comparable, and exact)."""
    fast = [i for i, exact in enumerate(result.exact) if not exact]
    if not fast:
        return tf.constant(True), tf.constant(True)
    pick = lambda tensors: [tf.cast(tf.convert_to_tensor(tensors[i]), tf.float32)  # noqa: E731
                            for i in fast]
    grads, true_0, true_1 = pick(result.grads), pick(references[0]), pick(references[1])
    factors = clip_factors(result.norms[:2], clip)
    diff = _norm([g - factors[0] * a - factors[1] * b
                  for g, a, b in zip(grads, true_0, true_1)])
    scale = _norm(grads) + factors[0] * _norm(true_0) + factors[1] * _norm(true_1)
    norms = tf.cast(result.fast_norms[:2], tf.float32)
    true_norms = tf.stack([_norm(true_0), _norm(true_1)])
    # The engine's reading may differ from the true squared norm by its own
    # rounding allowance (which the clipping adds): |n - t| <= a / (n + t).
    slack = tf.zeros_like(norms) if result.rounding is None else (
        tf.cast(result.rounding[:2], tf.float32) / (norms + true_norms + 1e-30))
    ok = (diff <= rtol * scale + 1e-12) & tf.reduce_all(
        tf.abs(norms - true_norms) <= rtol * (norms + true_norms) + slack + 1e-12)
    finite = (tf.math.is_finite(diff) & tf.math.is_finite(scale)
              & tf.reduce_all(tf.math.is_finite(norms)))
    return ok, finite


def _passed_untold():
    """The probe's ``(ok, meaningful)`` when it has nothing to compare."""
    return tf.constant(True), tf.constant(False)


def engine_rtol(model):
    """The tolerance of the probe's engine check: float32 layers, or not."""
    low = any(getattr(layer, "compute_dtype", None) in ("bfloat16", "float16")
              for layer in internals.flatten_layers(model, include_self=True))
    return _ENGINE_RTOL_LOW_PRECISION if low else _ENGINE_RTOL_FLOAT32


def model_probe(model, losses_fn, batch, mask, rows=None, rtol=1e-4, engine=None):
    """:func:`independence_probe` of ``model``: its seed states and trainable
    variables (and ``engine``, the DP step's clipping, at the tolerance of the
    model's compute dtypes)."""
    return independence_probe(losses_fn, batch, mask, rtol, seed_states(model),
                              model.trainable_variables, rows, engine, engine_rtol(model))


def examples_independent(model, losses_fn, batch, mask, rows=None, rtol=1e-4,
                         engine=None):
    """:func:`independence_probe` inside a traced step (a bool tensor), on the
    model's trainable variables and the first ``rows`` slots.

    Once a batch with two distinct real examples has passed, later steps skip
    the probe (the model's structure does not change; a compile resets it);
    a failing probe makes the DP step refuse the batch.
    """
    state = probe_state(model)

    def probe():
        return model_probe(model, losses_fn, batch, mask, rows, rtol, engine)

    # Its passes must not write model variables either (fit's probe before the
    # step is checked the same way).
    ok, done = without_state_updates(
        model, lambda: tf.cond(state.independence_checked < 1, probe, _passed_untold))
    state.independence_checked.assign(
        tf.maximum(state.independence_checked, tf.cast(done & ok, tf.int64)))
    return ok


class ProbeState:
    """What the independence probe has established about one model (not
    saved: a reloaded or recompiled model is probed again on its first batch).

    * ``independence_checked``: 1 once a probe that could tell has passed
      (a variable: the step reads it);
    * ``probed_before_step``: the probe passed in a call of its own before the
      step, which is then traced without it.
    """

    def __init__(self):
        with tf.init_scope():
            self.independence_checked = keras.Variable(
                0, dtype="int64", trainable=False, name="dp_independence_checked",
                aggregation="only_first_replica")
        self.probed_before_step = False

    def reset(self):
        """Forget that the probe passed (a recompile may bring a loss that
        mixes examples): the next batch is probed again."""
        self.independence_checked.assign(0)
        self.probed_before_step = False


def probe_state(model):
    """The :class:`ProbeState` of ``model`` (created on first use)."""
    state = model.__dict__.get("_keras_dp_lm_probe_state")
    if state is None:
        state = model.__dict__["_keras_dp_lm_probe_state"] = ProbeState()
    return state
