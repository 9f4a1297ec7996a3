"""Fast-clipping rules for Layer-, Group- and RMS normalization (Keras, KerasHub, Llama,
Gemma, and the RMS norms of Gemma3, Mistral, Mixtral, Qwen, Qwen3, Phi3, GPT-OSS, T5)."""

import ast
import functools
import inspect
import textwrap

import keras
import tensorflow as tf

from keras_dp_lm._keras_internals import keras_hub_layer
from keras_dp_lm.clipping._common import original_call
from keras_dp_lm.clipping.contributions import PerExample
from keras_dp_lm.clipping.registry import register_clipping_rule


def _norm_axes(axis, rank):
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return sorted(a % rank for a in axes)


def _scale_grad(g, xhat, axes):
    """Per-example gradient of an elementwise scale over ``axes``: sum of g*xhat."""
    other = [a for a in range(1, g.shape.rank) if a not in axes]
    prod = tf.cast(g, xhat.dtype) * xhat
    return tf.reduce_sum(prod, axis=other) if other else prod


def _shift_grad(g, axes):
    other = [a for a in range(1, g.shape.rank) if a not in axes]
    return tf.reduce_sum(g, axis=other) if other else g


class _AffineNorm:
    """Shared by normalisations with a ``gamma`` scale and ``beta`` offset
    applied to a normalised ``xhat``: their tiny per-example gradients are
    ``sum(g * xhat)`` and ``sum(g)`` over every axis but the normalised ones."""

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [v for v in (layer.gamma, layer.beta) if v is not None]

    @staticmethod
    def static_method(layer, var, T, B):
        return "instantiate"

    @staticmethod
    def add_contributions(rec, layer, call, xhat, axes):
        if layer.gamma is not None:
            rec.add(PerExample(layer.gamma, call, lambda g: _scale_grad(g, xhat(), axes)))
        if layer.beta is not None:
            rec.add(PerExample(layer.beta, call, lambda g: _shift_grad(g, axes)))


@register_clipping_rule(keras.layers.LayerNormalization)
class _LayerNormRule(_AffineNorm):
    name = "LayerNormalization"

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = original_call(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            axes = _norm_axes(layer.axis, x.shape.rank)
            if 0 in axes:
                rec.mark_layer_bad(layer, _LayerNormRule, "normalises over the batch axis")
                return y
            eps, rms = layer.epsilon, layer.rms_scaling

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                mean, var = tf.nn.moments(x32, axes=axes, keepdims=True)
                if rms:
                    return x32 * tf.math.rsqrt(var + eps)
                return (x32 - mean) * tf.math.rsqrt(var + eps)

            _AffineNorm.add_contributions(rec, layer, call, xhat, axes)
        return y


@register_clipping_rule(keras.layers.GroupNormalization)
class _GroupNormRule(_AffineNorm):
    """keras.layers.GroupNormalization: ``y = xhat * gamma + beta`` with
    ``xhat`` normalised over each example's channel groups (and all other
    non-batch axes); gamma's per-example gradient is ``sum(g * xhat)``,
    beta's ``sum(g)``, over every axis but the channel axis."""

    name = "GroupNormalization"

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = original_call(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            rank = x.shape.rank
            axis = layer.axis % rank
            channels = x.shape[axis]
            if axis == 0 or channels is None or channels % layer.groups:
                rec.mark_layer_bad(layer, _GroupNormRule,
                                   "normalises over the batch axis or an unknown channel axis")
                return y
            groups, eps = layer.groups, layer.epsilon

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                shape = tf.shape(x32)
                grouped = tf.concat([shape[:axis], [groups, channels // groups],
                                     shape[axis + 1:]], axis=0)
                xg = tf.reshape(x32, grouped)
                axes = [a for a in range(1, rank + 1) if a != axis]   # all but the group axis
                mean, var = tf.nn.moments(xg, axes=axes, keepdims=True)
                return tf.reshape((xg - mean) * tf.math.rsqrt(var + eps), shape)

            _AffineNorm.add_contributions(rec, layer, call, xhat, [axis])
        return y


class _RMSNormRule:
    """LlamaLayerNorm (KerasHub Llama), keras.layers.RMSNormalization and
    keras_hub.layers.RMSNormalization: y = x * rsqrt(mean(x^2) + eps) * scale;
    KerasHub Gemma's RMSNormalization: y = x * rsqrt(mean(x^2) + eps) * (1 + scale)
    (the same per-example gradient of ``scale``, ``sum(g * xhat)``)."""

    name = "RMSNorm"

    @staticmethod
    def _kind(layer):
        t = type(layer).call
        llama = keras_hub_layer("LlamaLayerNorm")
        if llama is not None and t is llama.call:
            return "llama"
        krms = getattr(keras.layers, "RMSNormalization", None)
        if krms is not None and t is krms.call:
            return "keras"
        hrms = keras_hub_layer("RMSNormalization")
        if hrms is not None and t is hrms.call:
            return "hub"
        gemma = keras_hub_layer("GemmaRMSNormalization")
        if gemma is not None and t is gemma.call:
            return "gemma"
        return None

    @staticmethod
    def matches(layer):
        return _RMSNormRule._kind(layer) is not None

    @staticmethod
    def variables(layer):
        return [layer.scale]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = original_call(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            kind = _RMSNormRule._kind(layer)
            if kind in ("llama", "gemma"):
                axes, eps = [x.shape.rank - 1], layer.epsilon
            elif kind == "keras":
                axes = _norm_axes(layer.axis, x.shape.rank)
                eps = layer.epsilon if layer.epsilon is not None else keras.config.epsilon()
            else:
                axes, eps = [x.shape.rank - 1], 1e-6
            if 0 in axes:
                rec.mark_bad(layer.scale, "normalises over the batch axis")
                return y

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                ms = tf.reduce_mean(tf.square(x32), axis=axes, keepdims=True)
                return x32 * tf.math.rsqrt(ms + eps)

            rec.add(PerExample(layer.scale, call,
                                lambda g: _scale_grad(g, xhat(), axes)))
        return y

    @staticmethod
    def static_method(layer, var, T, B):
        return "instantiate"


if hasattr(keras.layers, "RMSNormalization"):
    register_clipping_rule(keras.layers.RMSNormalization)(_RMSNormRule)


# The ``call`` bodies that _CheckedRMSNormRule describes, as KerasHub 0.32 writes
# them. Each computes ``y = xhat * s`` with ``xhat = x * rsqrt(mean(x^2) + epsilon)``
# over the last axis and ``s`` the layer's scale variable, or ``1 + scale``
# (Gemma3): either way ``dy / dscale = xhat``, so the per-example gradient of
# the scale is ``sum(g * xhat)`` over every axis but the last.
_RMS_CALL_FORMS = {
    # Mistral, Mixtral, Qwen (Qwen2), QwenMoe, Phi3, GPT-OSS
    "scale": ("scale", '''
def call(self, x):
    x = ops.cast(x, "float32")
    var = ops.mean(ops.power(x, 2), axis=-1, keepdims=True)
    x = x * ops.rsqrt(var + self.epsilon)
    return ops.cast(x * self.scale, self.compute_dtype)
'''),
    # Qwen3, Qwen3Moe (also used per head, on [..., head_dim])
    "scale, input dtype": ("scale", '''
def call(self, x):
    input_dtype = x.dtype
    x = ops.cast(x, "float32")
    var = ops.mean(ops.power(x, 2), axis=-1, keepdims=True)
    x = x * ops.rsqrt(var + self.epsilon)
    return ops.cast(x * self.scale, input_dtype)
'''),
    # Gemma3 (the same as Gemma's): 1 + scale
    "one plus scale": ("scale", '''
def call(self, x):
    x = ops.cast(x, "float32")
    scale = ops.cast(self.scale, "float32")
    var = ops.mean(ops.square(x), axis=-1, keepdims=True)
    normed_inputs = x * ops.reciprocal(ops.sqrt(var + self.epsilon))
    normed_inputs = normed_inputs * (1 + scale)
    return ops.cast(normed_inputs, self.compute_dtype)
'''),
    # T5: in the input's dtype, variable `weight`
    "weight": ("weight", '''
def call(self, hidden_states):
    variance = ops.mean(ops.square(hidden_states), axis=-1, keepdims=True)
    hidden_states = hidden_states * ops.rsqrt(variance + self.epsilon)
    return self.weight * hidden_states
'''),
}


def _syntax(source):
    """The syntax tree of one function's source, without its docstring, name
    and decorators: equal for two sources that differ only in comments and
    layout."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(
            getattr(body[0], "value", None), ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    node.body, node.name, node.decorator_list = body, "call", []
    return ast.dump(node)


_FORM_SYNTAX = {}


@functools.lru_cache(maxsize=None)
def _call_form(call):
    """The name of the form in ``_RMS_CALL_FORMS`` that the function ``call``
    has, or None (its source unreadable, or any other computation)."""
    if not _FORM_SYNTAX:
        _FORM_SYNTAX.update({_syntax(src): name for name, (_, src) in _RMS_CALL_FORMS.items()})
    try:
        syntax = _syntax(inspect.getsource(call))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return _FORM_SYNTAX.get(syntax)


class _CheckedRMSNormRule:
    """The RMS norms of single KerasHub model families (Gemma3, Mistral, Mixtral,
    Qwen, QwenMoe, Qwen3, Qwen3Moe, Phi3, GPT-OSS, T5): ``y = xhat * scale`` or
    ``xhat * (1 + scale)``, ``xhat = x * rsqrt(mean(x^2) + epsilon)`` over the
    last axis.

    Each class is registered by name, and a layer is matched only while its
    class's ``call`` is, as a syntax tree, one of the forms in
    ``_RMS_CALL_FORMS`` (the ones read in KerasHub 0.32): a KerasHub version
    that computes anything else there gets exact per-example gradients.
    """

    name = "RMSNorm (source-checked)"

    @staticmethod
    def _variable(layer):
        form = _call_form(type(layer).call)
        if form is None:
            return None
        var = getattr(layer, _RMS_CALL_FORMS[form][0], None)
        return var if isinstance(var, keras.Variable) and var.shape.rank == 1 else None

    @staticmethod
    def matches(layer):
        return _CheckedRMSNormRule._variable(layer) is not None

    @staticmethod
    def variables(layer):
        return [_CheckedRMSNormRule._variable(layer)]

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        y = original_call(layer)(inputs, *args, **kwargs)
        call = rec.new_call(layer, y)
        if call is not None:
            x = tf.convert_to_tensor(inputs)
            axes, eps = [x.shape.rank - 1], layer.epsilon
            var = _CheckedRMSNormRule._variable(layer)
            if x.shape.rank < 2 or x.shape[-1] != var.shape[0]:
                rec.mark_bad(var, "normalises over the batch axis or a mismatched last axis")
                return y

            def xhat(x=x):
                x32 = tf.cast(x, tf.float32) if x.dtype != tf.float64 else x
                ms = tf.reduce_mean(tf.square(x32), axis=axes, keepdims=True)
                return x32 * tf.math.rsqrt(ms + eps)

            rec.add(PerExample(var, call, lambda g: _scale_grad(g, xhat(), axes)))
        return y

    @staticmethod
    def static_method(layer, var, T, B):
        return "instantiate"


_CHECKED_RMS_NORMS = (
    "Gemma3RMSNormalization", "MistralLayerNormalization", "MixtralLayerNormalization",
    "QwenLayerNorm", "QwenMoeLayerNorm", "Qwen3LayerNorm", "Qwen3MoeLayerNorm",
    "Phi3LayerNorm", "GptOssLayerNormalization", "T5LayerNorm")


def register_keras_hub_rules(keras_hub_layer):
    """Register this module's rules for KerasHub's layer classes (``keras_hub_layer``:
    :func:`keras_dp_lm._keras_internals.keras_hub_layer`)."""
    for name in ("LlamaLayerNorm", "RMSNormalization", "GemmaRMSNormalization"):
        layer_class = keras_hub_layer(name)
        if layer_class is not None:
            register_clipping_rule(layer_class)(_RMSNormRule)
    for name in _CHECKED_RMS_NORMS:
        layer_class = keras_hub_layer(name)
        if layer_class is not None:
            register_clipping_rule(layer_class)(_CheckedRMSNormRule)
