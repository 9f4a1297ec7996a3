import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_seeds():
    import keras

    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    yield
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def force(monkeypatch, request):
    """Force every linear layer's fast-clipping norm to one method ("ghost" or
    "instantiate", the fixture's indirect parameter) by closing the other's memory cap."""
    from keras_dp_lm.clipping import ghost

    mode = getattr(request, "param", None)
    if mode == "ghost":
        monkeypatch.setattr(ghost, "_INSTANTIATE_MAX_BYTES", -1)
    elif mode == "instantiate":
        monkeypatch.setattr(ghost, "_GHOST_MAX_BYTES", -1)
    return mode
