"""Fast-clipping rule for KerasHub's ``MaskedLMHead`` (BERT-style masked LM heads)."""

from keras import ops

from keras_dp_lm.clipping._common import original_call
from keras_dp_lm.clipping._common import reduce_to_shape
from keras_dp_lm.clipping.contributions import PerExample
from keras_dp_lm.clipping.ghost import static_linear
from keras_dp_lm.clipping.rules.dense import _matmul_contribution
from keras_dp_lm.clipping.registry import register_clipping_rule


class _MaskedLMHeadRule:
    """``act(proj(norm(dense(take(x, positions)))) + b)``, ``proj`` being the
    tied ``token_embedding`` reversed or the head's own ``x @ W``.

    The head covers only the variables it reads itself (``_bias`` and an
    untied ``_kernel``); its Dense, LayerNormalization and tied embedding are
    called as layers and recorded by their own rules. That is sound only
    when each sub-layer is of a registered class with the class's own
    ``call`` (which reads no other layer's variable); otherwise the head's
    variables and its covered sub-layers' variables fall back to exact.
    """

    name = "MaskedLMHead"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        vs = [layer._bias]
        if layer.token_embedding is None:
            vs.append(layer._kernel)
        return vs

    @staticmethod
    def _sublayers(layer):
        subs = [layer._intermediate_dense, layer._intermediate_layer_norm]
        return subs + ([layer.token_embedding] if layer.token_embedding is not None else [])

    @staticmethod
    def forward(layer, rec, inputs, mask_positions):
        # Covered (recorded by their own rule), or of a registered class with
        # the class's computation (frozen: reading only their own variables).
        if not all(id(s) in rec.plan.layers or rec.plan.rule_for(s) is not None
                   for s in _MaskedLMHeadRule._sublayers(layer)):
            rec.mark_layer_bad(layer, _MaskedLMHeadRule,
                               "MaskedLMHead with an unregistered or modified sub-layer")
            return original_call(layer)(inputs, mask_positions)
        x = ops.take_along_axis(inputs, ops.expand_dims(mask_positions, axis=-1), axis=1)
        with rec.sublayer_calls():
            x = layer._intermediate_dense(x)
            x = layer._intermediate_layer_norm(x)
            if layer.token_embedding:
                z = layer.token_embedding(x, reverse=True)
        if not layer.token_embedding:
            z = ops.matmul(x, layer._kernel)
        z = ops.cast(z, layer.compute_dtype)
        z = z + layer._bias
        call = rec.new_call(layer, z)
        if call is not None:
            vocab = int(layer._bias.shape[0])
            rec.add(PerExample(layer._bias, call,
                                lambda g, s=(vocab,): reduce_to_shape(g, s)))
            if not layer.token_embedding:
                rec.add(_matmul_contribution(layer._kernel, call, x))
        return layer.activation(z) if layer.activation is not None else z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer._bias:
            return "instantiate"
        d, vocab = (int(s) for s in var.shape)
        return static_linear(1, d, vocab, T, B)


def register_keras_hub_rules(keras_hub_layer):
    """Register this module's rules for KerasHub's layer classes (``keras_hub_layer``:
    :func:`keras_dp_lm._keras_internals.keras_hub_layer`)."""
    head = keras_hub_layer("MaskedLMHead")
    if head is not None:
        register_clipping_rule(head)(_MaskedLMHeadRule)
