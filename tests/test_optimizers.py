"""DP optimizers: noise calibration, seeds, fail-closed paths, Keras citizenship."""

import math
import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _wide_model(units=2000, inputs=50):
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(units, use_bias=False)])


def _noise_update(optimizer, batch_size, steps=1):
    """Weight change of SGD(lr=1) when every example's gradient is zero."""
    model = _wide_model()
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((batch_size, 50), "float32")
    y = np.zeros((batch_size, 2000), "float32")
    zero_weights = np.zeros(batch_size, "float32")  # per-example loss 0 => gradient 0
    before = model.trainable_variables[0].numpy().copy()
    model.fit(x, y, sample_weight=zero_weights, batch_size=batch_size, epochs=steps,
              verbose=0, shuffle=False)
    return model.trainable_variables[0].numpy() - before, model


@pytest.mark.parametrize("sigma,clip,batch,k", [(1.0, 1.0, 8, 1), (0.7, 2.5, 16, 4)])
def test_noise_std_matches_formula(sigma, clip, batch, k):
    opt = kdp.DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=sigma, seed=3,
                    gradient_accumulation_steps=k)
    delta, model = _noise_update(opt, batch)
    expected = sigma * clip / batch
    assert delta.size == 100_000
    assert abs(delta.std() / expected - 1) < 0.05
    assert abs(delta.mean()) < 5 * expected / math.sqrt(delta.size)
    assert int(model.optimizer.dp_updates.numpy()) == 1


def test_expected_batch_size_is_the_divisor():
    opt = kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=4, expected_batch_size=32)
    delta, model = _noise_update(opt, 8)
    assert abs(delta.std() / (1.0 / 32) - 1) < 0.05
    assert float(model.optimizer.dp_last_batch_size.numpy()) == 32.0


def test_noise_differs_every_step_and_seed_reproduces():
    a, _ = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5), 4, 2)
    b, _ = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5), 4, 2)
    one, _ = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5), 4, 1)
    np.testing.assert_allclose(a, b, atol=1e-6)  # float rounding of w_after - w_before
    second_step = a - one
    assert abs(np.corrcoef(one.ravel(), second_step.ravel())[0, 1]) < 0.02


def test_a_recompiled_optimizer_with_the_same_seed_continues_the_noise_sequence():
    """Review finding: the noise seed was folded with the optimizer's own update
    count, so recompiling with a fresh DP optimizer of the same ``seed``
    replayed the first update's noise exactly (correlation 1.0) while the
    ledger counted the two updates as independent. It is now folded with the
    model's ledger count."""
    first, model = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0,
                                           seed=7), 4)
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7),
                  loss="mse")
    before = model.trainable_variables[0].numpy().copy()
    model.fit(np.ones((4, 50), "float32"), np.zeros((4, 2000), "float32"),
              sample_weight=np.zeros(4, "float32"), batch_size=4, verbose=0)
    second = model.trainable_variables[0].numpy() - before
    assert kdp.ledger_of(model).updates == 2
    assert abs(np.corrcoef(first.ravel(), second.ravel())[0, 1]) < 0.02


def test_default_seed_comes_from_os_entropy():
    seeds = {kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0)._noise_seed for _ in range(5)}
    assert len(seeds) == 5
    a, _ = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0), 4)
    b, _ = _noise_update(kdp.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0), 4)
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.02


@pytest.mark.parametrize("kwargs,name", [
    (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=float("nan"), noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=-0.1), "noise_multiplier"),
    (dict(l2_norm_clip=1.0, noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=0),
     "gradient_accumulation_steps"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=-4), "expected_batch_size"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed=1.5), "seed"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, clipping="ghostly"), "clipping"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, clipnorm=1.0), "clipnorm"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, clipvalue=1.0), "clipvalue"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, global_clipnorm=1.0), "global_clipnorm"),
])
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        kdp.DPAdam(learning_rate=1e-3, **kwargs)


@pytest.mark.parametrize("name,value", [("noise_multiplier", -1.0), ("l2_norm_clip", 0.0),
                                        ("expected_batch_size", float("nan")),
                                        ("clipping", "ghostly"),
                                        ("dp_accumulation_steps", 0)])
def test_a_parameter_set_before_training_is_validated_like_the_constructor(name, value):
    optimizer = kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    before = optimizer.privacy_parameters
    with pytest.raises(ValueError):
        setattr(optimizer, name, value)
    assert optimizer.privacy_parameters is before


def test_the_step_reads_one_frozen_parameter_object():
    """Clipping, noise and ledger read the object freeze_privacy_parameters
    returns; _apply_clipped_sum refuses any other (an equal copy included)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = kdp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=2.0, seed=3)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4, verbose=0)
    params = optimizer.privacy_parameters
    assert optimizer.freeze_privacy_parameters() is params
    assert (params.l2_norm_clip, params.noise_multiplier, params.noise_std) == (0.5, 2.0, 1.0)
    assert kdp.ledger_of(model).rows()[0].noise_multiplier == params.noise_multiplier
    copy = params.with_values()
    assert copy == params and copy is not params
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(kdp.PrivacyRefusalError, match="freeze_privacy_parameters"):
        optimizer._apply_clipped_sum(copy, zeros, model.trainable_variables, 4.0, 1)
    with pytest.raises(kdp.PrivacyRefusalError, match="freeze_privacy_parameters"):
        kdp.DPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=2.0)._apply_clipped_sum(
            params, zeros, model.trainable_variables, 4.0, 1)


def test_make_dp_optimizer_keeps_base_settings():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    opt = kdp.make_dp_optimizer(keras.optimizers.Lion(schedule, beta_1=0.8),
                                l2_norm_clip=1.5, noise_multiplier=0.5, seed=1)
    assert type(opt).__name__ == "DPOptimizer"
    inner = opt.inner_optimizer
    assert type(inner).__name__ == "Lion"
    assert inner.beta_1 == 0.8 and opt.l2_norm_clip == 1.5 and inner._learning_rate is schedule
    factor = kdp.make_dp_optimizer(keras.optimizers.Adafactor, l2_norm_clip=1.0,
                                   noise_multiplier=1.0)
    assert kdp.is_dp_optimizer(factor)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        kdp.make_dp_optimizer(keras.optimizers.SGD(gradient_accumulation_steps=2),
                              l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(TypeError):
        kdp.make_dp_optimizer("adam", l2_norm_clip=1.0, noise_multiplier=1.0)


def test_config_round_trip():
    opt = kdp.DPAdamW(learning_rate=2e-3, weight_decay=0.01, l2_norm_clip=0.5,
                      noise_multiplier=0.9, gradient_accumulation_steps=2,
                      expected_batch_size=64, seed=11, clipping="exact")
    config = opt.get_config()
    again = kdp.DPAdamW.from_config(config)
    for key in ["l2_norm_clip", "noise_multiplier", "expected_batch_size", "seed", "clipping"]:
        assert getattr(again, key) == getattr(opt, key), key
    assert again.inner_optimizer.weight_decay == 0.01
    assert again.dp_accumulation_steps == 2
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is type(opt)


# --- fail closed ---------------------------------------------------------------

def _compiled_dense(**layer_kwargs):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, **layer_kwargs)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=SCCE)
    return model


def test_custom_loop_apply_gradients_is_refused():
    model = _compiled_dense()
    model(np.ones((1, 4)))
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match="make_private"):
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))


def test_overridden_train_step_is_refused():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((4,))
    model = Custom(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(TypeError, match="overrides train_step"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)


def test_activity_regularizer_is_refused():
    with pytest.raises(ValueError, match="activity_regularizer"):
        _compiled_dense(activity_regularizer="l2")


def test_add_loss_on_activations_is_refused():
    class AddsLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.mean(x))
            return x

    model = keras.Sequential([keras.Input((4,)), AddsLoss(), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=SCCE)
    with pytest.raises(ValueError, match="data-dependent losses"):
        model.fit(np.ones((4, 4)), np.zeros(4), verbose=0)


def test_batch_normalization_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="BatchNormalization"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=SCCE)


def test_recompiling_without_dp_unbinds_the_step():
    model = _compiled_dense()
    assert "train_step" in model.__dict__
    model.compile(optimizer="sgd", loss=SCCE)
    # the DP step is gone; the guards stay once the process holds DP-trained weights
    from keras_dp_lm.training.binding import is_bound_to_dp_step

    assert not is_bound_to_dp_step(model)
    assert "_maybe_symbolic_build" not in model.__dict__


def test_make_private_custom_loop():
    model = _compiled_dense()
    step = kdp.make_private(model)
    x, y = np.random.rand(8, 4).astype("float32"), np.zeros(8, "int32")
    for _ in range(3):
        logs = step((x, y))
    assert int(model.optimizer.dp_updates.numpy()) == 3
    assert np.isfinite(float(logs["loss"]))
    with pytest.raises(ValueError, match="DP optimizer"):
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        plain.compile(optimizer="adam", loss=SCCE)
        kdp.make_private(plain)


def test_save_reload_keeps_training_privately(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPAdam(1e-2, l2_norm_clip=1.0, noise_multiplier=1.0, seed=2),
                  loss=SCCE, metrics=["accuracy"])
    x, y = np.random.rand(16, 4).astype("float32"), np.random.randint(0, 2, 16)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert set(history.history) >= {"loss", "accuracy"}
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    assert type(reloaded.optimizer).__name__ == "DPAdam"
    assert reloaded.optimizer.noise_multiplier == 1.0
    assert int(reloaded.optimizer.dp_updates.numpy()) == 4
    assert "train_step" in reloaded.__dict__  # the DP step is bound after loading
    reloaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(reloaded.optimizer.dp_updates.numpy()) == 6
    with pytest.raises(RuntimeError, match="refuses"):
        reloaded.optimizer.apply_gradients(
            zip([tf.zeros_like(v) for v in reloaded.trainable_variables],
                reloaded.trainable_variables))


def test_any_keras_optimizer_reloads_in_a_fresh_process(tmp_path):
    """make_dp_optimizer(Lion) used to build a class at run time that a fresh
    process could not locate ("Could not locate class")."""
    import subprocess
    import sys

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=kdp.make_dp_optimizer(keras.optimizers.Lion(1e-3),
                                                  l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=SCCE)
    model.fit(np.ones((8, 4), "float32"), np.zeros(8), batch_size=4, verbose=0)
    model.save(tmp_path / "lion.keras")
    script = (
        "import keras, numpy as np, keras_dp_lm as kdp\n"
        f"m = keras.models.load_model({str(tmp_path / 'lion.keras')!r})\n"
        "m.fit(np.ones((8, 4), 'float32'), np.zeros(8), batch_size=4, verbose=0)\n"
        "print(type(m.optimizer.inner_optimizer).__name__, kdp.ledger_of(m).updates)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["Lion", "4"]
