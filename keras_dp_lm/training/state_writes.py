"""Refusing a training pass that writes model variables.

State updated from a batch (moving statistics, RNN state, caches, a weight
assigned from data) carries that batch's data into later steps outside any
clipped gradient. :func:`without_state_updates` runs the training pass and
refuses it if it wrote any model variable other than a random seed state
(:func:`seed_states`), which depends on no data.
"""

import tensorflow as tf

from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.errors import PrivacyRefusalError

_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
              "ResourceStridedSliceAssign")
# Ops whose functions run nested graphs: (function attributes, offset of the
# nested graph's first input among the op's inputs).
_NESTED_CALLS = {
    "While": (("cond", "body"), 0), "StatelessWhile": (("cond", "body"), 0),
    "If": (("then_branch", "else_branch"), 1), "StatelessIf": (("then_branch", "else_branch"), 1),
    "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0),
}


def _is_write(op):
    return op.type in _WRITE_OPS or op.type.startswith("ResourceScatter")


def _written_variables(graph, ops, variable_of):
    """Variables written by ``ops`` or any graph nested in them (while / cond
    bodies, function calls), following resource handles into nested graphs.

    ``variable_of`` maps a resource tensor's ``ref()`` to its variable.
    """
    written = []
    for op in ops:
        if _is_write(op) and op.inputs and op.inputs[0].ref() in variable_of:
            written.append(variable_of[op.inputs[0].ref()])
        attrs, offset = _NESTED_CALLS.get(op.type, ((), 0))
        for attr in attrs:
            try:
                body = graph._get_function(op.get_attr(attr).name).graph  # TF, not Keras
            except (AttributeError, ValueError, TypeError):
                continue
            inner = {}
            for i, tensor in enumerate(body.inputs):
                j = i + offset
                if j < len(op.inputs) and op.inputs[j].ref() in variable_of:
                    inner[tensor.ref()] = variable_of[op.inputs[j].ref()]
            for external, internal in getattr(body, "captures", ()):
                if external.ref() in variable_of:
                    inner[internal.ref()] = variable_of[external.ref()]
            if inner:
                written += _written_variables(body, body.get_operations(), inner)
    return written


def seed_states(model):
    """The random seed states of ``model``'s layers (dropout's), as variables."""
    states, seen = [], set()
    for layer in internals.flatten_layers(model, include_self=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator.state) not in seen:
                seen.add(id(generator.state))
                states.append(generator.state)
    return states


def _seed_state_ids(model):
    return {id(state) for state in seed_states(model)}


def without_state_updates(model, forward):
    """Run ``forward()`` (the training forward/backward) and refuse if it
    wrote a model variable (trainable or not) other than a random seed state.

    Checked on the traced graph (``fit`` and ``make_private`` trace the
    step), including graphs nested in it (``tf.while_loop`` / ``tf.cond``
    bodies, e.g. the exact engine's per-example loop, and function calls),
    for every variable-writing op (assign, scatter, strided-slice assign); in
    eager mode, by comparing the variables' values (and restoring them).
    """
    seeds = _seed_state_ids(model)
    # trainable variables too: a forward pass that assigns one (from data)
    # changes the weights outside the clipped, noised update.
    watched = [v for v in model.variables if id(v) not in seeds]
    if not watched:
        return forward()
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly():
        before = [tf.identity(v.value) for v in watched]
        result = forward()
        written = []
        for v, b in zip(watched, before):
            if not bool(tf.reduce_all(tf.equal(v.value, b))):
                written.append(v)
                v.assign(b)  # undone: the batch's data must not stay in the model
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
        written = _written_variables(graph, graph.get_operations()[start:], placeholders)
    if written:
        names = ", ".join(sorted({getattr(v, "path", v.name) for v in written}))
        raise PrivacyRefusalError(
            f"The training forward pass writes model variables ({names}). "
            "State updated from a batch carries that batch's data into later "
            "steps outside any clipped gradient (e.g. moving statistics, RNN "
            "state, caches). Freeze or remove the layer that writes it, or make "
            "it stateless.")
    return result
