"""Recording forward passes: the plan of covered layers and the call wrappers.

While :func:`keras_dp_lm.clipping.fast_clipped_sum` runs the loss, every
covered layer's ``call`` is replaced (per instance, thread-safely, restored on
exit) by its rule's recording forward pass, which computes the same output and
records the contributions the ghost core needs. A covered layer called inside
another covered layer's call or inside a control-flow body is marked "bad" and
its variables fall back to exact per-example gradients.
"""

import collections
import contextlib
import threading

import tensorflow as tf

from keras_dp_lm._keras_internals import flatten_layers
from keras_dp_lm.clipping._common import _layer_desc
from keras_dp_lm.clipping._common import original_call
from keras_dp_lm.clipping._common import _var_path
from keras_dp_lm.clipping.contributions import _Call
from keras_dp_lm.clipping.registry import _rule_for

class _Plan:
    rule_for = staticmethod(_rule_for)   # for rules that check their sub-layers

    def __init__(self, model):
        self.trainable = list(model.trainable_variables)
        t_ids = {id(v) for v in self.trainable}
        self.layers = {}      # id(layer) -> (layer, rule)
        self.covered = {}     # id(var) -> (layer, rule)
        owners = {}
        for layer in flatten_layers(model, include_self=True):
            for v in getattr(layer, "_trainable_variables", []):
                owners.setdefault(id(v), layer)
            rule = _rule_for(layer)
            if rule is None:
                continue
            vs = [v for v in rule.variables(layer) if id(v) in t_ids]
            if vs:
                self.layers[id(layer)] = (layer, rule)
                for v in vs:
                    self.covered[id(v)] = (layer, rule)
        self.owners = owners
        self.uncovered = [v for v in self.trainable if id(v) not in self.covered]

    def describe(self, variables):
        out = collections.OrderedDict()
        for v in variables:
            layer = self.owners.get(id(v))
            key = _layer_desc(layer) if layer is not None else "(no layer)"
            out.setdefault(key, []).append(_var_path(v))
        return out


class _Recorder:
    def __init__(self, plan, tape, detect):
        self.plan, self.tape, self.detect = plan, tape, detect
        self.calls, self.contribs, self.bad = [], [], {}
        self.depth = 0
        self.eager = tf.executing_eagerly()
        self.graph = None if self.eager else tf.compat.v1.get_default_graph()

    def foreign_context(self):
        """A reason when the current call runs in another graph than the
        recording (a ``tf.while_loop`` / ``tf.cond`` body, e.g. an RNN cell):
        its tensors cannot be watched from here."""
        if tf.executing_eagerly() != self.eager or (
                not self.eager and tf.compat.v1.get_default_graph() is not self.graph):
            return "called inside a control-flow body (e.g. an RNN cell or tf.cond)"
        return None

    @contextlib.contextmanager
    def sublayer_calls(self):
        """Record the sub-layer calls a rule's ``forward`` makes as if made at
        top level, each by its own rule (e.g. a head calling its Dense).

        Only for rules whose own variables are not read by those calls: the
        calling wrapper has already paused the tape that detects variable
        reads outside covered calls, so the sub-layers must not pause it again.
        """
        depth, detect = self.depth, self.detect
        self.depth, self.detect = 0, None
        try:
            yield
        finally:
            self.depth, self.detect = depth, detect

    def mark_layer_bad(self, layer, rule, reason):
        for v in rule.variables(layer):
            self.mark_bad(v, reason)

    def new_call(self, layer, z):
        if self.depth != 1:
            return None
        self.tape.watch(z)
        call = _Call(layer, z)
        self.calls.append(call)
        return call

    def add(self, contrib):
        if id(contrib.var) in self.plan.covered:
            self.contribs.append(contrib)

    def mark_bad(self, var, reason):
        if id(var) in self.plan.covered:
            self.bad[id(var)] = reason


_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()
_INSTALLED = {}   # id(layer) -> [layer, count]


def _active():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _make_wrapper(layer):
    def call(*args, **kwargs):
        rec = _active()
        entry = rec.plan.layers.get(id(layer)) if rec is not None else None
        if entry is None:
            return original_call(layer)(*args, **kwargs)
        reason = ("called inside another covered layer's computation (e.g. as its "
                  "activation)" if rec.depth > 0 else rec.foreign_context())
        if reason is not None:
            # The rule describes this layer's own call only: fall back to exact
            # per-example gradients for its variables.
            rec.mark_layer_bad(layer, entry[1], reason)
            return original_call(layer)(*args, **kwargs)
        rec.depth += 1
        try:
            ctx = rec.detect.stop_recording() if rec.detect is not None else contextlib.nullcontext()
            with ctx:
                return entry[1].forward(layer, rec, *args, **kwargs)
        finally:
            rec.depth -= 1
    call._keras_dp_lm_wrapper = True
    return call


@contextlib.contextmanager
def _recording(rec):
    """Install recording wrappers on the plan's layers (thread-safe, restored on exit)."""
    layers = [layer for layer, _ in rec.plan.layers.values()]
    with _INSTALL_LOCK:
        for layer in layers:
            entry = _INSTALLED.get(id(layer))
            if entry is None:
                object.__setattr__(layer, "call", _make_wrapper(layer))
                _INSTALLED[id(layer)] = [layer, 1]
            else:
                entry[1] += 1
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.pop()
        with _INSTALL_LOCK:
            for layer in layers:
                entry = _INSTALLED[id(layer)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _INSTALLED[id(layer)]
                    if getattr(layer.__dict__.get("call"), "_keras_dp_lm_wrapper", False):
                        object.__delattr__(layer, "call")
