"""Fast per-example clipping (ghost norms + book-keeping) against a naive loop.

Every test computes each example's gradient on its own with a GradientTape,
clips it and sums (the naive reference below), and checks
``fast_clipped_sum``'s per-example norms and clipped sum against it to 1e-4
relative.  Models are tiny; dropout is 0 so the batched and one-example
forward passes are the same function.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_hub

import keras_dp_lm as kdp
from keras_dp_lm import clipping as fc
from reference import naive_clip
from reference import naive_per_unit
from reference import token_loss

RTOL = 1e-4


# ---------------------------------------------------------------------------
# Naive reference and checks


def naive_per_example(model, loss_fn, data):
    """Per-example gradients, one example at a time: list over examples of lists."""
    return naive_per_unit(model, loss_fn, data)


def assert_matches(model, loss_fn, data, fn=fc.fast_clipped_sum, method="auto"):
    per_example = naive_per_example(model, loss_fn, data)
    ref_norms, _ = naive_clip(per_example, 1.0)
    clip = float(np.median(ref_norms))   # some examples clipped, some not
    ref_norms, ref_sums = naive_clip(per_example, clip)
    result = fn(model, loss_fn, data, clip, method=method)

    norms = np.asarray(result.norms, np.float64)
    np.testing.assert_allclose(norms, ref_norms, rtol=RTOL)
    assert len(result.grads) == len(model.trainable_variables)
    total = np.sqrt(sum(float(np.sum(s * s)) for s in ref_sums))
    err = np.sqrt(sum(float(np.sum((np.asarray(g, np.float64) - s) ** 2))
                      for g, s in zip(result.grads, ref_sums)))
    assert err <= RTOL * total, (err, total)
    for v, g, s in zip(model.trainable_variables, result.grads, ref_sums):
        assert tuple(g.shape) == tuple(v.shape), v.path
        diff = np.linalg.norm(np.asarray(g, np.float64) - s)
        # Per variable, relative to its own size (floored: attention key
        # biases have an exactly-zero gradient).
        assert diff <= RTOL * max(np.linalg.norm(s), 1e-3 * total), v.path
    losses = np.asarray(result.losses)
    assert losses.shape == (len(ref_norms),)
    return result


def padded_tokens(rng, batch, length, vocab):
    ids = rng.integers(1, vocab, (batch, length)).astype("int32")
    mask = np.ones((batch, length), "int32")
    mask[1, length // 2:] = 0
    mask[-1, 3:] = 0
    return ids, mask


def tiny_bert_backbone():
    """BERT, 2 layers x 16, vocabulary 50, no dropout (built offline)."""
    return keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0)


def classification_loss(model):
    def loss_fn(data):
        x, y = data
        return keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True)
    return loss_fn


# ---------------------------------------------------------------------------
# Keras models


@pytest.mark.parametrize("force", ["ghost", "instantiate", None], indirect=True)
def test_dense_mlp(force):
    rng = np.random.default_rng(0)
    inp = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="tanh")(inp)
    hidden = keras.layers.Dense(6, activation="relu", use_bias=False)(hidden)
    model = keras.Model(inp, keras.layers.Dense(3)(hidden))
    data = (rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, 6))
    assert_matches(model, classification_loss(model), data)
    if force is None:   # also inside tf.function with XLA
        xla = tf.function(
            lambda m, f, d, c, method: fc.fast_clipped_sum(m, f, d, c, method=method),
            jit_compile=True)
        data = tuple(tf.constant(t) for t in data)
        assert_matches(model, classification_loss(model), data, fn=xla, method="fast")
    if force is None:   # loss_fn may hand back the batched forward's outputs
        def with_outputs(data):
            logits = model(data[0], training=True)
            losses = keras.losses.sparse_categorical_crossentropy(
                data[1], logits, from_logits=True)
            return losses, logits
        result = fc.fast_clipped_sum(model, with_outputs, data, 1.0)
        np.testing.assert_allclose(result.outputs, model(data[0]), rtol=1e-6, atol=1e-6)
        assert fc.fast_clipped_sum(model, classification_loss(model), data, 1.0).outputs is None
    expected = {"ghost": "ghost", "instantiate": "instantiate"}.get(force)
    if expected:
        kernels = [m for p, m in fc.clipping_coverage(model).items() if p.endswith("kernel")]
        assert set(kernels) == {expected}


@pytest.mark.parametrize("force", ["ghost", "instantiate"], indirect=True)
def test_embedding_dense_shared_layer(force):
    """Repeated token ids, mask_zero, a Dense over the sequence called twice (cross terms)."""
    rng = np.random.default_rng(1)
    ids_in = keras.Input((6,), dtype="int32")
    emb = keras.layers.Embedding(5, 4, mask_zero=True)(ids_in)
    shared = keras.layers.Dense(4, activation="relu")
    hidden = shared(shared(emb))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(ids_in, keras.layers.Dense(2)(pooled))
    ids = rng.integers(0, 5, (5, 6)).astype("int32")
    assert_matches(model, classification_loss(model), (ids, rng.integers(0, 2, 5)))


def test_multi_head_attention_masks():
    rng = np.random.default_rng(2)
    T = 6
    q = keras.Input((T, 8))
    mask = keras.Input((T,), dtype="bool")
    attention_mask = keras.ops.logical_and(mask[:, None, :], mask[:, :, None])
    att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(
        q, q, attention_mask=attention_mask, use_causal_mask=True)
    hidden = keras.layers.LayerNormalization()(att + q)
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model([q, mask], out)
    valid = np.ones((4, T), bool)
    valid[1, 4:] = False
    x = rng.normal(size=(4, T, 8)).astype("float32")
    data = ((tf.constant(x), tf.constant(valid)), tf.constant(rng.integers(0, 2, 4)))
    assert_matches(model, classification_loss(model), data, method="fast")


# ---------------------------------------------------------------------------
# KerasHub models


def test_gpt2_causal_lm_tied_padding_eager_and_graph():
    rng = np.random.default_rng(3)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=16, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    ids, mask = padded_tokens(rng, 4, 11, 100)
    ids[0, :4] = ids[0, 4:8]   # repeated tokens inside one example

    def loss_fn(data):
        return token_loss(lm, *data)

    data = (tf.constant(ids), tf.constant(mask))
    assert_matches(lm, loss_fn, data, method="fast")
    graph = tf.function(lambda m, f, d, c, method: fc.fast_clipped_sum(m, f, d, c, method=method))
    assert_matches(lm, loss_fn, data, fn=graph, method="fast")
    # Under XLA the table's own norm is a T x T Gram, not the sort of the ids.
    xla = tf.function(lambda m, f, d, c, method: fc.fast_clipped_sum(m, f, d, c, method=method),
                      jit_compile=True)
    assert_matches(lm, loss_fn, data, fn=xla, method="fast")
    coverage = fc.clipping_coverage(lm)
    assert "exact" not in coverage.values()
    assert coverage["token_embedding/embeddings"] == "ghost"
    # The tied table's per-example gradient sums lookup and projection.
    assert not any(p.endswith("reverse_embeddings") for p in coverage)


def test_bert_text_classifier_padding():
    rng = np.random.default_rng(4)
    backbone = tiny_bert_backbone()
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=None, dropout=0.0)
    ids, mask = padded_tokens(rng, 4, 8, 50)
    segments = np.zeros_like(ids)
    segments[:, 4:] = 1
    x = {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}
    assert_matches(model, classification_loss(model), (x, rng.integers(0, 2, 4)),
                   method="fast")


@pytest.mark.parametrize("tied", [False, True])
def test_llama_causal_lm(tied):
    rng = np.random.default_rng(5)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=60, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, tie_word_embeddings=tied)
    lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    ids, mask = padded_tokens(rng, 4, 9, 60)
    assert_matches(lm, lambda d: token_loss(lm, *d), (ids, mask), method="fast")
    coverage = fc.clipping_coverage(lm)
    assert "exact" not in coverage.values()
    assert coverage["sequence_output_layernorm/scale"] == "instantiate"


# ---------------------------------------------------------------------------
# LoRA adapters (Keras's own enable_lora): fast and exact, frozen bases cost nothing


def _nonzero_lora_b(model, seed):
    """LoRA's B starts at zero (so A's gradient is 0): move it off zero."""
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if v.path.endswith(("lora_kernel_b", "lora_embeddings_b")):
            v.assign(rng.normal(scale=0.3, size=v.shape).astype("float32"))


def _assert_lora_fast(model):
    coverage = fc.clipping_coverage(model)
    lora = [p for p in coverage if "lora_" in p]
    assert lora and "exact" not in coverage.values(), coverage
    frozen = [v.path for v in model.non_trainable_variables]
    assert not any(p in coverage for p in frozen)
    return coverage


@pytest.mark.parametrize("force", ["ghost", "instantiate"], indirect=True)
def test_lora_dense_einsum_embedding(force):
    """All three Keras LoRA layers, sequence inputs, repeated ids, bias still trained."""
    rng = np.random.default_rng(11)
    ids_in = keras.Input((7,), dtype="int32")
    emb = keras.layers.Embedding(9, 8)
    dense = keras.layers.Dense(6, activation="tanh")
    einsum = keras.layers.EinsumDense("abc,cde->abde", output_shape=(7, 2, 3), bias_axes="de")
    hidden = einsum(dense(emb(ids_in)))
    out = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    model = keras.Model(ids_in, out)
    for layer, rank in ((emb, 2), (dense, 3), (einsum, 2)):
        layer.enable_lora(rank, lora_alpha=2 * rank)
    _nonzero_lora_b(model, 0)
    ids = rng.integers(0, 9, (5, 7)).astype("int32")
    ids[0, :3] = 4
    assert_matches(model, classification_loss(model), (ids, rng.integers(0, 3, 5)),
                   method="fast")
    coverage = _assert_lora_fast(model)
    assert coverage["embedding/lora_embeddings_a"] == force
    assert "embedding/embeddings" not in coverage and "dense/kernel" not in coverage


def test_lora_frozen_base_made_trainable_again_is_exact():
    """Full fine-tuning plus adapters: the base kernel's contribution is recorded too."""
    rng = np.random.default_rng(12)
    dense = keras.layers.Dense(4)
    model = keras.Sequential([keras.Input((6, 5)), dense, keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    dense.enable_lora(2)
    dense._kernel.trainable = True
    _nonzero_lora_b(model, 1)
    assert_matches(model, classification_loss(model),
                   (rng.normal(size=(4, 6, 5)).astype("float32"), rng.integers(0, 2, 4)),
                   method="fast")


def _lora_tokens(rng, vocab):
    ids, mask = padded_tokens(rng, 4, 10, vocab)
    ids[0, :4] = ids[0, 4:8]
    return tf.constant(ids), tf.constant(mask)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_keras_hub_causal_lm_eager_graph_xla(arch):
    rng = np.random.default_rng(13)
    if arch == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=80, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=16, dropout=0.0)
        lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=80, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=16, intermediate_dim=32)
        lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    backbone.enable_lora(4)
    _nonzero_lora_b(lm, 2)
    data = _lora_tokens(rng, 80)

    def loss_fn(data):
        return token_loss(lm, *data)

    assert_matches(lm, loss_fn, data, method="fast")
    xla = tf.function(lambda m, f, d, c, method: fc.fast_clipped_sum(m, f, d, c, method=method),
                      jit_compile=True)
    assert_matches(lm, loss_fn, data, fn=xla, method="fast")
    coverage = _assert_lora_fast(lm)
    assert all("lora_" in p or p.endswith("bias") for p in coverage), coverage


def test_lora_bert_classifier():
    rng = np.random.default_rng(14)
    backbone = tiny_bert_backbone()
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=None, dropout=0.0)
    backbone.enable_lora(2)
    _nonzero_lora_b(model, 3)
    ids, mask = padded_tokens(rng, 4, 8, 50)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    assert_matches(model, classification_loss(model), (x, rng.integers(0, 2, 4)),
                   method="fast")
    _assert_lora_fast(model)


def test_lora_on_a_rule_without_lora_support_is_exact_with_the_reason():
    class NoLoraRule:
        matches = staticmethod(lambda layer: True)
        variables = staticmethod(lambda layer: [layer._kernel])
        forward = staticmethod(lambda layer, rec, x: x)
        static_method = staticmethod(lambda layer, var, T, B: "ghost")

    class PlainDense(keras.layers.Dense):
        pass

    fc.register_clipping_rule(PlainDense, NoLoraRule)
    layer = PlainDense(2)
    model = keras.Sequential([keras.Input((3,)), layer])
    layer.enable_lora(1)
    assert set(fc.clipping_coverage(model).values()) == {"exact"}
    assert "does not describe LoRA" in fc.exact_reason(model, layer.lora_kernel_a)


# ---------------------------------------------------------------------------
# Uncovered layers, coverage report, restoration


def conv_model():
    ids_in = keras.Input((6,), dtype="int32")
    emb = keras.layers.Embedding(9, 4, name="embedding")(ids_in)
    conv = keras.layers.Conv1DTranspose(3, 2, name="conv")(emb)
    return keras.Model(ids_in, keras.layers.Dense(2, name="dense")(keras.layers.Flatten()(conv)))


def test_fast_raises_listing_uncovered_and_auto_falls_back_to_exact():
    rng = np.random.default_rng(6)
    model = conv_model()
    loss_fn = classification_loss(model)
    data = (rng.integers(0, 9, (4, 6)).astype("int32"), rng.integers(0, 2, 4))
    with pytest.raises(fc.UncoveredLayersError, match=r"conv \(Conv1DTranspose\): conv/kernel, conv/bias") as info:
        fc.fast_clipped_sum(model, loss_fn, data, 1.0, method="fast")
    assert isinstance(info.value, ValueError)
    assert list(info.value.uncovered) == ["conv (Conv1DTranspose)"]
    assert_matches(model, loss_fn, data, method="auto")
    assert fc.clipping_coverage(model)["conv/kernel"] == "exact"


class _ReadsKernel(keras.layers.Layer):
    """Multiplies by another layer's kernel directly, outside that layer's call."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.dense.kernel))


def test_variable_read_outside_its_layer_is_exact_or_refused():
    rng = np.random.default_rng(7)
    inp = keras.Input((3,))
    dense = keras.layers.Dense(3)
    out = _ReadsKernel(dense)(dense(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(out))
    loss_fn = classification_loss(model)
    data = (rng.normal(size=(4, 3)).astype("float32"), rng.integers(0, 2, 4))
    with pytest.raises(fc.UncoveredLayersError, match="read outside its layer's call"):
        fc.fast_clipped_sum(model, loss_fn, data, 1.0, method="fast")
    assert_matches(model, loss_fn, data, method="auto")


def test_coverage_report_and_restoration_after_error():
    model = conv_model()
    coverage = fc.clipping_coverage(model, sequence_length=6, batch_size=4)
    assert coverage == {"embedding/embeddings": "ghost", "conv/kernel": "exact",
                        "conv/bias": "exact", "dense/kernel": "ghost",
                        "dense/bias": "instantiate"}
    report = fc.coverage_report(model, sequence_length=6, batch_size=4)
    assert "conv/kernel" in report and "uncovered layers" in report
    assert "conv (Conv1DTranspose)" in report.splitlines()[-1]

    def failing(data):
        model(data, training=True)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fc.fast_clipped_sum(model, failing, np.zeros((2, 6), "int32"), 1.0)
    assert not any("call" in layer.__dict__ for layer in model._flatten_layers())
    from keras_dp_lm.clipping import recording
    assert recording._INSTALLED == {}


# ---------------------------------------------------------------------------
# float32 rounding of ghost norms


def _pooled_dense_model(dtype, T, D):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((T, D)), keras.layers.Dense(64, dtype=dtype),
        keras.layers.GlobalAveragePooling1D(dtype=dtype),
        keras.layers.Activation("tanh", dtype=dtype), keras.layers.Dense(2, dtype=dtype)])


def _cancelling_inputs(kind, scale, B, T, D, seed=1):
    """Activations whose per-example gradient cancels across positions."""
    rng = np.random.default_rng(seed)
    if kind == "centred":
        x = scale * rng.normal(size=(B, T, D))
        x = x - x.mean(axis=1, keepdims=True)
    elif kind == "coherent":
        # +a on half the positions, -a (1 + d) on the other half:
        # every Gram entry carries the same rounding error, which then adds up
        # linearly (1.55 C against an allowance modelling random errors)
        d = np.concatenate([-np.logspace(-6, -1, B // 2), np.logspace(-6, -1, B // 2)])
        x = np.empty((B, T, D))
        x[:, :T // 2] = scale
        x[:, T // 2:] = -(scale * (1 + d)).astype("float32")[:, None, None]
    else:   # one direction with alternating signs: aligned dot products
        sign = np.where(np.arange(T) % 2 == 0, 1.0, -1.0)[None, :, None]
        x = (scale * rng.normal(size=(B, 1, D)) * sign
             + 1e-3 * scale * rng.normal(size=(B, T, D)))
    return x.astype("float32"), rng.normal(size=(B, 2)).astype("float32")


@pytest.mark.parametrize("kind,scale,D,B", [("centred", 300.0, 64, 8), ("centred", 1000.0, 64, 8),
                                            ("aligned", 100.0, 256, 8),
                                            ("coherent", 300.0, 64, 64)])
def test_ghost_norm_rounding_cannot_lift_an_example_above_the_clip_norm(kind, scale, D, B):
    """Large activations centred over positions, then pooled: the Gram-matrix
    norm is a difference of large numbers that float32 reads up to ~10% low
    (or negative), and a crafted record makes the rounding errors add up
    coherently. Each example's clip factor times its true (float64) gradient
    norm must stay within C."""
    T = 16
    x, y = _cancelling_inputs(kind, scale, B, T, D)
    m32, m64 = _pooled_dense_model("float32", T, D), _pooled_dense_model("float64", T, D)
    m64.set_weights([w.astype("float64") for w in m32.get_weights()])
    true = []
    for i in range(B):
        with tf.GradientTape() as tape:
            out = m64(tf.constant(x[i:i + 1], tf.float64))
            loss = tf.reduce_sum(tf.square(out - tf.constant(y[i:i + 1], tf.float64)))
        grads = tape.gradient(loss, m64.trainable_variables)
        true.append(np.sqrt(sum(float(tf.reduce_sum(g * g)) for g in grads)))
    true = np.array(true)

    def loss_fn(data):
        xb, yb = data
        return tf.reduce_sum(tf.square(m32(xb, training=True) - yb), axis=-1)

    clip = 0.5 * float(true.min())   # every example clipped
    result = fc.fast_clipped_sum(m32, loss_fn, (tf.constant(x), tf.constant(y)), clip,
                                 method="fast")
    factors = fc.clip_factors(result.norms, clip).numpy().astype("float64")
    assert np.all(factors > 0)   # no example dropped for a negative reading
    assert np.max(factors * true) <= clip * (1 + 1e-6), np.max(factors * true) / clip


def test_ghost_norm_rounding_allowance_is_small_without_cancellation():
    """Ordinary activations: the worst-case allowance is at most
    ``u (m + n + 3T + 9) T`` of a squared norm (~1e-4 here)."""
    B, T, D = 8, 16, 64
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, T, D)).astype("float32")
    y = rng.normal(size=(B, 2)).astype("float32")
    model = _pooled_dense_model("float32", T, D)

    def loss_fn(data):
        xb, yb = data
        return tf.reduce_sum(tf.square(model(xb, training=True) - yb), axis=-1)

    result = fc.fast_clipped_sum(model, loss_fn, (tf.constant(x), tf.constant(y)), 1.0)
    ratio = np.asarray(result.rounding) / np.asarray(result.norms) ** 2
    bound = 1.05 * 2.0 ** -24 * (D + 64 + 3 * T + 9) * T + 1e-6
    assert np.all(ratio > 0) and np.all(ratio < bound), (ratio, bound)


def test_tensor_float_32_on_a_gpu_is_counted_at_its_roundoff(monkeypatch):
    from keras_dp_lm.clipping import rounding
    assert rounding.unit_roundoff() == 2.0 ** -24     # this machine: CPU only
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: ["GPU:0"] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled",
                        lambda: True)
    assert rounding.unit_roundoff() == 2.0 ** -11
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled",
                        lambda: False)
    assert rounding.unit_roundoff() == 2.0 ** -24


def test_on_a_tpu_every_float32_sum_counts_in_the_squares_allowance(monkeypatch):
    """Off TPUs only the last axis sums in float32 (the rest in float64);
    a TPU has no float64, so the whole length counts."""
    from keras_dp_lm.clipping import rounding
    per = tf.ones([2, 4, 8])
    sq = rounding.sum_squares(per)
    assert sq.dtype == tf.float64 and np.allclose(sq.numpy(), 32.0)
    allowance = rounding.squares_allowance(per, sq).numpy()
    assert np.allclose(allowance, 2.0 ** -24 * (8 + 8) * 32.0)
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: ["TPU:0"] if kind == "TPU" else [])
    sq = rounding.sum_squares(per)
    assert sq.dtype == tf.float32
    allowance = rounding.squares_allowance(per, sq).numpy()
    assert np.allclose(allowance, 2.0 ** -24 * (32 + 8) * 32.0)
    assert np.allclose(rounding.summed_terms_allowance(100, sq).numpy(),
                       2.0 ** -24 * 100 * 32.0)


def _null_space_model(T, M, N):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T, M))
    z = keras.layers.Dense(N, use_bias=False, name="wide")(inputs)
    z = keras.layers.LayerNormalization()(z)
    z = keras.layers.Dense(1)(z)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(z))


def _huge_null_space_records(model, n, T, M, N, scale=1e19):
    """Every position ``scale * (v + d u)``, ``v`` in the kernel's null space:
    a huge input whose layer output stays small, so after the LayerNorm the
    output gradient is ~1e-19 and its squares flush to zero in float32."""
    W = np.asarray(model.get_layer("wide").kernel, "float64")
    _, _, vt = np.linalg.svd(W.T)
    records = []
    for i in range(n):
        vec = vt[N + i] + 1e-4 * (1 + 0.37 * i) * vt[i]
        records.append(np.tile((scale * vec / np.linalg.norm(vec)).astype("float32"), (T, 1)))
    return np.stack(records)


def test_flushed_subnormals_cannot_hide_a_gradient_from_its_ghost_norm():
    """Before: a huge input times a tiny output gradient is a large
    gradient, but the output gradient's Gram matrix flushed to exactly 0 in
    float32, and so did the allowance: the ghost norm read 0 and one record
    moved the weights by 6312 C through ``fit``. The allowance now bounds
    what flushing to zero can cost, from the factors' row norms."""
    T, M, N, clip = 8, 128, 32, 1e-3
    model = _null_space_model(T, M, N)
    x = _huge_null_space_records(model, 3, T, M, N)
    y = model(x).numpy() + 1e-4

    def loss_fn(data):
        xb, yb = data
        return tf.reduce_sum(tf.square(model(xb, training=True) - yb), axis=-1)

    data = (tf.constant(x), tf.constant(y))
    per = fc.per_example_gradients(loss_fn, data, model.trainable_variables)
    true = np.sqrt(sum(np.sum(np.square(g.numpy().astype("float64")).reshape(len(x), -1),
                              axis=1) for g in per))
    assert np.all(true > 100 * clip)
    result = fc.fast_clipped_sum(model, loss_fn, data, clip)
    decisions = fc.clipping_coverage(model)
    assert [m for p, m in decisions.items() if "wide" in p] == ["ghost"], decisions
    factors = fc.clip_factors(result.norms, clip).numpy().astype("float64")
    assert np.max(factors * true) <= clip * (1 + 1e-5), np.max(factors * true) / clip

    # through fit: an honest first batch, then the crafted record and an inert row
    model = _null_space_model(T, M, N)
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0),
                  loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(2, T, M)).astype("float32"),
              rng.normal(size=(2, 1)).astype("float32"), batch_size=2, verbose=0)
    before = [w.astype("float64") for w in model.get_weights()]
    xb = np.concatenate([_huge_null_space_records(model, 1, T, M, N),
                         np.zeros((1, T, M), "float32")])
    yb = model(xb).numpy()
    yb[0] += 1e-4
    model.fit(xb, yb, batch_size=2, verbose=0, shuffle=False)
    moved = 2 * np.sqrt(sum(np.sum((w.astype("float64") - b) ** 2)
                            for w, b in zip(model.get_weights(), before)))
    assert moved <= clip * (1 + 1e-5), moved / clip
