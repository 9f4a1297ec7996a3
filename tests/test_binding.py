"""keras_dp_lm binds to Keras at one point: ``compile`` (issue 39).

Importing the package changes two members of Keras's ``Trainer`` class,
``compile`` (the binding point) and the ``dp_ledger`` property (so any model's
file carries its ledger), and nothing else; a model compiled without a DP
optimizer runs Keras's own code.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dp_lm as kdp

_SNAPSHOT = r"""
import inspect, json, sys
import keras, keras_hub
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
classes = {c for c in (keras.Model, keras.Sequential, keras_hub.models.CausalLM,
                       keras_hub.models.TextClassifier, keras.layers.Dense,
                       keras.optimizers.Adam) for c in inspect.getmro(c)
           if c.__module__.startswith(("keras", "tensorflow"))}
def snapshot():
    return {f"{c.__module__}.{c.__qualname__}": {k: id(v) for k, v in vars(c).items()}
            for c in classes}
before = snapshot()
finders = list(sys.meta_path)
import keras_dp_lm as kdp
kdp.DPAdam  # a DP optimizer in hand: what compile(optimizer=kdp.DPAdam(...)) needs
after = snapshot()
changed = sorted(f"{c}.{k}" for c in before for k in set(before[c]) | set(after[c])
                 if before[c].get(k) != after[c].get(k))
print(json.dumps({"changed": changed, "finders_left": len(sys.meta_path) - len(finders)}))
"""


def test_importing_the_package_changes_only_compile_and_dp_ledger():
    result = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["changed"] == ["keras.src.trainers.trainer.Trainer.compile",
                                 "keras.src.trainers.trainer.Trainer.dp_ledger"]
    assert report["finders_left"] == 0  # Keras was imported first: no import hook


_BOUND = {"fit", "train_on_batch", "make_train_function", "train_step",
          "_maybe_symbolic_build", "save", "get_config"}


_PLAIN_PROCESS = r"""
import json, numpy as np, keras, keras_dp_lm as kdp
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
model.fit(np.ones((4, 3)), np.zeros((4, 1)), verbose=0)
model.train_on_batch(np.ones((4, 3)), np.zeros((4, 1)))
print(json.dumps({"own": sorted(model.__dict__),
                  "ledger": kdp.ledger_of(model, create=False) is not None}))
"""


def test_a_model_without_a_dp_optimizer_runs_kerass_own_code():
    """In a process that has not DP-trained anything, a plain model gets no
    instance attribute from keras_dp_lm and no ledger."""
    result = subprocess.run([sys.executable, "-c", _PLAIN_PROCESS], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not _BOUND & set(report["own"]) and not report["ledger"]


def _dp_trained_layer(x, y):
    layer = keras.layers.Dense(3)
    dp = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1)])
    dp.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    dp.fit(x, y, batch_size=4, verbose=0)
    return dp, layer


class _Wrapper(keras.Model):
    def __init__(self):
        super().__init__()
        self.body = None
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(inputs if self.body is None else self.body(inputs))


@pytest.mark.parametrize("how", ["sequential_add_layer", "sequential_add_dp_model",
                                 "attribute"])
def test_a_plain_model_that_takes_dp_trained_weights_after_its_compile_is_refused(how):
    """Before: a plain model compiled first, then given DP-trained weights
    without a compile (``Sequential.add`` of the layer or of the DP model, a
    layer assigned to a subclassed model), trained them with plain SGD: the
    kernel moved by 587-1.8e6 and the DP model's ledger did not count it."""
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    if how == "attribute":
        plain = _Wrapper()
    else:
        plain = keras.Sequential([keras.Input((3,))])
    plain.compile(optimizer="sgd", loss="mse")  # before any DP training, maybe
    dp, layer = _dp_trained_layer(x, y)
    if how == "sequential_add_layer":
        plain.add(layer)
        plain.add(keras.layers.Dense(1))
    elif how == "sequential_add_dp_model":
        plain.add(dp)
    else:
        plain.body = layer
    before = layer.kernel.numpy().copy()
    with pytest.raises(RuntimeError, match="refused to train"):
        plain.fit(x * 100, y + 100, batch_size=8, verbose=0)
    with pytest.raises(RuntimeError, match="refused to train"):
        plain.train_on_batch(x * 100, y + 100)
    np.testing.assert_array_equal(before, layer.kernel.numpy())
    assert kdp.ledger_of(dp).updates == 2


def test_a_plain_model_holding_no_dp_trained_weights_trains_after_dp_training():
    """The guards a plain model gets once the process has DP-trained weights
    let it train its own weights, as Keras would."""
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    _dp_trained_layer(x, y)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    before = plain.layers[0].kernel.numpy().copy()
    plain.fit(x, y + 1, batch_size=8, verbose=0)
    plain.train_on_batch(x, y + 1)
    assert not np.array_equal(before, plain.layers[0].kernel.numpy())
    assert kdp.ledger_of(plain, create=False) is None


def test_a_dp_model_is_bound_and_a_recompile_without_dp_keeps_only_the_guards():
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    assert {"fit", "train_on_batch", "make_train_function", "train_step",
            "_maybe_symbolic_build"} <= set(model.__dict__)
    model.fit(x, y, batch_size=4, verbose=0)
    model.compile(optimizer="sgd", loss="mse")
    assert "_maybe_symbolic_build" not in model.__dict__
    with pytest.raises(RuntimeError, match="privacy ledger holds 2 DP updates"):
        model.fit(x, y, verbose=0)


def test_a_plain_model_compiled_before_its_layer_is_dp_trained_is_guarded_then():
    """The guards follow the weights: a model compiled with Adam on a layer
    that another model trains with DP afterwards refuses to train it."""
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    shared = keras.layers.Dense(1)
    plain = keras.Sequential([keras.Input((3,)), shared])
    plain.compile(optimizer="adam", loss="mse")
    dp = keras.Sequential([keras.Input((3,)), shared])
    dp.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    dp.fit(x, y, batch_size=4, verbose=0)
    before = shared.kernel.numpy().copy()
    with pytest.raises(RuntimeError, match="refused to train"):
        plain.fit(x, y, verbose=0)
    with pytest.raises(RuntimeError, match="refused to train"):
        plain.train_on_batch(x, y)
    np.testing.assert_array_equal(before, shared.kernel.numpy())


def test_a_dp_fit_on_a_dataset_does_not_warn_about_shuffling():
    """Keras warns that ``shuffle=True`` (its default) is ignored for a dataset; a DP
    fit on Poisson batches passes ``shuffle=False`` for the user (the batches are
    never reshuffled either way), so the warning does not suggest otherwise."""
    import warnings

    import tensorflow as tf

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 3), "float32"), np.zeros(8, "int32"))).batch(4)
    def shuffle_warnings(model, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(data, verbose=0, **kwargs)
        return [w for w in caught if "shuffle" in str(w.message)]

    assert shuffle_warnings(model) == []
    assert kdp.ledger_of(model).updates == 2
    # the user's own choice stands: the warning exactly when this Keras version
    # gives it to a model without DP
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    plain.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert bool(shuffle_warnings(model, shuffle=True)) == bool(
        shuffle_warnings(plain, shuffle=True))
    # a model without the DP step keeps Keras's own default, warning included
    assert "fit" in vars(plain)     # guarded: DP-trained weights exist in this process
    assert bool(shuffle_warnings(plain)) == bool(shuffle_warnings(plain, shuffle=True))
