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
  activations (see :mod:`keras_dp_lm.training.losses`).

Random-number state (dropout's seed generators) is written too, but it
depends on no data and is allowed.
"""

import keras
import tensorflow as tf

from keras_dp_lm.training import keras_internals as internals

_MIXING_LAYERS = tuple(getattr(keras.layers, name) for name in ("MixUp", "CutMix")
                       if hasattr(keras.layers, name))
_NORMALIZATIONS = tuple(getattr(keras.layers, name) for name in (
    "LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization")
    if hasattr(keras.layers, name))


def _axes(axis):
    return axis if isinstance(axis, (list, tuple)) else [axis]


def check_model(model):
    """Raise ``ValueError`` if ``model`` has a layer the DP step cannot make private."""
    for layer in internals.flatten_layers(model):
        name = f"Layer '{layer.name}' ({type(layer).__name__})"
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"{name} normalises each example with statistics of the whole "
                "batch: one example then changes every other example's gradient, "
                "so per-example clipping bounds nothing. Replace it with "
                "LayerNormalization or GroupNormalization, or freeze it "
                "(layer.trainable = False).")
        if _MIXING_LAYERS and isinstance(layer, _MIXING_LAYERS):
            raise ValueError(
                f"{name} mixes examples of a batch into each other, so one "
                "example reaches other examples' gradients. Apply it outside the "
                "model to public data only, or remove it.")
        if isinstance(layer, _NORMALIZATIONS) and 0 in _axes(getattr(layer, "axis", -1)):
            raise ValueError(
                f"{name} normalises over axis 0, the batch axis, which mixes "
                "examples. Normalise over feature axes only.")
        if getattr(layer, "stateful", False) and isinstance(layer, keras.layers.RNN):
            raise ValueError(
                f"{name} has stateful=True: its state carries one batch's data "
                "into the next batches' forward passes, outside any clipped "
                "gradient. Use stateful=False (pass initial states explicitly).")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"{name} has an activity_regularizer: a loss on activations is "
                "not part of any single example's loss under Keras's batch "
                "reduction. Remove it (weight regularizers are fine).")


_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def _seed_state_ids(model):
    ids = set()
    for layer in internals.flatten_layers(model, include_self=True):
        for generator in getattr(layer, "_seed_generators", ()):
            ids.add(id(generator.state))
    return ids


def without_state_updates(model, forward):
    """Run ``forward()`` (the training forward/backward) and refuse if it
    wrote a non-trainable variable other than a random seed state.

    Checked on the traced graph (``fit`` and ``make_private`` trace the
    step); in eager mode, by comparing the variables' values.
    """
    seeds = _seed_state_ids(model)
    watched = [v for v in model.non_trainable_variables if id(v) not in seeds]
    if not watched:
        return forward()
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly():
        before = [tf.identity(v.value) for v in watched]
        result = forward()
        written = [v for v, b in zip(watched, before)
                   if not bool(tf.reduce_all(tf.equal(v.value, b)))]
    else:
        start = len(graph.get_operations())
        result = forward()
        handles = {}
        for v in watched:
            inner = getattr(v, "_value", v)
            handles[id(getattr(inner, "handle", inner))] = v
        placeholders = {}
        for external, internal in getattr(graph, "captures", ()):
            if id(external) in handles:
                placeholders[internal.ref()] = handles[id(external)]
        written = []
        for op in graph.get_operations()[start:]:
            if op.type in _WRITE_OPS and op.inputs and op.inputs[0].ref() in placeholders:
                written.append(placeholders[op.inputs[0].ref()])
    if written:
        names = ", ".join(sorted({getattr(v, "path", v.name) for v in written}))
        raise ValueError(
            f"The training forward pass writes non-trainable state ({names}). "
            "State updated from a batch carries that batch's data into later "
            "steps outside any clipped gradient (e.g. moving statistics, RNN "
            "state, caches). Freeze or remove the layer that writes it, or make "
            "it stateless.")
    return result
