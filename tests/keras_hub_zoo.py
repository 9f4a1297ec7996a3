"""Every KerasHub text task class, built tiny from its backbone's constructor.

Used by ``test_keras_hub_zoo.py`` (one DP fit and the neighbouring-batch bound per
class) and the coverage table it keeps current, ``docs/guides/keras-hub-coverage.md``.

The classes are discovered, not listed: every class ``keras_hub.models`` exports
that subclasses ``CausalLM``, ``Seq2SeqLM``, ``TextClassifier`` or ``MaskedLM``
(aliases of one class counted once). Each backbone is built from its constructor
with tiny values for the arguments it has (``TINY``, then ``OVERRIDES`` per
backbone); the batch is made from the task's own inputs. A class that cannot be
built that way must be in ``NOT_BUILT`` with the reason.
"""

import inspect

import numpy as np

import keras
import keras_hub

BATCH, LENGTH, VOCAB, MASKED = 4, 8, 48, 3

KINDS = (("causal LM", "CausalLM"), ("seq2seq LM", "Seq2SeqLM"),
         ("text classifier", "TextClassifier"), ("masked LM", "MaskedLM"))

# Tiny values for the constructor arguments backbones share (by name).
TINY = dict(
    vocabulary_size=VOCAB, vocab_size=VOCAB, text_vocab_size=VOCAB,
    num_layers=1, num_hidden_layers=1, num_layers_enc=1, num_layers_dec=1,
    encoder_num_layers=1, decoder_num_layers=1,
    num_heads=2, num_query_heads=2, num_attention_heads=2, num_key_value_heads=1,
    encoder_num_attention_heads=2, decoder_num_attention_heads=2,
    encoder_num_key_value_heads=1, decoder_num_key_value_heads=1,
    hidden_dim=16, hidden_size=16, embedding_dim=16,
    encoder_hidden_dim=16, decoder_hidden_dim=16,
    intermediate_dim=32, intermediate_size=32,
    encoder_intermediate_dim=32, decoder_intermediate_dim=32, moe_intermediate_dim=16,
    shared_expert_intermediate_dim=16, shared_expert_intermediate_size=16,
    head_dim=8, head_size=8, encoder_head_dim=8, decoder_head_dim=8, key_value_dim=8,
    max_sequence_length=16, max_position_embeddings=16,
    num_experts=2, top_k=1, bucket_size=4,
    dropout=0.0, dropout_rate=0.0, attention_dropout=0.0,
    image_size=16, sliding_window=16, sliding_window_size=16,
)

# Per backbone: arguments TINY does not give, or gives wrong for it.
OVERRIDES = {
    "T5GemmaBackbone": dict(encoder_layer_types=["full_attention"],
                            decoder_layer_types=["full_attention"]),
    "T5Gemma2Backbone": dict(encoder_layer_types=["full_attention"],
                             decoder_layer_types=["full_attention"]),
    "SmolLM3Backbone": dict(attention_bias=False, attention_dropout=0.0,
                            rope_layer_enabled_list=[True], layer_types=["attention"],
                            mlp_bias=False, layer_norm_epsilon=1e-6, rope_theta=10000.0,
                            partial_rotary_factor=1.0),
    "Qwen3_5Backbone": dict(layer_types=["full_attention"], linear_num_key_heads=2,
                            linear_num_value_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8),
    "Qwen3_5MoeBackbone": dict(layer_types=["full_attention"], linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8,
                               linear_value_head_dim=8),
    "RWKV7Backbone": dict(head_size=8, gate_lora=4, mv_lora=4, aaa_lora=4, decay_lora=4),
    "GptOssBackbone": dict(top_k=1),
    "Gemma3nBackbone": dict(text_hidden_size=16, pad_token_id=0,
                            hidden_activation="gelu_approximate",
                            layer_types=["full_attention"], rope_theta=10000.0,
                            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=4,
                            altup_num_inputs=2, laurel_rank=4, sliding_window=16,
                            intermediate_size=[32],
                            max_position_embeddings=16),
}

# Per task class: constructor arguments beyond the backbone.
TASK_OVERRIDES = {
    "Gemma4AssistantCausalLM": dict(backbone_hidden_size=16, num_centroids=4,
                                    centroid_intermediate_top_k=2,
                                    use_ordered_embeddings=False),
}

# Classes not built here, with the reason: each is checked against the discovered set.
NOT_BUILT = {
    "BLIP2CausalLM": "image-to-text: needs a vision encoder and a Q-Former (not a text task)",
    "BLIP2Seq2SeqLM": "image-to-text: needs a vision encoder and a Q-Former (not a text task)",
    "PaliGemmaCausalLM": "image-to-text: every batch needs images (not a text task)",
    "PARSeqCausalLM": "scene-text recognition: the input is an image (not a text task)",
    "MoonshineAudioToText": "speech-to-text: the encoder input is audio (not a text task)",
    "Gemma4AssistantCausalLM": "a draft model for speculative decoding: its call needs a "
                               "target model, it cannot run or train standalone",
}


def text_task_classes():
    """``{name: (class, kind)}`` for every text task class ``keras_hub.models`` exports."""
    models = keras_hub.models
    bases = [(kind, getattr(models, base)) for kind, base in KINDS]
    found = {}
    for name in sorted(dir(models)):
        cls = getattr(models, name)
        if not inspect.isclass(cls) or any(cls is base for _, base in bases):
            continue
        kinds = [kind for kind, base in bases if issubclass(cls, base)]
        if kinds and cls.__name__ not in found:
            # Seq2SeqLM subclasses CausalLM: the most specific kind names it
            found[cls.__name__] = (cls, kinds[-1] if len(kinds) > 1 else kinds[0])
    return found


def tiny_backbone(backbone_cls):
    params = inspect.signature(backbone_cls.__init__).parameters
    kwargs = {k: v for k, v in TINY.items() if k in params}
    kwargs.update(OVERRIDES.get(backbone_cls.__name__, {}))
    return backbone_cls(**kwargs)


def tiny_task(cls, kind):
    backbone = tiny_backbone(cls.backbone_cls)
    kwargs = dict(backbone=backbone, preprocessor=None)
    params = inspect.signature(cls.__init__).parameters
    if "num_classes" in params:
        kwargs["num_classes"] = 2
    if "dropout" in params:
        kwargs["dropout"] = 0.0
    kwargs.update(TASK_OVERRIDES.get(cls.__name__, {}))
    return cls(**kwargs)


def _padding(rng):
    mask = np.ones((BATCH, LENGTH), bool)
    mask[1, LENGTH // 2:] = False
    return mask


def tiny_batch(task, kind, seed=0):
    """``(x, y, sample_weight)`` for ``task`` from its own input names."""
    rng = np.random.default_rng(seed)
    names = list(task.input.keys()) if isinstance(task.input, dict) else ["token_ids"]
    x = {}
    for name in names:
        if name == "mask_positions":
            x[name] = np.stack([rng.choice(LENGTH // 2, MASKED, replace=False)
                                for _ in range(BATCH)]).astype("int32")
        elif name.endswith("padding_mask"):
            x[name] = _padding(rng)
        elif name.endswith("segment_ids"):
            x[name] = np.zeros((BATCH, LENGTH), "int32")
        elif name.endswith("position_ids"):
            x[name] = np.tile(np.arange(LENGTH, dtype="int32"), (BATCH, 1))
        elif name.endswith("token_ids"):
            x[name] = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
        else:
            raise ValueError(f"{type(task).__name__}: no tiny value for input {name!r}")
    if kind == "text classifier":
        return x, rng.integers(0, 2, BATCH).astype("int32"), None
    if kind == "masked LM":
        return (x, rng.integers(1, VOCAB, (BATCH, MASKED)).astype("int32"),
                np.ones((BATCH, MASKED), "float32"))
    prefix = "decoder_" if "decoder_token_ids" in x else ""
    y = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    return x, y, x[prefix + "padding_mask"].astype("float32")


def tiny_forward(cls, kind):
    """Build ``cls`` tiny and run it once on its batch (what NOT_BUILT is checked by)."""
    task = tiny_task(cls, kind)
    x, _, _ = tiny_batch(task, kind)
    return task, keras.ops.convert_to_numpy(task(x, training=False))
