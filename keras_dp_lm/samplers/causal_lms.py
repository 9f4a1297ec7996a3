"""Checks on the KerasHub ``CausalLM`` models a sampler mixes: each is one, and
they share one vocabulary (size, and the tokens when their tokenizers are loaded);
and the stop-token test of a decoding loop over them (:func:`_any_equal`)."""

from keras import ops


def _check_causal_lm(model, name):
    backbone = getattr(model, "backbone", None)
    if backbone is None or getattr(backbone, "vocabulary_size", None) is None \
            or not callable(getattr(model, "call_with_cache", None)) \
            or not callable(getattr(model, "_build_cache", None)):
        raise ValueError(
            f"`{name}` must be a KerasHub CausalLM (with `backbone.vocabulary_size`, "
            f"`call_with_cache` and `_build_cache`). Received: {model!r}")
    return model


def _tokenizer_vocabulary(model):
    tokenizer = getattr(getattr(model, "preprocessor", None), "tokenizer", None)
    get = getattr(tokenizer, "get_vocabulary", None)
    if get is None:
        return None
    try:
        return list(get())
    except Exception:  # an unloaded tokenizer: nothing to compare
        return None


def _check_same_vocabulary(models, names):
    sizes = [int(m.backbone.vocabulary_size) for m in models]
    if len(set(sizes)) != 1:
        raise ValueError(
            "The public and private models must share one vocabulary; their "
            "vocabulary sizes differ: " + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)))
    reference = None
    for model, name in zip(models, names):
        vocabulary = _tokenizer_vocabulary(model)
        if vocabulary is None:
            continue
        if reference is None:
            reference = (name, vocabulary)
        elif vocabulary != reference[1]:
            raise ValueError(
                f"The public and private models must share one vocabulary: the "
                f"tokenizers of {reference[0]} and {name} differ (same size "
                f"{sizes[0]}, different tokens).")
    return sizes[0]


def _any_equal(inputs, values, padding_mask):
    output = ops.equal(inputs, values[0])
    for value in values[1:]:
        output = ops.logical_or(output, ops.equal(inputs, value))
    return ops.logical_and(output, padding_mask)
