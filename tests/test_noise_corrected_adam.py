"""DP-AdamBC: NoiseCorrectedAdam's update against its formula, the noise variance the DP
wrapper hands it against the noise it actually added, and Keras citizenship."""

import numpy as np
import pytest
import keras

import keras_dp_lm as kdp
from keras_dp_lm.optimizers import NoiseCorrectedAdam


def _reference_updates(grads, phi, lr=0.01, b1=0.9, b2=0.999, eps=1e-7, floor=0.1):
    """Weights after each step of the DP-AdamBC formula (Tang et al. 2024), in NumPy."""
    w = np.zeros_like(grads[0], dtype=np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    out = []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(np.maximum(v_hat - phi, floor * phi)) + eps)
        out.append(w.copy())
    return out


@pytest.mark.parametrize("phi", [0.0, 0.04, 3.0])
def test_update_matches_the_formula(phi):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=50).astype("float32") for _ in range(6)]
    opt = NoiseCorrectedAdam(learning_rate=0.01, floor_ratio=0.1)
    w = keras.Variable(np.zeros(50, "float32"))
    expected = _reference_updates([g.astype(np.float64) for g in grads], phi)
    for g, want in zip(grads, expected):
        opt.set_dp_noise_variance(phi)
        opt.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
        np.testing.assert_allclose(w.numpy(), want, rtol=1e-3, atol=1e-6)  # float32 v_hat - phi


def test_without_noise_it_is_keras_adam():
    rng = np.random.default_rng(1)
    ours, theirs = (keras.Variable(np.ones(20, "float32")) for _ in range(2))
    a = NoiseCorrectedAdam(learning_rate=0.05, epsilon=1e-7)
    b = keras.optimizers.Adam(learning_rate=0.05, epsilon=1e-7)
    for _ in range(5):
        g = keras.ops.convert_to_tensor(rng.normal(size=20).astype("float32"))
        a.apply_gradients([(g, ours)])
        b.apply_gradients([(g, theirs)])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


def _model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.build((None, 6))
    return model


def _data(n=16):
    rng = np.random.default_rng(2)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


@pytest.mark.parametrize("k,expected_batch", [(1, None), (4, None), (1, 40.0)])
def test_dp_wrapper_applies_the_formula_to_the_noised_gradient(k, expected_batch):
    """The same seed gives DPSGD(lr=1) and DPAdamBC the same noised average gradient:
    read it off SGD's step, apply the formula with phi = (sigma C / B)^2, compare."""
    x, y = _data()
    init = _model().get_weights()
    sigma, clip, batch = 1.3, 0.5, 16
    divisor = expected_batch or batch
    kw = dict(l2_norm_clip=clip, noise_multiplier=sigma, seed=11,
              gradient_accumulation_steps=k, expected_batch_size=expected_batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    sgd = _model()
    sgd.set_weights(init)
    sgd.compile(optimizer=kdp.DPSGD(1.0, **kw), loss=loss)
    sgd.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    noised_avg = [w0 - w1 for w0, w1 in zip(init, sgd.get_weights())]

    bc = _model()
    bc.set_weights(init)
    bc.compile(optimizer=kdp.DPAdamBC(0.01, floor_ratio=0.1, **kw), loss=loss)
    bc.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    phi = (sigma * clip / divisor) ** 2
    assert float(bc.optimizer.inner_optimizer.dp_noise_variance.numpy()) == pytest.approx(
        phi, rel=1e-6)
    for w0, w1, g in zip(init, bc.get_weights(), noised_avg):
        want = _reference_updates([g.astype(np.float64)], phi)[0]
        np.testing.assert_allclose(w1 - w0, want, rtol=1e-4, atol=1e-6)
    assert kdp.ledger_of(bc).updates == 1


def test_noise_variance_is_zero_without_noise():
    x, y = _data()
    model = _model()
    model.compile(optimizer=kdp.DPAdamBC(0.01, l2_norm_clip=1.0, noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, verbose=0)
    assert float(model.optimizer.inner_optimizer.dp_noise_variance.numpy()) == 0.0


@pytest.mark.parametrize("kwargs,message", [
    ({"floor_ratio": 0.0}, "floor_ratio"),
    ({"floor_ratio": -1.0}, "floor_ratio"),
    ({"beta_1": 1.0}, "beta_1"),
    ({"beta_2": -0.1}, "beta_2"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": float("inf")}, "epsilon"),
    ({"floor_ratio": float("inf")}, "floor_ratio"),
    ({"beta_1": None}, "beta_1"),
])
def test_invalid_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NoiseCorrectedAdam(**kwargs)


def test_saves_and_resumes(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=kdp.DPAdamBC(0.02, floor_ratio=0.05, l2_norm_clip=1.0,
                                         noise_multiplier=1.0, seed=3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "bc.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    inner = loaded.optimizer.inner_optimizer
    assert type(loaded.optimizer).__name__ == "DPAdamBC"
    assert isinstance(inner, NoiseCorrectedAdam) and inner.floor_ratio == 0.05
    assert kdp.ledger_of(loaded).updates == 2
    loaded.fit(x, y, batch_size=8, verbose=0)
    assert kdp.ledger_of(loaded).updates == 4


def test_negative_noise_variance_is_refused():
    with pytest.raises(ValueError, match="variance"):
        NoiseCorrectedAdam().set_dp_noise_variance(-1.0)


def test_16_bit_variables_are_refused():
    w = keras.Variable(np.zeros(3, "float32"), dtype="bfloat16")
    with pytest.raises(ValueError, match="16-bit"):
        NoiseCorrectedAdam().build([w])


def test_the_correction_cannot_be_lost_by_wrapping():
    with pytest.raises(TypeError, match="NoiseCorrectedAdam"):
        kdp.DPAdamBC(inner_optimizer=keras.optimizers.Adam(), l2_norm_clip=1.0,
                     noise_multiplier=1.0)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        kdp.DPOptimizer(keras.optimizers.LossScaleOptimizer(NoiseCorrectedAdam()),
                        l2_norm_clip=1.0, noise_multiplier=1.0)
