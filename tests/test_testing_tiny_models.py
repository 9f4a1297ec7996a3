"""Tests for keras_dp_lm.testing: offline tokenizers and tiny KerasHub presets."""

import random

import keras_hub
import numpy as np
import pytest

from keras_dp_lm import testing

SAMPLES = [
    "To be, or not to be: that is the question!",
    "Ünïcødé ✓ and digits 1234\nsecond line\twith a tab  and two spaces",
    "Enter HAMLET.\n\nHAMLET. O, that this too too solid flesh would melt,",
]


@pytest.fixture(scope="module")
def bpe():
    return testing.train_byte_level_bpe([testing.DEFAULT_TEXT], vocabulary_size=400)


def test_bpe_vocabulary_layout(bpe):
    vocabulary, merges = bpe
    byte_symbols = testing.bytes_to_unicode()
    assert len(set(byte_symbols.values())) == 256
    # The 256 byte symbols first, in byte order; ids are 0..n-1; special token last.
    for b in range(256):
        assert vocabulary[byte_symbols[b]] == b
    assert sorted(vocabulary.values()) == list(range(len(vocabulary)))
    assert len(vocabulary) == 400
    assert vocabulary["<|endoftext|>"] == 399
    assert len(merges) == 400 - 257
    for merge in merges:
        a, b = merge.split(" ")
        assert a in vocabulary and b in vocabulary and a + b in vocabulary
    # The most frequent pair in the text is merged first: "Ġ" + "t" (" t...").
    assert merges[0] == "Ġ t"
    # Deterministic.
    assert testing.train_byte_level_bpe([testing.DEFAULT_TEXT], 400) == bpe


def test_bpe_rejects_too_small_vocabulary():
    with pytest.raises(ValueError, match="at least 257"):
        testing.train_byte_level_bpe(["abc"], vocabulary_size=256)


def test_bpe_stops_when_text_runs_out_of_pairs():
    vocabulary, merges = testing.train_byte_level_bpe(["ab ab ab"], 1000)
    # "ab ab ab" -> pieces "ab", " ab", " ab": merges a+b, Ġ+ab ... and no more.
    assert merges == ["a b", "Ġ ab"]
    assert len(vocabulary) == 256 + 2 + 1


def test_gpt2_tokenizer_round_trips(bpe):
    vocabulary, merges = bpe
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    for text in SAMPLES:
        ids = tokenizer(text)
        assert tokenizer.detokenize(ids) == text
        assert len(ids) < len(text.encode("utf-8"))  # merges are used
    assert tokenizer.end_token_id == vocabulary["<|endoftext|>"]


def test_llama_tokenizer_round_trips():
    tokenizer = testing.llama_tokenizer([testing.DEFAULT_TEXT], vocabulary_size=320)
    assert tokenizer.vocabulary_size() <= 320
    assert (tokenizer.pad_token_id, tokenizer.start_token_id, tokenizer.end_token_id) == (0, 1, 2)
    for text in SAMPLES:
        ids = tokenizer(text)
        assert tokenizer.detokenize(ids) == text


def test_llama_tokenizer_rejects_too_small_vocabulary():
    with pytest.raises(ValueError, match="at least 300"):
        testing.train_sentencepiece([testing.DEFAULT_TEXT], vocabulary_size=100)


def _logits(causal_lm, prompts):
    x = causal_lm.preprocessor.generate_preprocess(prompts, sequence_length=16)
    return np.asarray(causal_lm({"token_ids": x["token_ids"],
                                 "padding_mask": x["padding_mask"]}))


def test_gpt2_preset_saves_and_reloads_with_identical_logits(tmp_path):
    saved = testing.save_tiny_gpt2_preset(tmp_path / "gpt2", vocabulary_size=512)
    loaded = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "gpt2"))
    assert loaded.backbone.vocabulary_size == saved.backbone.vocabulary_size == 512
    assert loaded.backbone.num_layers == 2 and loaded.backbone.hidden_dim == 32
    assert loaded.preprocessor.tokenizer.vocabulary == saved.preprocessor.tokenizer.vocabulary
    prompts = ["To be, or not", "Enter HAMLET."]
    a, b = _logits(saved, prompts), _logits(loaded, prompts)
    assert a.shape == (2, 16, 512)
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(a).all() and a.std() > 0


def test_llama_preset_saves_and_reloads_with_identical_logits(tmp_path):
    saved = testing.save_tiny_llama_preset(tmp_path / "llama", vocabulary_size=400)
    loaded = keras_hub.models.LlamaCausalLM.from_preset(str(tmp_path / "llama"))
    assert loaded.backbone.num_query_heads == 2 and loaded.backbone.num_key_value_heads == 1
    vocab = saved.backbone.vocabulary_size
    assert loaded.backbone.vocabulary_size == vocab <= 400
    a, b = _logits(saved, ["To be, or not"]), _logits(loaded, ["To be, or not"])
    assert a.shape == (1, 16, vocab)
    np.testing.assert_array_equal(a, b)


def test_tiny_model_weights_depend_only_on_seed_and_leave_global_rng_alone():
    state = random.getstate()
    a = testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT], vocabulary_size=300, seed=3)
    assert random.getstate() == state
    b = testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT], vocabulary_size=300, seed=3)
    c = testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT], vocabulary_size=300, seed=4)
    wa, wb, wc = a.get_weights(), b.get_weights(), c.get_weights()
    assert all(np.array_equal(x, y) for x, y in zip(wa, wb))
    assert not all(np.array_equal(x, y) for x, y in zip(wa, wc))


def test_text_passages_cover_the_text_in_order():
    text = testing.DEFAULT_TEXT + "x" * 700
    passages = testing.text_passages([text], passage_chars=100)
    assert "".join(passages) == text
    assert max(len(p) for p in passages) <= 100 and len(passages) >= len(text) // 100


def test_default_texts_fall_back_to_builtin_paragraph(monkeypatch):
    monkeypatch.setattr(testing.tiny_models, "_find_shakespeare", lambda: None)
    assert testing.default_texts() == [testing.DEFAULT_TEXT]
