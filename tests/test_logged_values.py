"""Values logged by a DP fit must not let callbacks decide from private records:
non-finite or huge losses of training examples, validation splits of private
records, and training values logged under 'val_' names.
"""

import numpy as np
import pytest
import keras

import keras_dp_lm as kdp
from privacy_helpers import SCCE
from privacy_helpers import dense_model as _dense
from privacy_helpers import random_data as _data
from privacy_helpers import trainable_weights as _weights


def test_callbacks_deciding_from_private_values_are_refused():
    """Before: the step drops a non-finite example's gradient but logged its NaN
    loss, so TerminateOnNaN stopped fit at the first batch holding that record
    (4-10 updates of 24 with it, 24 without: membership with probability 0.96).
    A huge finite loss overflowed Keras's epoch mean the same way,
    and EarlyStopping on val_loss of a validation_split (private records) stopped
    2 epochs in instead of 5. Such callbacks now refuse the DP fit."""
    x, y = _data(16)
    x[12] = np.inf  # not in the first batch (the probe refuses non-finite rows)
    model = _dense(noise_multiplier=1.0)
    history = model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    assert kdp.ledger_of(model).updates == 4
    assert np.all(np.isfinite(history.history["loss"]))  # the inf row counts 0
    assert all(np.all(np.isfinite(w)) for w in _weights(model))
    for callback in (keras.callbacks.EarlyStopping(monitor="loss"),
                     keras.callbacks.ReduceLROnPlateau(monitor="loss"),
                     keras.callbacks.ModelCheckpoint("best.keras", monitor="loss",
                                                     save_best_only=True),
                     keras.callbacks.TerminateOnNaN()):
        with pytest.raises(ValueError, match=f"{type(callback).__name__} acts on 'loss'"):
            model.fit(x[:4], y[:4], batch_size=4, verbose=0, callbacks=[callback])
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(x, y, batch_size=4, verbose=0, validation_split=0.25,
                  callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss")])
    # Nested callbacks (Keras flattens them) and a 'val_' name
    # without validation_data (a training metric the user named so)
    stop = keras.callbacks.EarlyStopping(monitor="loss")
    for nested in ([[stop]], {"stop": stop}, [keras.callbacks.CallbackList([stop])]):
        with pytest.raises(ValueError, match="EarlyStopping acts on 'loss'"):
            model.fit(x[:4], y[:4], batch_size=4, verbose=0, callbacks=nested)
    with pytest.raises(ValueError, match="no validation_data"):
        model.fit(x[:4], y[:4], batch_size=4, verbose=0,
                  callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss")])
    assert kdp.ledger_of(model).updates == 4  # refused before any update
    model.fit(x[:4], y[:4], batch_size=4, verbose=0, validation_data=(x[:4], y[:4]),
              callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss")])
    assert kdp.ledger_of(model).updates == 5



def test_training_values_logged_under_validation_names_are_refused():
    """Before: a DP fit with a metric the user named 'val_accuracy' and
    validation_data that never ran (validation_freq beyond the epochs) logged the
    private training value under the held-out name, and EarlyStopping acted on
    it. The DP step now refuses such names before any update."""
    x, y = _data(16)
    model = _dense(noise_multiplier=1.0)
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE,
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="val_accuracy")])
    weights = _weights(model)
    stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", mode="max", patience=0)
    with pytest.raises(ValueError, match=r"\['val_accuracy'\].*Rename the metric"):
        model.fit(x, y, batch_size=4, epochs=3, verbose=0, validation_data=(x, y),
                  validation_freq=10, callbacks=[stop])
    assert kdp.ledger_of(model).updates == 0
    assert all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))

    class Nested(keras.metrics.SparseCategoricalAccuracy):  # Keras flattens a dict result
        def result(self):
            return {"val_loss": super().result()}

    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE, metrics=[Nested(name="nested")])
    with pytest.raises(ValueError, match=r"\['val_loss'\]"):
        model.fit(x, y, batch_size=4, verbose=0)
    assert kdp.ledger_of(model).updates == 0
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE,
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y),
              validation_freq=10, callbacks=[stop])
    assert kdp.ledger_of(model).updates == 4
