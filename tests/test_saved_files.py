"""Files saved by an earlier version load with their privacy ledger (issue 39).

``tests/data/ledger_v0.*`` were written at commit 57c1e0a under Keras 3.13.2 (see
``tests/data/README.md``). Every way Keras offers to read them must bring back the
weights and the ledger, and DP training from them must count on from it.
"""

import os

import keras
import numpy as np
import pytest

import keras_dp_lm as kdp

DATA = os.path.join(os.path.dirname(__file__), "data")
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OLD_ROWS = [(1.0, 0.0, 8.0, 3)]  # 3 updates, sigma 1, batch 8


def _build():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="base"),
                             keras.layers.Dense(3, name="head")])


def _dp_compile(model):
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)


def _old_weights():
    with np.load(os.path.join(DATA, "ledger_v0_weights.npz")) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.mark.parametrize("how", ["dp_compiled_load_weights", "plain_load_weights",
                                 "keras_file_load_weights", "load_model",
                                 "load_model_no_compile"])
def test_files_saved_before_load_with_their_ledger_and_count_on(how):
    if how == "load_model":
        model = keras.models.load_model(os.path.join(DATA, "ledger_v0.keras"))
    elif how == "load_model_no_compile":
        model = keras.models.load_model(os.path.join(DATA, "ledger_v0.keras"),
                                        compile=False)
    else:
        model = _build()
        if how == "dp_compiled_load_weights":
            _dp_compile(model)
        name = "ledger_v0.keras" if how == "keras_file_load_weights" else \
            "ledger_v0.weights.h5"
        model.load_weights(os.path.join(DATA, name))
    assert kdp.ledger_of(model).rows() == OLD_ROWS
    for got, want in zip(model.get_weights(), _old_weights()):
        np.testing.assert_array_equal(got, want)
    _dp_compile(model)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 4)).astype("float32"), np.arange(8) % 3, batch_size=8,
              verbose=0)
    assert kdp.ledger_of(model).updates == 4
