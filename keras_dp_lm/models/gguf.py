"""Load a llama-architecture GGUF checkpoint into a KerasHub ``Llama3CausalLM``.

GGUF (llama.cpp's file format) holds the weights, possibly quantized, and the
tokenizer. :func:`load_gguf_causal_lm` reads it with PyPI ``gguf``, dequantizes
every tensor to float32 and builds a ``keras_hub.models.Llama3CausalLM`` with a
``Llama3Tokenizer`` (byte-level BPE from the file's tokens and merges) and its
preprocessor, all offline.

Conventions undone here:

* GGUF stores matrices as ``[out, in]`` (numpy order); KerasHub's kernels are
  ``[in, ...]``;
* llama.cpp's converter permutes the query and key rows of each head for its
  rotary-embedding layout (pairs ``(2i, 2i+1)`` instead of halves); the inverse
  is applied per head (:func:`unpermute_rotary_rows`). Without it the model
  runs but its perplexity is several times worse.

The converted model differs from the original in two documented ways: the
weights are those of the file (SmolLM2's packaged file is 4-bit quantized,
``Q4_1``, with an 8-bit table), and KerasHub's BPE splits text with GPT-2's
regular expression, whereas SmolLM2's tokenizer also splits digits one by one:
numbers are segmented differently (still into valid tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import os

    import keras_hub

_CONTROL = 3   # GGUF token type of special (control) tokens


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary row order of a ``[heads * head_dim, in]`` matrix.

    ``weight``: the query or key projection as read from the GGUF file;
    ``num_heads``: its number of heads (``head_dim`` must be even).

    Example:
        >>> import numpy as np
        >>> w = np.arange(8 * 2).reshape(8, 2)          # 2 heads of 4 rows
        >>> unpermute_rotary_rows(w, 2)[:4, 0].tolist()  # rows 0, 2, 1, 3 of head 0
        [0, 4, 2, 6]
    """
    weight = np.asarray(weight)
    rows, cols = weight.shape
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    return (weight.reshape(num_heads, head_dim // 2, 2, cols)
            .swapaxes(1, 2).reshape(rows, cols))


class GGUFCheckpoint:
    """The metadata, tokenizer and dequantized tensors of one GGUF file.

    Args:
        path: the ``.gguf`` file.

    Example (needs a fetched file, see :func:`keras_dp_lm.models.smollm2_path`):

        ckpt = GGUFCheckpoint(smollm2_path())
        ckpt.field("llama.block_count")      # 30
        ckpt.tensor("blk.0.attn_q.weight")   # float32 [576, 576], [out, in]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        gguf = _gguf()
        self.path = str(path)
        self._reader = gguf.GGUFReader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self.field("general.architecture")

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value under ``key`` (e.g. ``"llama.embedding_length"``: a
        str, number or list), or ``default`` if absent."""
        f = self._reader.fields.get(key)
        return default if f is None else f.contents()

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` dequantized to float32, in numpy (``[out, in]``) order."""
        gguf = _gguf()
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))
        return np.asarray(data, np.float32).reshape(shape)

    def backbone_config(self) -> dict[str, Any]:
        """``keras_hub.models.Llama3Backbone`` arguments of a llama-architecture file."""
        if self.architecture != "llama":
            raise ValueError(f"{self.path}: architecture {self.architecture!r}, only "
                             "'llama' is supported")
        a = "llama."
        hidden = int(self.field(a + "embedding_length"))
        heads = int(self.field(a + "attention.head_count"))
        rope_dim = self.field(a + "rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != hidden // heads:
            raise ValueError(f"partial rotary embeddings ({rope_dim} of {hidden // heads}) "
                             "are not supported by Llama3Backbone")
        if self.field(a + "rope.scaling.type") not in (None, "none"):
            raise ValueError("rope scaling in the GGUF file is not supported")
        vocab = self.field(a + "vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        return dict(
            vocabulary_size=int(vocab),
            num_layers=int(self.field(a + "block_count")),
            num_query_heads=heads,
            num_key_value_heads=int(self.field(a + "attention.head_count_kv", heads)),
            hidden_dim=hidden,
            intermediate_dim=int(self.field(a + "feed_forward_length")),
            rope_max_wavelength=float(self.field(a + "rope.freq_base", 10000.0)),
            layer_norm_epsilon=float(self.field(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in self._tensors,
        )

    def tokenizer(self, start_token: str | None = None, end_token: str | None = None,
                  **kwargs: Any) -> keras_hub.models.Llama3Tokenizer:
        """A ``keras_hub.models.Llama3Tokenizer`` with the file's BPE vocabulary and merges.

        The start / end tokens are the file's bos / eos unless ``start_token`` /
        ``end_token`` name other tokens of the vocabulary (e.g. SmolLM2's
        document separator ``"<|endoftext|>"`` for plain text instead of its chat
        markers); the other control tokens are kept whole (never split by BPE).
        """
        import keras_hub

        if self.field("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{self.path}: tokenizer model "
                             f"{self.field('tokenizer.ggml.model')!r}, only byte-level BPE "
                             "('gpt2') is supported")
        tokens = self.field("tokenizer.ggml.tokens")
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self.field("tokenizer.ggml.merges")
        bos = start_token or tokens[int(self.field("tokenizer.ggml.bos_token_id"))]
        eos = end_token or tokens[int(self.field("tokenizer.ggml.eos_token_id"))]
        for token in (bos, eos):
            if token not in tokens:
                raise ValueError(f"{token!r} is not a token of {self.path}")
        special = {t for t, kind in zip(tokens, types) if int(kind) == _CONTROL}
        return keras_hub.models.Llama3Tokenizer(
            vocabulary={t: i for i, t in enumerate(tokens)}, merges=list(merges),
            bos_token=bos, eos_token=eos, misc_special_tokens=special - {bos, eos},
            **kwargs)

    def load_weights_into(
            self, backbone: keras_hub.models.Llama3Backbone) -> keras_hub.models.Llama3Backbone:
        """Assign every tensor of the file to ``backbone`` (a built ``Llama3Backbone``).

        Raises ``ValueError`` naming the first tensor whose shape does not fit.
        """
        cfg = self.backbone_config()
        heads, kv = cfg["num_query_heads"], cfg["num_key_value_heads"]
        hidden = cfg["hidden_dim"]
        head_dim = hidden // heads

        def put(variable, value, name):
            value = np.asarray(value, np.float32)
            if tuple(variable.shape) != value.shape:
                raise ValueError(f"{name}: shape {value.shape} does not fit "
                                 f"{variable.path} {tuple(variable.shape)}")
            variable.assign(value)

        embedding = backbone.get_layer("token_embedding")
        put(embedding.embeddings, self.tensor("token_embd.weight"), "token_embd.weight")
        if not cfg["tie_word_embeddings"]:
            put(embedding.reverse_embeddings, self.tensor("output.weight").T, "output.weight")
        put(backbone.get_layer("sequence_output_layernorm").scale,
            self.tensor("output_norm.weight"), "output_norm.weight")
        for i in range(cfg["num_layers"]):
            layer = backbone.get_layer(f"transformer_layer_{i}")
            attention = layer._self_attention_layer
            b = f"blk.{i}."
            q = unpermute_rotary_rows(self.tensor(b + "attn_q.weight"), heads)
            k = unpermute_rotary_rows(self.tensor(b + "attn_k.weight"), kv)
            parts = [
                (layer._self_attention_layernorm.scale, self.tensor(b + "attn_norm.weight"),
                 "attn_norm"),
                (layer._feedforward_layernorm.scale, self.tensor(b + "ffn_norm.weight"),
                 "ffn_norm"),
                (attention._query_dense.kernel, q.T.reshape(hidden, heads, head_dim), "attn_q"),
                (attention._key_dense.kernel, k.T.reshape(hidden, kv, head_dim), "attn_k"),
                (attention._value_dense.kernel,
                 self.tensor(b + "attn_v.weight").T.reshape(hidden, kv, head_dim), "attn_v"),
                (attention._output_dense.kernel,
                 self.tensor(b + "attn_output.weight").T.reshape(heads, head_dim, hidden),
                 "attn_output"),
                (layer._feedforward_gate_dense.kernel, self.tensor(b + "ffn_gate.weight").T,
                 "ffn_gate"),
                (layer._feedforward_intermediate_dense.kernel,
                 self.tensor(b + "ffn_up.weight").T, "ffn_up"),
                (layer._feedforward_output_dense.kernel, self.tensor(b + "ffn_down.weight").T,
                 "ffn_down"),
            ]
            for variable, value, name in parts:
                put(variable, value, b + name)
        return backbone


def _gguf():
    """PyPI ``gguf``, an optional dependency (``pip install "keras-dp-lm[gguf]"``)."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError(
            "Reading GGUF checkpoints needs the optional `gguf` package: "
            'pip install "keras-dp-lm[gguf]" (or pip install "gguf==0.19.0").') from error
    return gguf


def load_gguf_causal_lm(path: str | os.PathLike[str], sequence_length: int = 256,
                        dtype: str | None = None, start_token: str | None = None,
                        end_token: str | None = None) -> keras_hub.models.Llama3CausalLM:
    """A ``keras_hub.models.Llama3CausalLM`` (weights, tokenizer, preprocessor) from a GGUF file.

    Args:
        path: a llama-architecture ``.gguf`` file with a byte-level BPE
            tokenizer (e.g. :func:`keras_dp_lm.models.smollm2_path`).
        sequence_length: the preprocessor's packed length.
        dtype: the backbone's dtype policy (e.g. ``"bfloat16"``); weights are
            dequantized to float32 first.
        start_token, end_token: the preprocessor's start / end tokens, when not
            the file's bos / eos (see :meth:`GGUFCheckpoint.tokenizer`).

    Returns:
        The causal LM, ready for ``generate``, ``fit`` and
        ``backbone.enable_lora(rank)``.

    Example:

        lm = load_gguf_causal_lm(keras_dp_lm.models.smollm2_path())
        lm.generate("The capital of France is", max_length=16)
    """
    import keras_hub

    checkpoint = GGUFCheckpoint(path)
    backbone = keras_hub.models.Llama3Backbone(dtype=dtype, **checkpoint.backbone_config())
    checkpoint.load_weights_into(backbone)
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        checkpoint.tokenizer(start_token, end_token), sequence_length=sequence_length)
    return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=preprocessor)
