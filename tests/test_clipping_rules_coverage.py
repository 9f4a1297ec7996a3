"""Fast-clipping rules for Conv1D / Conv2D, GroupNormalization, KerasHub Gemma's
RMS norm and KerasHub's MaskedLMHead, against the naive per-example loop.

Each model is tiny; every check compares ``fast_clipped_sum``'s per-example
norms and clipped sum with one-example-at-a-time gradients
(:func:`test_clipping_fast.assert_matches`), in eager mode, inside
``tf.function`` and under XLA, and the coverage report must list no variable
as "exact" unless the configuration is one the rules refuse.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_hub

from keras_dp_lm import clipping as fc
from test_clipping_fast import assert_matches
from test_clipping_fast import classification_loss
from test_clipping_fast import padded_tokens
from test_clipping_fast import tiny_bert_backbone
from reference import token_loss


def _graph(m, f, d, c, method):
    return fc.fast_clipped_sum(m, f, d, c, method=method)


GRAPH = tf.function(_graph)
XLA = tf.function(_graph, jit_compile=True)


def _no_exact(model):
    coverage = fc.clipping_coverage(model)
    assert "exact" not in coverage.values(), coverage
    return coverage


def _forced_kernels(model, force, names):
    """With a forced method, the named layers' kernels used it."""
    if force is None:
        return
    coverage = fc.clipping_coverage(model)
    picked = {p: m for p, m in coverage.items()
              if p.endswith("kernel") and p.split("/")[-2] in names}
    assert len(picked) == len(names) and set(picked.values()) == {force}, picked


# ---------------------------------------------------------------------------
# Conv1D / Conv2D


def conv1d_token_model():
    """Causal dilated, strided "same", a shared conv called twice (cross terms)
    and two same-config convs on one input (a shared patch Gram)."""
    ids_in = keras.Input((9,), dtype="int32")
    h = keras.layers.Embedding(12, 4)(ids_in)
    h = keras.layers.Conv1D(5, 3, padding="causal", dilation_rate=2, activation="relu",
                            name="causal")(h)
    shared = keras.layers.Conv1D(5, 2, padding="same", activation="tanh", name="shared")
    h = shared(shared(h))
    gate = keras.layers.Conv1D(4, 3, strides=2, padding="same", name="gate")(h)
    value = keras.layers.Conv1D(4, 3, strides=2, padding="same", use_bias=False,
                                name="value")(h)
    h = value * keras.activations.sigmoid(gate)
    out = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    return keras.Model(ids_in, out)


def conv2d_image_model():
    inp = keras.Input((7, 6, 2))
    h = keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu",
                            name="strided")(inp)
    h = keras.layers.Conv2D(4, (2, 3), dilation_rate=2, padding="same", name="dilated")(h)
    h = keras.layers.Conv2D(3, 2, padding="valid", name="valid")(h)
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


@pytest.mark.parametrize("force", ["ghost", "instantiate", None], indirect=True)
def test_conv1d_token_model(force):
    rng = np.random.default_rng(20)
    model = conv1d_token_model()
    ids = rng.integers(0, 12, (5, 9)).astype("int32")
    ids[0, :3] = ids[0, 3:6]
    data = (tf.constant(ids), tf.constant(rng.integers(0, 3, 5)))
    loss_fn = classification_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    _forced_kernels(model, force, ["causal", "shared", "gate", "value"])
    if force is None:
        assert_matches(model, loss_fn, data, fn=GRAPH, method="fast")
        assert_matches(model, loss_fn, data, fn=XLA, method="fast")
    coverage = _no_exact(model)
    assert coverage["causal/bias"] == "instantiate"


@pytest.mark.parametrize("force", ["ghost", "instantiate", None], indirect=True)
def test_conv2d_image_model(force):
    rng = np.random.default_rng(21)
    model = conv2d_image_model()
    data = (tf.constant(rng.normal(size=(4, 7, 6, 2)).astype("float32")),
            tf.constant(rng.integers(0, 2, 4)))
    loss_fn = classification_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    _forced_kernels(model, force, ["strided", "dilated", "valid"])
    if force is None:
        assert_matches(model, loss_fn, data, fn=GRAPH, method="fast")
        assert_matches(model, loss_fn, data, fn=XLA, method="fast")
    _no_exact(model)


def test_conv_coverage_estimate_without_a_run():
    """The static estimate (no fast_clipped_sum yet) covers every conv variable."""
    assert "exact" not in fc.clipping_coverage(conv1d_token_model()).values()
    coverage = fc.clipping_coverage(conv2d_image_model(), batch_size=4)
    assert "exact" not in coverage.values()
    assert coverage["strided/bias"] == "instantiate"


@pytest.mark.parametrize("kwargs, why", [
    (dict(groups=2), "grouped Conv2D"),
    (dict(data_format="channels_first"), "channels_first"),
])
def test_unsupported_conv_falls_back_to_exact_with_a_reason(kwargs, why):
    rng = np.random.default_rng(22)
    inp = keras.Input((4, 5, 6))
    conv = keras.layers.Conv2D(4, 3, name="conv", **kwargs)
    h = conv(keras.layers.Dense(4, name="pre")(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    data = (rng.normal(size=(4, 4, 5, 6)).astype("float32"), rng.integers(0, 2, 4))
    loss_fn = classification_loss(model)
    # traced, as the DP step runs it: TensorFlow's CPU kernels run no NCHW Conv2D
    # eagerly (graph mode rewrites the layout), whatever clipping does
    with pytest.raises(fc.UncoveredLayersError, match=why):
        tf.function(lambda: fc.fast_clipped_sum(model, loss_fn, data, 1.0, method="fast"),
                    autograph=False)()
    coverage = fc.clipping_coverage(model)
    assert coverage["conv/kernel"] == coverage["conv/bias"] == "exact"
    assert coverage["pre/kernel"] != "exact"
    if why == "channels_first":
        return  # TensorFlow's CPU kernels run no NCHW Conv2D gradient: nothing to compare
    assert_matches(model, loss_fn, data, method="auto")
    assert why in fc.exact_reason(model, conv.kernel)


def test_conv_with_lora_is_exact_with_the_reason():
    rng = np.random.default_rng(23)
    conv = keras.layers.Conv1D(3, 2)
    model = keras.Sequential([keras.Input((5, 4)), conv, keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    conv.enable_lora(2)
    conv.lora_kernel_b.assign(rng.normal(size=conv.lora_kernel_b.shape).astype("float32"))
    assert "does not describe LoRA" in fc.exact_reason(model, conv.lora_kernel_a)
    data = (rng.normal(size=(4, 5, 4)).astype("float32"), rng.integers(0, 2, 4))
    assert_matches(model, classification_loss(model), data, method="auto")


# ---------------------------------------------------------------------------
# GroupNormalization


def test_group_normalization():
    rng = np.random.default_rng(24)
    inp = keras.Input((6, 5, 4))
    h = keras.layers.Conv2D(4, 3, padding="same")(inp)
    h = keras.layers.GroupNormalization(groups=2, name="gn_channels")(h)
    h = keras.layers.GroupNormalization(groups=3, axis=1, name="gn_rows")(h)
    h = keras.layers.GroupNormalization(groups=2, axis=-1, center=False, name="gn_scale")(h)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    for v in model.trainable_variables:   # off their (1, 0) initial values
        if v.path.startswith("gn_"):
            v.assign(v + rng.normal(scale=0.3, size=v.shape).astype("float32"))
    data = (tf.constant(rng.normal(size=(4, 6, 5, 4)).astype("float32")),
            tf.constant(rng.integers(0, 2, 4)))
    loss_fn = classification_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    assert_matches(model, loss_fn, data, fn=GRAPH, method="fast")
    assert_matches(model, loss_fn, data, fn=XLA, method="fast")
    coverage = _no_exact(model)
    assert coverage["gn_rows/gamma"] == coverage["gn_channels/beta"] == "instantiate"


# ---------------------------------------------------------------------------
# KerasHub: Gemma's RMS norm, MaskedLMHead


def test_gemma_causal_lm_rms_norm():
    rng = np.random.default_rng(25)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=40, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8,
        layer_norm_epsilon=0.5)   # large enough that the rule must use the layer's own
    lm = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    for v in lm.trainable_variables:   # Gemma's scales start at 0 (x * (1 + scale))
        if v.path.endswith("scale"):
            v.assign(rng.normal(scale=0.3, size=v.shape).astype("float32"))
    ids, mask = padded_tokens(rng, 4, 9, 40)
    data = (tf.constant(ids), tf.constant(mask))

    def loss_fn(data):
        return token_loss(lm, *data)

    assert_matches(lm, loss_fn, data, method="fast")
    assert_matches(lm, loss_fn, data, fn=GRAPH, method="fast")
    assert_matches(lm, loss_fn, data, fn=XLA, method="fast")
    coverage = _no_exact(lm)
    assert coverage["final_normalization/scale"] == "instantiate"


def _mlm_loss(model):
    def loss_fn(data):
        x, y = data
        ce = keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True)
        return tf.reduce_mean(ce, axis=1)
    return loss_fn


def test_bert_masked_lm_tied_head():
    rng = np.random.default_rng(26)
    backbone = tiny_bert_backbone()
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    ids, mask = padded_tokens(rng, 4, 10, 50)
    positions = np.array([[1, 3, 4], [0, 2, 2], [5, 6, 7], [1, 2, 0]], "int32")
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask,
         "mask_positions": positions}
    x = {k: tf.constant(v) for k, v in x.items()}
    labels = ids[np.arange(4)[:, None], positions]   # the masked tokens: tied cross terms
    data = (x, tf.constant(labels))
    loss_fn = _mlm_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    assert_matches(model, loss_fn, data, fn=GRAPH, method="fast")
    assert_matches(model, loss_fn, data, fn=XLA, method="fast")
    coverage = _no_exact(model)
    assert coverage["mlm_head/output_bias"] == "instantiate"
    assert coverage["mlm_head/intermediate_dense/kernel"] != "exact"


def _untied_head_model(head):
    seq = keras.Input((7, 8))
    positions = keras.Input((3,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="tanh", name="pre")(seq)
    return keras.Model([seq, positions], head(hidden, mask_positions=positions))


def _untied_data(rng):
    positions = np.array([[0, 2, 6], [1, 1, 3], [4, 5, 6], [0, 3, 2], [6, 6, 6]], "int32")
    return ((tf.constant(rng.normal(size=(5, 7, 8)).astype("float32")), tf.constant(positions)),
            tf.constant(rng.integers(0, 11, (5, 3))))


@pytest.mark.parametrize("force", ["ghost", "instantiate"], indirect=True)
def test_untied_masked_lm_head(force):
    rng = np.random.default_rng(27)
    head = keras_hub.layers.MaskedLMHead(vocabulary_size=11, activation="linear",
                                         name="head")
    model = _untied_head_model(head)
    head._bias.assign(rng.normal(scale=0.3, size=head._bias.shape).astype("float32"))
    assert_matches(model, _mlm_loss(model), _untied_data(rng), method="fast")
    coverage = _no_exact(model)
    assert coverage["head/output_kernel"] == force
    assert coverage["head/output_bias"] == "instantiate"


def test_masked_lm_head_with_an_unregistered_embedding_is_exact():
    """A tied (frozen) embedding of an unregistered subclass: the head cannot
    vouch for its call, so the head's variables and its sub-layers fall back
    to exact, and the result still matches the naive loop."""

    class MyReversible(keras.layers.ReversibleEmbedding):
        pass

    rng = np.random.default_rng(28)
    emb = MyReversible(11, 8)
    emb.build((None, 7))
    emb.trainable = False
    head = keras_hub.layers.MaskedLMHead(token_embedding=emb, name="head")
    model = _untied_head_model(head)
    data = _untied_data(rng)
    loss_fn = _mlm_loss(model)
    with pytest.raises(fc.UncoveredLayersError, match="unregistered or modified sub-layer"):
        fc.fast_clipped_sum(model, loss_fn, data, 1.0, method="fast")
    assert_matches(model, loss_fn, data, method="auto")
    assert "unregistered" in fc.exact_reason(model, head._bias)
    assert "inside another covered layer" in fc.exact_reason(
        model, head._intermediate_dense.kernel)
    assert fc.exact_reason(model, model.get_layer("pre").kernel) == ""


# ---------------------------------------------------------------------------
# The RMS norms of single KerasHub families (source-checked rule)


_FAMILY_NORMS = ["Gemma3RMSNormalization", "MistralLayerNormalization",
                 "MixtralLayerNormalization", "QwenLayerNorm", "QwenMoeLayerNorm",
                 "Qwen3LayerNorm", "Qwen3MoeLayerNorm", "Phi3LayerNorm",
                 "GptOssLayerNormalization", "T5LayerNorm"]


def _family_norm(name, **kwargs):
    from keras_dp_lm._keras_internals import keras_hub_layer
    layer_class = keras_hub_layer(name)
    assert layer_class is not None, f"KerasHub no longer has {name}"
    return layer_class(epsilon=0.5, **kwargs)   # large: the rule must use the layer's own


def _norm_model(norm, shape=(5, 6)):
    """Dense -> norm -> Dense, the norm's scale moved off its initial value."""
    rng = np.random.default_rng(29)
    inp = keras.Input(shape)
    h = keras.layers.Dense(shape[-1], name="pre")(inp)
    h = norm(h)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    for v in norm.trainable_variables:
        v.assign(v + rng.normal(scale=0.4, size=v.shape).astype("float32"))
    data = (tf.constant(rng.normal(size=(4,) + shape).astype("float32")),
            tf.constant(rng.integers(0, 3, 4)))
    return model, data


@pytest.mark.parametrize("name", _FAMILY_NORMS)
def test_family_rms_norm_matches_the_naive_loop(name):
    norm = _family_norm(name)
    model, data = _norm_model(norm)
    loss_fn = classification_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    assert_matches(model, loss_fn, data, fn=GRAPH, method="fast")
    coverage = _no_exact(model)
    assert coverage[norm.trainable_variables[0].path] == "instantiate"


@pytest.mark.parametrize("name", ["Qwen3LayerNorm", "Qwen3MoeLayerNorm"])
def test_per_head_rms_norm_matches_the_naive_loop(name):
    """Qwen3's query / key norm: a scale of head_dim on [B, T, heads, head_dim], under XLA too."""
    norm = _family_norm(name, head_dim=4)
    model, data = _norm_model(norm, shape=(5, 3, 4))
    loss_fn = classification_loss(model)
    assert_matches(model, loss_fn, data, method="fast")
    assert_matches(model, loss_fn, data, fn=XLA, method="fast")
    _no_exact(model)


def test_family_rms_norm_with_another_call_is_exact():
    """A class registered for the source-checked rule whose ``call`` computes
    something else (here: another KerasHub version's, or a patched class) is
    not matched: exact per-example gradients, and the result still matches."""
    from keras_dp_lm.clipping import register_clipping_rule
    from keras_dp_lm.clipping.registry import _rules
    from keras_dp_lm._keras_internals import keras_hub_layer
    from keras import ops

    base = keras_hub_layer("MistralLayerNormalization")

    class Shifted(base):
        def call(self, x):
            x = ops.cast(x, "float32")
            var = ops.mean(ops.power(x, 2), axis=-1, keepdims=True)
            x = x * ops.rsqrt(var + self.epsilon)
            return ops.cast(x * self.scale + 0.1 * self.scale ** 2, self.compute_dtype)

    register_clipping_rule(Shifted, _rules()[base])
    try:
        norm = Shifted(epsilon=0.5)
        model, data = _norm_model(norm)
        assert fc.clipping_coverage(model)[norm.scale.path] == "exact"
        assert "the rule does not cover" in fc.exact_reason(model, norm.scale)
        assert_matches(model, classification_loss(model), data, method="auto")
    finally:
        _rules().pop(Shifted, None)


@pytest.mark.parametrize("build", ["mistral", "qwen2", "qwen3", "phi3", "gemma3"])
def test_causal_lm_with_its_family_norm_is_fast(build):
    """The whole task: every variable on fast rules, against the naive loop."""
    rng = np.random.default_rng(30)
    common = dict(vocabulary_size=40, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                  hidden_dim=16, intermediate_dim=32, layer_norm_epsilon=0.5)
    models = keras_hub.models
    if build == "mistral":
        lm = models.MistralCausalLM(models.MistralBackbone(**common, sliding_window=8),
                                    preprocessor=None)
    elif build == "qwen2":
        lm = models.Qwen2CausalLM(models.QwenBackbone(**common), preprocessor=None)
    elif build == "qwen3":
        lm = models.Qwen3CausalLM(models.Qwen3Backbone(**common, head_dim=8), preprocessor=None)
    elif build == "phi3":
        common.pop("num_query_heads"), common.pop("num_key_value_heads")
        lm = models.Phi3CausalLM(models.Phi3Backbone(**common, num_query_heads=2,
                                                     num_key_value_heads=1,
                                                     max_sequence_length=16), preprocessor=None)
    else:
        lm = models.Gemma3CausalLM(preprocessor=None, backbone=models.Gemma3Backbone(
            **common, head_dim=8, image_size=16, vision_encoder=None))
    for v in lm.trainable_variables:   # off their initial values (Gemma3's start at 0)
        if v.path.endswith("scale"):
            v.assign(v + rng.normal(scale=0.3, size=v.shape).astype("float32"))
    ids, mask = padded_tokens(rng, 4, 9, 40)
    data = (tf.constant(ids), tf.constant(mask))

    def loss_fn(data):
        return token_loss(lm, *data)

    assert_matches(lm, loss_fn, data, method="fast")
    _no_exact(lm)
