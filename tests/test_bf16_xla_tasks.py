"""KerasHub tasks on the fast path under XLA and mixed_bfloat16, against eager float32.

For GPT-2 (with and without LoRA), Llama with LoRA and BERT (Llama without LoRA under
XLA is in test_clipping_fast.py): the DP step's clipped sum
(``dp_clipped_gradient``, fast clipping) computed eagerly in float32 is the
reference; the same weights under ``mixed_bfloat16`` (bfloat16 activations,
float32 weights) compiled with ``jit_compile=True`` must match it to bfloat16
rounding (3e-2 relative; measured 0.5-0.9%, the same as bfloat16 without XLA). And
in bfloat16 under XLA one example's clipped contribution stays within C (float32
rounding): the norm is taken of exactly the vector that is summed. (XLA in float32
is exact to 1e-4 against the naive loop in test_clipping_fast.py.)
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_dp_lm as kdp
from keras_dp_lm import clipping
from keras_dp_lm.training import dp_clipped_gradient
from reference import max_relative_error

CLIP = 0.05
VOCAB = 64


def _task(arch, lora):
    keras.utils.set_random_seed(7)
    if arch == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=16, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    elif arch == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=32, intermediate_dim=64)
        model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=16, dropout=0.0)
        model = keras_hub.models.BertTextClassifier(backbone, num_classes=3,
                                                    preprocessor=None, dropout=0.0)
    if lora:
        backbone.enable_lora(4)
        rng = np.random.default_rng(8)
        for v in model.trainable_variables:   # B starts at zero: move it off
            if v.path.endswith("lora_kernel_b"):
                v.assign(rng.normal(scale=0.3, size=v.shape).astype("float32"))
    model.compile(optimizer=kdp.DPAdam(1e-3, l2_norm_clip=CLIP, noise_multiplier=1.0,
                                       clipping="fast"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _batch(arch):
    rng = np.random.default_rng(9)
    ids = rng.integers(1, VOCAB, (6, 13)).astype("int32")
    mask = np.ones_like(ids)
    mask[2, 7:] = 0
    if arch == "bert":
        x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
        return x, rng.integers(0, 3, 6).astype("int32"), None
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return x, ids[:, 1:], mask[:, 1:].astype("float32")


def _clipped(model, data, jit):
    fn = lambda d: dp_clipped_gradient(model, d).grads  # noqa: E731
    if jit is not None:
        fn = tf.function(fn, jit_compile=jit)
    return [np.asarray(tf.cast(g, tf.float32), np.float64) for g in fn(data)]


def _flat(grads):
    return np.concatenate([g.ravel() for g in grads])


@pytest.fixture
def float32_policy_after():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("arch,lora", [("gpt2", False), ("gpt2", True), ("llama", True),
                                       ("bert", False)])
def test_xla_and_bfloat16_match_eager_float32(arch, lora, float32_policy_after):
    data = _batch(arch)
    reference_model = _task(arch, lora)
    assert "exact" not in clipping.clipping_coverage(reference_model).values()
    reference = _clipped(reference_model, data, jit=None)

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = _task(arch, lora)
    model.set_weights(reference_model.get_weights())
    assert model.compute_dtype == "bfloat16"
    assert "exact" not in clipping.clipping_coverage(model).values()
    low = _clipped(model, data, jit=True)
    error = max_relative_error(low, reference)
    assert error <= 3e-2, (arch, lora, error)
    # Sensitivity in bfloat16 under XLA: removing example 2 (the one with padding)
    # moves the sum by at most C.
    x, y, sw = data
    keep = [0, 1, 3, 4, 5]
    take = lambda t: None if t is None else tf.nest.map_structure(  # noqa: E731
        lambda a: a[keep], t)
    neighbour = _clipped(model, (take(x), take(y), take(sw)), jit=True)
    moved = np.linalg.norm(_flat(low) - _flat(neighbour))
    assert moved <= CLIP * (1 + 1e-5), moved / CLIP
