"""Fast-clipping rules for embeddings: Embedding, ReversibleEmbedding (tied or not), KerasHub PositionEmbedding."""

import keras
import tensorflow as tf
from keras import ops

from keras_dp_lm.clipping._common import _or
from keras_dp_lm.clipping._common import _orig
from keras_dp_lm.clipping._common import _prod
from keras_dp_lm.clipping._common import _static
from keras_dp_lm.clipping.ghost import _Linear
from keras_dp_lm.clipping.ghost import _Lookup
from keras_dp_lm.clipping.ghost import _static_linear


class _EmbeddingRule:
    """keras Embedding and (keras / KerasHub) ReversibleEmbedding, tied or not."""

    name = "Embedding"

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
        return vs

    @staticmethod
    def forward(layer, rec, inputs, *args, **kwargs):
        reverse = False
        if _EmbeddingRule._reversible(layer):
            reverse = kwargs.pop("reverse", args[0] if args else False)
            args = ()
        if not reverse:
            z = _orig(layer)(inputs, *args, **kwargs)
            call = rec.new_call(layer, z)
            if call is not None:
                rec.add(_Lookup(layer._embeddings, call, inputs))
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
            T = _prod([_static(s) for s in x.shape[1:-1]])

            if layer.tie_weights:
                def factors(g, x=x):
                    return (tf.reshape(tf.cast(g, x.dtype), [-1, 1, _or(T, -1), V]),
                            tf.reshape(x, [-1, 1, _or(T, -1), d]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [V, d])

                rec.add(_Linear(layer._embeddings, call, factors, to_var, (1, V, T, d),
                                layout=("rows", V, d), keys=(None, ("rev-h", x.ref(), T, d)),
                                rows=True))
            else:
                def factors(g, x=x):
                    return (tf.reshape(x, [-1, 1, _or(T, -1), d]),
                            tf.reshape(tf.cast(g, x.dtype), [-1, 1, _or(T, -1), V]))

                def to_var(mat, batched):
                    return tf.reshape(mat, ([-1] if batched else []) + [d, V])

                rec.add(_Linear(layer.reverse_embeddings, call, factors, to_var,
                                (1, d, T, V), layout=("dense", d, V),
                                keys=(("dense-x", x.ref(), T, d), None)))
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            return ops.multiply(ops.tanh(ops.divide(z, cap)), cap)
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        if var is layer._embeddings:
            return "ghost"
        return _static_linear(1, layer.output_dim, layer.input_dim, T, B)


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
        z = _orig(layer)(inputs, start_index=start_index, positions=positions)
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
            rec.add(_Lookup(layer.position_embeddings, call, ids, distinct=distinct))
        return z

    @staticmethod
    def static_method(layer, var, T, B):
        return "ghost"
