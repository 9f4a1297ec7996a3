"""Small shape and layer helpers shared by the clipping engines and rules."""

import functools

import tensorflow as tf


def static_dim(dim):
    return dim if isinstance(dim, int) else None


def product_of(dims):
    out = 1
    for d in dims:
        if d is None:
            return None
        out *= d
    return out


def value_or(value, default):
    return default if value is None else value


def batch_and_length(t, T):
    """The batch and length entries of a reshape of ``t`` (``[B, ...]``) to
    ``[B, ..., T, ...]``: ``(-1, T)`` when ``T`` is static, else ``(B, -1)``
    with ``B`` read from ``t``'s dynamic shape (a reshape takes one ``-1``:
    a sequence length unknown when traced, as in T5's and DeBERTa's layers
    under an unknown batch size, needs the batch size spelled out)."""
    return (-1, T) if T is not None else (tf.shape(t)[0], -1)


def _as_float(x):
    x = tf.convert_to_tensor(x)
    return x if x.dtype.is_floating else tf.cast(x, tf.float32)


def _in_xla():
    """Whether ops are being traced for XLA (``jit_compile=True``)."""
    try:
        from tensorflow.python.ops import control_flow_util  # TF internal, no public API
        return bool(control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):  # pragma: no cover
        return False


def _weighted_sum(c, per):
    """``sum_i c[i] * per[i]`` over the leading axis, in float32.

    A matrix-vector product on TensorFlow's kernels; under XLA on CPU that dot
    is ~15x slower than a fused multiply-and-reduce, which is used instead.
    """
    c, per = tf.cast(c, tf.float32), tf.cast(per, tf.float32)
    if _in_xla():
        return tf.reduce_sum(per * tf.reshape(c, [-1] + [1] * (per.shape.rank - 1)), axis=0)
    rest = per.shape[1:]
    if not rest.is_fully_defined():
        return tf.tensordot(c, per, axes=[[0], [0]])
    # The product tensordot computes, [1, B] x [B, rest], without the ~30 shape
    # ops it adds for a dynamic batch axis (a sizeable part of a trace).
    flat = tf.reshape(per, [-1, rest.num_elements()])
    return tf.reshape(tf.matmul(c[None, :], flat), rest)


def reduce_to_shape(g, shape):
    """Per-example gradient of a variable of ``shape`` broadcast (right-aligned)
    against ``g`` = ``[B, ...]``: sum ``g`` over the broadcast axes."""
    rank, r = g.shape.rank, len(shape)
    if rank - r < 1:
        return None
    lead = list(range(1, rank - r))
    if lead:
        g = tf.reduce_sum(g, axis=lead)
    trail = [1 + j for j in range(r) if shape[j] == 1 and g.shape[1 + j] != 1]
    if trail:
        g = tf.reduce_sum(g, axis=trail, keepdims=True)
    return tf.reshape(g, [-1] + list(shape))


def _var_path(v):
    return getattr(v, "path", None) or v.name


def _plain(layer):
    """No quantization, no per-instance ``call``: the class's computation
    (LoRA adapters are matched by rules that declare ``lora = True``)."""
    return (getattr(layer, "quantization_mode", None) is None
            and "call" not in layer.__dict__)


def lora_enabled(layer):
    return bool(getattr(layer, "lora_enabled", False))


def original_call(layer):
    return functools.partial(type(layer).call, layer)


def inbound_shape(layer):
    """Static input shape of a layer's first call in a functional graph, if any."""
    try:
        return tuple(layer._inbound_nodes[0].input_tensors[0].shape)
    except (AttributeError, IndexError, TypeError):
        return None


def _layer_desc(layer):
    return f"{layer.path if getattr(layer, 'path', None) else layer.name} ({type(layer).__name__})"
