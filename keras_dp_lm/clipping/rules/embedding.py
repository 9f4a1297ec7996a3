"""Fast-clipping rules for embeddings: Embedding, ReversibleEmbedding (tied or not), KerasHub PositionEmbedding."""

import keras
import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import lora_enabled
from keras_dp_lm.clipping._common import batch_and_length
from keras_dp_lm.clipping._common import original_call
from keras_dp_lm.clipping._common import product_of
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping.contributions import Linear
from keras_dp_lm.clipping.contributions import Lookup
from keras_dp_lm.clipping.ghost import static_linear
from keras_dp_lm.clipping.rules.dense import _matmul_contribution
from keras_dp_lm.clipping.registry import register_clipping_rule


@register_clipping_rule(keras.layers.Embedding)
class _EmbeddingRule:
    """keras Embedding and (keras / KerasHub) ReversibleEmbedding, tied or not."""

    name = "Embedding"
    lora = True

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def _reversible(layer):
        rev = getattr(keras.layers, "ReversibleEmbedding", None)
        return rev is not None and isinstance(layer, rev)

    @staticmethod
    def variables(layer):
        vs = [layer._embeddings]
        if _EmbeddingRule._reversible(layer) and not layer.tie_weights:
            vs.append(layer.reverse_embeddings)
        if lora_enabled(layer):
            vs += [layer.lora_embeddings_a, layer.lora_embeddings_b]
        return vs

    @staticmethod
    def _lora_lookup(layer, rec, inputs):
        """``E[ids] + s A[ids] @ B`` (Keras's merged table, factored): lookups
        of ``E`` and ``A`` (``A[ids]`` is watched) and a thin linear ``B``."""
        ids = tf.convert_to_tensor(inputs)
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        dtype = layer.compute_dtype
        a = ops.take(ops.cast(layer.lora_embeddings_a, dtype), ids, axis=0)
        call_a = rec.new_call(layer, a)
        sa = ops.multiply(a, ops.cast(layer.lora_alpha / layer.lora_rank, a.dtype))
        z = ops.add(ops.cast(ops.take(layer._embeddings, ids, axis=0), dtype),
                    ops.matmul(sa, ops.cast(layer.lora_embeddings_b, dtype)))
        call = rec.new_call(layer, z)
        if call is not None:
            rec.add(Lookup(layer._embeddings, call, ids))
            rec.add(Lookup(layer.lora_embeddings_a, call_a, ids))
            rec.add(_matmul_contribution(layer.lora_embeddings_b, call, sa))
        return z

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        reverse = False
        if _EmbeddingRule._reversible(layer):
            reverse = kwargs.pop("reverse", args[0] if args else False)
            args = ()
        lora = lora_enabled(layer)
        if lora and (reverse or (_EmbeddingRule._reversible(layer) and layer.mask_zero)):
            # Not factored here: the tied reverse projection through a LoRA
            # table, and Keras masks set inside the call. Exact for the table.
            rec.mark_layer_bad(layer, _EmbeddingRule,
                               "LoRA ReversibleEmbedding used as a reverse projection "
                               "or with mask_zero")
            return original_call(layer)(inputs, *args, reverse=True, **kwargs) if reverse else \
                original_call(layer)(inputs, *args, **kwargs)
        if lora:
            return _EmbeddingRule._lora_lookup(layer, rec, inputs)
        if not reverse:
            z = original_call(layer)(inputs, *args, **kwargs)
            call = rec.new_call(layer, z)
            if call is not None:
                rec.add(Lookup(layer._embeddings, call, inputs))
            return z
        x = tf.convert_to_tensor(inputs)
        if layer.tie_weights:
            kernel = ops.transpose(layer.embeddings)
        else:
            kernel = layer.reverse_embeddings
        if layer.reverse_dtype is not None:
            x = ops.cast(x, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        z = ops.matmul(x, kernel)
        call = rec.new_call(layer, z)
        if call is not None:
            V, d = layer.input_dim, layer.output_dim
            T = product_of([static_dim(s) for s in x.shape[1:-1]])

            if layer.tie_weights:
                def factors(g, x=x):
                    B, L = batch_and_length(x, T)
                    return (tf.reshape(tf.cast(g, x.dtype), [B, 1, L, V]),
                            tf.reshape(x, [B, 1, L, d]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [V, d])

                rec.add(Linear(layer._embeddings, call, factors, to_var, (1, V, T, d),
                                layout=("rows", V, d), keys=(None, ("rev-h", x.ref(), T, d)),
                                rows=True))
            else:
                def factors(g, x=x):
                    B, L = batch_and_length(x, T)
                    return (tf.reshape(x, [B, 1, L, d]),
                            tf.reshape(tf.cast(g, x.dtype), [B, 1, L, V]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [d, V])

                rec.add(Linear(layer.reverse_embeddings, call, factors, to_var,
                                (1, d, T, V), layout=("dense", d, V),
                                keys=(("dense-x", x.ref(), T, d), None)))
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            return ops.multiply(ops.tanh(ops.divide(z, cap)), cap)
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer._embeddings or (lora_enabled(layer) and var is layer.lora_embeddings_a):
            return "ghost"
        if lora_enabled(layer) and var is layer.lora_embeddings_b:
            return static_linear(1, layer.lora_rank, layer.output_dim, T, B)
        return static_linear(1, layer.output_dim, layer.input_dim, T, B)


class _PositionEmbeddingRule:
    name = "PositionEmbedding"

    @staticmethod
    def matches(layer):
        return True

    @staticmethod
    def variables(layer):
        return [layer.position_embeddings]

    @staticmethod
    def forward(layer, rec, inputs, start_index=0, positions=None):
        z = original_call(layer)(inputs, start_index=start_index, positions=positions)
        call = rec.new_call(layer, z)
        if call is not None:
            if z.shape.rank != 3:
                rec.mark_bad(layer.position_embeddings, "input rank != 3")
                return z
            shape = tf.shape(z)
            if positions is None:
                ids = tf.cast(start_index, tf.int32) + tf.range(shape[1], dtype=tf.int32)
                distinct = True
            else:
                ids = tf.cast(positions, tf.int32)
                distinct = False
            ids = tf.broadcast_to(ids if ids.shape.rank == 2 else ids[None], shape[:2])
            ids.set_shape(z.shape[:2])
            rec.add(Lookup(layer.position_embeddings, call, ids, distinct=distinct))
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        return "ghost"


if hasattr(keras.layers, "ReversibleEmbedding"):
    register_clipping_rule(keras.layers.ReversibleEmbedding)(_EmbeddingRule)


def register_keras_hub_rules(keras_hub_layer):
    """Register this module's rules for KerasHub's layer classes (``keras_hub_layer``:
    :func:`keras_dp_lm._keras_internals.keras_hub_layer`)."""
    position = keras_hub_layer("PositionEmbedding")
    if position is not None:
        register_clipping_rule(position)(_PositionEmbeddingRule)
    # KerasHub's subclass adds preset plumbing only: the contract is that it
    # inherits Keras's computation unchanged, checked here.
    reversible = keras_hub_layer("ReversibleEmbedding")
    base = getattr(keras.layers, "ReversibleEmbedding", None)
    if reversible is not None and all(
            getattr(reversible, attr, None) is getattr(base, attr, None)
            for attr in ("call", "embeddings", "build")):
        register_clipping_rule(reversible)(_EmbeddingRule)
