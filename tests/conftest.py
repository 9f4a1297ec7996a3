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
