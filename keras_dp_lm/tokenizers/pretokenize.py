"""Examples and words: privacy units from a text, words as the KerasHub tokenizer splits them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import tensorflow as tf


def split_examples(text: str, unit: str = "paragraph") -> list[str]:
    """Split a text into privacy units: ``unit`` is ``"paragraph"`` (the default,
    blank-line separated) or ``"line"``.

    In the Shakespeare texts a paragraph is one speech (speaker tag + lines).
    Empty units are dropped.

    Example:
        >>> split_examples("HAMLET.\\nTo be.\\n\\nOPHELIA.\\nMy lord.")
        ['HAMLET.\\nTo be.', 'OPHELIA.\\nMy lord.']
        >>> split_examples("To be,\\n\\nor not", unit="line")
        ['To be,', 'or not']
    """
    if unit == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    elif unit == "line":
        parts = text.splitlines()
    else:
        raise ValueError(f"`unit` must be 'paragraph' or 'line'. Received: unit={unit!r}")
    return [p.strip() for p in parts if p.strip()]


def _pretokenize_batch(strings, lowercase, strip_accents, nfkc):
    """Split a batch of strings the way ``WordPieceTokenizer(split=True)`` does.

    Returns ``(flat_words: np.ndarray[bytes], row_lengths: np.ndarray[int])``.
    """
    import tensorflow_text as tf_text  # noqa: PLC0415
    # The exact function KerasHub's WordPieceTokenizer calls on its input, so the
    # histogram's words are the words the tokenizer will see.
    from keras_dp_lm import _keras_internals as keras_internals  # noqa: PLC0415

    pretokenize = keras_internals.keras_hub_pretokenize()

    text = tf.convert_to_tensor(strings, dtype=tf.string)
    if nfkc and not lowercase:  # case_fold_utf8 already applies NFKC
        text = tf_text.normalize_utf8(text, "NFKC")
    words = pretokenize(text, lowercase=lowercase, strip_accents=strip_accents,
                        split=True, split_on_cjk=True)
    return words.flat_values.numpy(), words.row_lengths().numpy()


def _string_batches(data, batch_size):
    """Yield lists/tensors of example strings from any supported ``data``."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise ValueError(
                "`data` is a single string, which is read as a file path, but no such "
                "file exists (the string is not shown: it may be private text). Pass a "
                "list of strings (one per example), a tf.data.Dataset of strings, or "
                "pathlib.Path file paths.")
        data = [path]
    if isinstance(data, (bytes, bytearray)):
        raise ValueError("`data` must be a dataset or an iterable of strings; received bytes.")
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        if not isinstance(spec, tf.TensorSpec) or spec.dtype != tf.string:
            raise ValueError(
                "The elements of `data` must be strings (tf.string tensors); received "
                f"element_spec={spec}. Map the dataset to its text field first.")
        if spec.shape.rank == 0:
            data = data.batch(batch_size)
        elif spec.shape.rank != 1:
            data = data.map(lambda x: tf.reshape(x, [-1]))
        for batch in data:
            yield batch
        return
    if isinstance(data, tf.Tensor):
        if data.dtype != tf.string:
            raise ValueError(f"`data` must hold strings; received a tensor of dtype {data.dtype}.")
        data = data.numpy().reshape(-1).tolist()
    try:
        iterator = iter(data)
    except TypeError:
        raise ValueError(
            "`data` must be a tf.data.Dataset of strings, an iterable of strings, or file "
            f"paths; received {type(data).__name__}.") from None
    batch = []
    for element in iterator:
        if isinstance(element, os.PathLike):
            with open(element, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        batch.append(line.rstrip("\n"))
                        if len(batch) >= batch_size:
                            yield batch
                            batch = []
            continue
        if isinstance(element, bytes):
            element = element.decode("utf-8", errors="replace")
        if not isinstance(element, str):
            raise ValueError(
                f"An element of `data` is a {type(element).__name__}, not text. Pass strings "
                "(one per example) or pathlib.Path file paths. (The message names no element "
                "and shows no content: the data are private.)")
        batch.append(element)
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch
