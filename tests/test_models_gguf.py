"""GGUF -> KerasHub Llama3CausalLM: a round trip through a written file, and the real SmolLM2.

The round trip builds a small random ``Llama3Backbone``, writes it as llama.cpp
would (``[out, in]`` matrices, query / key rows in llama.cpp's rotary order, one
table 8-bit quantized) with ``gguf.GGUFWriter``, loads it back and compares
every weight and the logits. The SmolLM2 test loads the fetched 135M checkpoint
(``make data``): perplexity on an English paragraph and a greedy continuation.
"""

import gguf
import keras
import keras_hub
import numpy as np
import pytest

from keras_dp_lm import models

HEADS, KV, HIDDEN, FFN, LAYERS = 4, 2, 32, 48, 2   # HIDDEN: whole Q8_0 blocks of 32
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]


def _tokens_and_merges():
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", ".", ","]
    merges = ["t h", "th e", "Ġ the", "a n", "an d", "Ġ a"]
    merged = [m.replace(" ", "") for m in merges]
    return SPECIAL + chars + merged, merges


def _to_llama_cpp_rows(weight, num_heads):
    """llama.cpp's converter's per-head rotary row order (the inverse of the loader's)."""
    rows, cols = weight.shape
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
            .swapaxes(1, 2).reshape(rows, cols))


def _write_gguf(path, backbone, tokens, merges, quantize_table=False):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def add(name, value):
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))

    table = backbone.get_layer("token_embedding").embeddings.numpy()
    if quantize_table:
        q = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        add("token_embd.weight", table)
    if not backbone.tie_word_embeddings:
        add("output.weight", backbone.get_layer("token_embedding").reverse_embeddings.numpy().T)
    add("output_norm.weight", backbone.get_layer("sequence_output_layernorm").scale.numpy())
    for i in range(LAYERS):
        layer = backbone.get_layer(f"transformer_layer_{i}")
        att = layer._self_attention_layer
        b = f"blk.{i}."
        add(b + "attn_norm.weight", layer._self_attention_layernorm.scale.numpy())
        add(b + "ffn_norm.weight", layer._feedforward_layernorm.scale.numpy())
        q = att._query_dense.kernel.numpy().reshape(HIDDEN, -1).T
        k = att._key_dense.kernel.numpy().reshape(HIDDEN, -1).T
        add(b + "attn_q.weight", _to_llama_cpp_rows(q, HEADS))
        add(b + "attn_k.weight", _to_llama_cpp_rows(k, KV))
        add(b + "attn_v.weight", att._value_dense.kernel.numpy().reshape(HIDDEN, -1).T)
        add(b + "attn_output.weight", att._output_dense.kernel.numpy().reshape(-1, HIDDEN).T)
        add(b + "ffn_gate.weight", layer._feedforward_gate_dense.kernel.numpy().T)
        add(b + "ffn_up.weight", layer._feedforward_intermediate_dense.kernel.numpy().T)
        add(b + "ffn_down.weight", layer._feedforward_output_dense.kernel.numpy().T)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_backbone(tokens, tied):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=len(tokens), num_layers=LAYERS, num_query_heads=HEADS,
        num_key_value_heads=KV, hidden_dim=HIDDEN, intermediate_dim=FFN,
        layer_norm_epsilon=1e-5, tie_word_embeddings=tied)
    rng = np.random.default_rng(1)
    for v in backbone.weights:   # norm scales off 1, so a mixed-up scale shows
        v.assign(rng.normal(scale=0.5, size=v.shape).astype("float32"))
    return backbone


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_weights_logits_and_tokenizer(tmp_path, tied):
    tokens, merges = _tokens_and_merges()
    source = _random_backbone(tokens, tied)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, source, tokens, merges)

    lm = models.load_gguf_causal_lm(path, sequence_length=12)
    loaded = lm.backbone
    assert loaded.tie_word_embeddings == tied
    assert [v.path for v in loaded.weights] == [v.path for v in source.weights]
    for a, b in zip(loaded.weights, source.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    ids = np.random.default_rng(2).integers(0, len(tokens), (2, 9)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    np.testing.assert_allclose(loaded(x), source(x), rtol=1e-5, atol=1e-5)

    tokenizer = lm.preprocessor.tokenizer
    text = "the cat and the dog."
    pieces = [tokenizer.id_to_token(int(i)) for i in np.asarray(tokenizer(text))]
    assert "Ġthe" in pieces and "and" in pieces, pieces
    assert tokenizer.detokenize(tokenizer(text)) == text
    assert tokenizer.start_token_id == 0 and tokenizer.end_token_id == 1
    assert tokenizer("<|pad|>").shape == (1,)   # control tokens stay whole


def test_rotary_rows_are_undone_not_copied(tmp_path):
    """Loading the file without the inverse permutation would change the logits."""
    tokens, merges = _tokens_and_merges()
    source = _random_backbone(tokens, True)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, source, tokens, merges)
    checkpoint = models.GGUFCheckpoint(path)
    raw = checkpoint.tensor("blk.0.attn_q.weight")
    kernel = source.get_layer("transformer_layer_0")._self_attention_layer._query_dense.kernel
    expected = kernel.numpy().reshape(HIDDEN, -1).T
    assert not np.array_equal(raw, expected)
    np.testing.assert_array_equal(models.unpermute_rotary_rows(raw, HEADS), expected)


def test_quantized_table_and_bad_files(tmp_path):
    tokens, merges = _tokens_and_merges()
    source = _random_backbone(tokens, True)
    path = tmp_path / "q8.gguf"
    _write_gguf(path, source, tokens, merges, quantize_table=True)
    table = models.GGUFCheckpoint(path).tensor("token_embd.weight")
    exact = source.get_layer("token_embedding").embeddings.numpy()
    assert table.shape == exact.shape
    assert np.max(np.abs(table - exact)) <= 0.01 * np.max(np.abs(exact))   # Q8_0 blocks
    with pytest.raises(KeyError, match="no tensor"):
        models.GGUFCheckpoint(path).tensor("blk.9.attn_q.weight")
    with pytest.raises(ValueError, match="even size"):
        models.unpermute_rotary_rows(np.zeros((6, 2)), 2)


def test_missing_smollm2_names_the_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match="make data"):
        models.smollm2_path(tmp_path)


def test_smollm2_reads_as_english():
    lm = models.load_gguf_causal_lm(models.smollm2_path(), sequence_length=64)
    assert lm.backbone.count_params() == 134_515_008
    tokenizer = lm.preprocessor.tokenizer
    text = ("The weather was warm and sunny, so we decided to go to the park for a picnic. "
            "We packed sandwiches, fruit and cold drinks, and we spent the whole afternoon "
            "sitting under the trees, talking and reading books.")
    ids = np.asarray(tokenizer(text))[None]
    assert tokenizer.detokenize(ids[0]) == text
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
    ce = keras.losses.sparse_categorical_crossentropy(ids[:, 1:], lm(x), from_logits=True)
    perplexity = float(np.exp(np.mean(ce)))
    # Measured 14.7; 37.1 when the rotary rows are loaded in llama.cpp's order.
    assert 2.0 < perplexity < 22.0, perplexity
    continuation = lm.generate("The capital of France is", max_length=12)
    assert "Paris" in continuation, continuation


def test_without_the_gguf_extra_the_loader_names_the_install(monkeypatch, tmp_path):
    import sys

    from keras_dp_lm.models.gguf import GGUFCheckpoint

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now fails
    with pytest.raises(ImportError, match=r'keras-dp-lm\[gguf\]'):
        GGUFCheckpoint(tmp_path / "model.gguf")
