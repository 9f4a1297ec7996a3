import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Under pytest-xdist (`make test` runs 2 workers on 2 cores) each TensorFlow would
# otherwise run as many intra-op threads as there are cores, so the workers' thread
# pools oversubscribe the machine: share the cores out instead (one thread each on 2
# cores; the full suite took 16-17.5 min instead of 19-22). Set the variable to override.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, _cores // max(1, _workers))))

import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_finish(session):
    """Every test module is imported now (TensorFlow, Keras, KerasHub: over a
    million long-lived objects): move them out of the garbage collector's view,
    so that each full collection during the tests (~20 per privacy-critical
    file, ~0.5 s each) scans only the objects the tests create. Nothing frozen
    is garbage (collected first); objects created later are collected as before."""
    gc.collect()
    gc.freeze()


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
