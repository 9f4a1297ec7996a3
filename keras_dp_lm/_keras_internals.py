"""Every touch of Keras's private API, in one place, behind a version guard.

keras_dp_lm needs a few things Keras does not export: the trainer class whose
``compile`` it wraps, the loss helpers that define Keras's reductions, the
mask attached to tensors, and the base class of objects Keras saves. They are
imported here only; the rest of the package imports them from this module.
A Keras version outside ``TESTED_KERAS`` raises at import, so a Keras upgrade
fails loudly instead of silently changing what the DP step computes.
"""

import keras

# The Keras minors whose private API below was read and tested (oldest first);
# pyproject.toml's `keras` range covers exactly these (tests/test_versions.py).
# 3.13 and 3.14 differ from 3.15 only in code this module does not reach
# (trainer log conversion, Loss's mask arithmetic, compile_utils' output-name
# resolution, SeedGenerator.get_config); every name imported here, the
# attributes read below and the trainer methods training/binding.py wraps
# (compile, fit, train_on_batch, make_train_function, train_step,
# _maybe_symbolic_build, _symbolic_build) have the same signatures and meaning in
# 3.13, 3.14 and 3.15, so no branch is needed yet. A difference goes here, as a
# branch on KERAS_MINOR naming the versions.
TESTED_KERAS = ("3.13", "3.14", "3.15")

# The KerasHub minors whose private modules (_KERAS_HUB_LAYERS, pretokenize) were
# checked; pyproject.toml's `keras-hub` range covers exactly these. KerasHub
# 0.30+ requires Keras >= 3.15, so Keras 3.13 / 3.14 come with KerasHub 0.29.
# Between 0.29 and 0.32 the layers the clipping rules cover compute the same
# forward pass (0.32 adds a vLLM serving path to PositionEmbedding, inactive
# outside vLLM, and gathers in MaskedLMHead with take_along_axis instead of
# tf.gather), and `pretokenize` has the same signature. KerasHub is imported
# lazily, so its version is not checked at import: a moved class makes
# keras_hub_layer return None (exact per-example gradients, never wrong ones).
TESTED_KERAS_HUB = ("0.29", "0.30", "0.31", "0.32")


def _minor(version):
    """``(major, minor)`` of a version string such as ``"3.15.1"``."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _check_version(version):
    if not any(version == v or version.startswith(v + ".") for v in TESTED_KERAS):
        raise ImportError(
            f"keras_dp_lm relies on Keras internals tested with Keras "
            f"{', '.join(TESTED_KERAS)}.x, but Keras {version} is installed. Install "
            f"a Keras in that range (see pyproject.toml), or check "
            "keras_dp_lm/_keras_internals.py against the new version and "
            "extend TESTED_KERAS.")


_check_version(keras.__version__)
KERAS_MINOR = _minor(keras.__version__)  # for version branches, e.g. >= (3, 15)

# pylint: disable=wrong-import-position
from keras.src import tree  # noqa: E402
from keras.src.backend import get_keras_mask  # noqa: E402
from keras.src.backend.common import global_state  # noqa: E402
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: E402
from keras.src.losses.loss import squeeze_or_expand_to_same_rank  # noqa: E402
from keras.src.random import seed_generator as _seed_generator  # noqa: E402
from keras.src.losses.loss import standardize_reduction  # noqa: E402
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402
from keras.src.trainers.trainer import Trainer  # noqa: E402

__all__ = [
    "KerasSaveable",
    "name_counters",
    "restore_name_counters",
    "TensorFlowTrainer",
    "Trainer",
    "get_keras_mask",
    "global_seed_generator",
    "keras_hub_layer",
    "keras_hub_pretokenize",
    "set_global_seed_generator",
    "squeeze_or_expand_to_same_rank",
    "standardize_reduction",
    "tree",
]


def compiled_loss_terms(model):
    """``[(path, loss_fn, loss_weight), ...]`` of a model's compiled loss."""
    return [(path, fn, weight) for path, fn, weight, _ in model._compile_loss._flat_losses]


def call_has_training_arg(model):
    return model._call_has_training_arg


def has_compiled_metrics(model):
    return model._compile_metrics is not None or bool(model._metrics)


def distribute_strategy_of(model):
    """The strategy the model was created under, or None."""
    return model._distribute_strategy


def loss_tracker(model):
    return model._loss_tracker


def flatten_layers(model, include_self=False):
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def keras_hub_lora_found_nothing(backbone):
    """Whether ``backbone`` is a KerasHub backbone on which ``enable_lora(rank)``
    ran (it froze every layer) and put adapters on none of them (no layer had
    one of the target names). Reads the two attributes ``Backbone.enable_lora``
    sets (KerasHub 0.29-0.32)."""
    return (getattr(backbone, "_lora_rank", None) is not None
            and not getattr(backbone, "_lora_enabled_layers", None)
            and callable(getattr(backbone, "default_lora_layer_names", None)))


def epoch_iterator_element_spec(iterator):
    """The element spec of the dataset a Keras ``TFEpochIterator`` reads, or
    None; read without iterating (a fresh iterator over a generator-backed
    dataset would draw from it)."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    return getattr(dataset, "element_spec", None)


def name_counters():
    """A copy of Keras's auto-name counters (what makes the next Dense ``dense_3``)."""
    uids = global_state.get_global_attribute("object_name_uids", default=None)
    return {} if uids is None else dict(uids)


def restore_name_counters(counters):
    """Set Keras's auto-name counters back to ``counters`` (from :func:`name_counters`)."""
    import collections

    global_state.set_global_attribute("object_name_uids",
                                      collections.defaultdict(int, counters))


def global_seed_generator():
    """Keras's global ``SeedGenerator`` (layers without a seed draw from it), or None."""
    return global_state.get_global_attribute(_seed_generator.GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(generator):
    """Replace Keras's global ``SeedGenerator`` (``None`` resets it)."""
    global_state.set_global_attribute(_seed_generator.GLOBAL_SEED_GENERATOR, generator)


# KerasHub layer classes fast clipping has rules for, by the name
# keras_hub_layer takes: (module of KerasHub's private tree, class name).
_KERAS_HUB_LAYERS = {
    "PositionEmbedding": ("keras_hub.src.layers.modeling.position_embedding",
                          "PositionEmbedding"),
    "LlamaLayerNorm": ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"),
    "RMSNormalization": ("keras_hub.src.layers.modeling.rms_normalization",
                         "RMSNormalization"),
    "GemmaRMSNormalization": ("keras_hub.src.models.gemma.rms_normalization",
                              "RMSNormalization"),
    "MaskedLMHead": ("keras_hub.src.layers.modeling.masked_lm_head", "MaskedLMHead"),
    # RMS norms of single model families; the clipping rule checks each one's
    # `call` source against the forms it describes (normalization.py).
    "Gemma3RMSNormalization": ("keras_hub.src.models.gemma3.gemma3_layers",
                               "RMSNormalization"),
    "MistralLayerNormalization": ("keras_hub.src.models.mistral.mistral_layer_norm",
                                  "MistralLayerNormalization"),
    "MixtralLayerNormalization": ("keras_hub.src.models.mixtral.mixtral_layer_norm",
                                  "MixtralLayerNormalization"),
    "QwenLayerNorm": ("keras_hub.src.models.qwen.qwen_layernorm", "QwenLayerNorm"),
    "QwenMoeLayerNorm": ("keras_hub.src.models.qwen_moe.qwen_moe_layernorm",
                         "QwenMoeLayerNorm"),
    "Qwen3LayerNorm": ("keras_hub.src.models.qwen3.qwen3_layernorm", "Qwen3LayerNorm"),
    "Qwen3MoeLayerNorm": ("keras_hub.src.models.qwen3_moe.qwen3_moe_layernorm",
                          "Qwen3MoeLayerNorm"),
    "Phi3LayerNorm": ("keras_hub.src.models.phi3.phi3_layernorm", "Phi3LayerNorm"),
    "GptOssLayerNormalization": ("keras_hub.src.models.gpt_oss.gpt_oss_layer_norm",
                                 "GptOssLayerNormalization"),
    "T5LayerNorm": ("keras_hub.src.models.t5.t5_layer_norm", "T5LayerNorm"),
    "ReversibleEmbedding": ("keras_hub.src.layers.modeling.reversible_embedding",
                            "ReversibleEmbedding"),
}


def keras_hub_layer(name):
    """KerasHub's layer class ``name`` (a key of ``_KERAS_HUB_LAYERS``), or
    None when KerasHub is missing or has moved it."""
    path, attr = _KERAS_HUB_LAYERS[name]
    try:
        import importlib
        return getattr(importlib.import_module(path), attr)
    except Exception:  # pragma: no cover - keras_hub missing or moved
        return None


def keras_hub_pretokenize():
    """The function KerasHub's ``WordPieceTokenizer`` splits its input with
    (private API of the pinned keras-hub; the public tokenizer offers no
    word-level output)."""
    from keras_hub.src.tokenizers.word_piece_tokenizer import pretokenize
    return pretokenize


def writing_legacy_h5():
    """Whether Keras is serializing for a legacy HDF5 (``.h5``) file: its
    writer sets this option around ``get_config`` (Keras 3.15)."""
    return bool(global_state.get_global_attribute("use_legacy_config", False))
