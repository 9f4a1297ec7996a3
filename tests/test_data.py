"""Poisson-sampled, padded batches."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import keras_dp_lm as kdp
from keras_dp_lm import data as sampling
from keras_dp_lm.callbacks import PrivacyAccountant
from keras_dp_lm.accounting import compute_epsilon


def test_inclusion_rate_and_batch_sizes_match_poisson():
    n, q, steps = 200, 0.1, 2000
    ids = np.arange(n)
    counts = np.zeros(n)
    sizes = []
    for x, y, marked in sampling.iter_poisson_batches((ids, ids * 10), q, 60, seed=0,
                                                      num_steps=steps):
        w, rate, weight = sampling.split_real_slots(marked)
        assert rate.shape == w.shape and np.all(rate == q) and weight is None
        real = w > 0
        size = int(real.sum())
        sizes.append(size)
        # real examples first, unique, labels travel with them, padding is 0/weight 0
        assert np.all(real[:size]) and not np.any(real[size:])
        assert len(set(x[:size])) == size
        np.testing.assert_array_equal(y[:size], x[:size] * 10)
        assert np.all(x[size:] == 0) and np.all(w[size:] == 0) and np.all(w[:size] == 1)
        counts[x[:size]] += 1
    # Overall inclusion rate: binomial over n*steps trials, 5 standard deviations.
    rate = counts.sum() / (n * steps)
    assert abs(rate - q) <= 5 * math.sqrt(q * (1 - q) / (n * steps))  # 0.0024
    # Each example's count ~ Binomial(steps, q); 5.5 sd for 200 examples.
    assert np.max(np.abs(counts - steps * q)) <= 5.5 * math.sqrt(steps * q * (1 - q))
    # Batch size ~ Binomial(n, q): mean n*q (5 sd of the mean), variance n*q*(1-q).
    sizes = np.array(sizes)
    assert abs(sizes.mean() - n * q) <= 5 * math.sqrt(n * q * (1 - q) / steps)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)


def test_dataset_matches_numpy_generator_and_redraws_each_pass():
    x = np.arange(100, dtype="float32").reshape(50, 2)
    y = np.arange(50)
    ds = sampling.poisson_batches((x, y), 0.2, 30, seed=3, num_steps=4, padding="max")
    assert int(ds.cardinality()) == 4
    real_spec, rate_spec, _ = sampling.split_real_slots(ds.element_spec[2])
    assert ds.element_spec[0].shape == (30, 2) and real_spec.shape == (30,)
    assert ds.sampling_rate == 0.2 and ds.dataset_size == 50
    first = [tuple(t.numpy() for t in tf.nest.flatten(batch)) for batch in ds]
    reference = list(sampling.iter_poisson_batches((x, y), 0.2, 30, seed=3, num_steps=4))
    for got, want in zip(first, reference):
        for a, b in zip(got, tf.nest.flatten(want)):
            np.testing.assert_array_equal(a, b)
    second = [batch[1].numpy() for batch in ds]  # a new epoch draws new batches
    assert not all(np.array_equal(a[1], b) for a, b in zip(first, second))
    # seed=None: OS entropy, two datasets differ
    a = [b[1].numpy() for b in sampling.poisson_batches((x, y), 0.2, 30, num_steps=4)]
    b = [b[1].numpy() for b in sampling.poisson_batches((x, y), 0.2, 30, num_steps=4)]
    assert not all(np.array_equal(u, v) for u, v in zip(a, b))
    # tf.data input (unbatched examples) is loaded and sampled the same way
    from_ds = sampling.poisson_batches(tf.data.Dataset.from_tensor_slices((x, y)), 0.2, 30,
                                       seed=3, num_steps=4, padding="max")
    np.testing.assert_array_equal(next(iter(from_ds))[1].numpy(), reference[0][1])


def test_nested_inputs_strings_and_per_token_weights():
    n = 10
    x = {"ids": np.arange(2 * n).reshape(n, 2),
         "text": np.array([f"s{i}" for i in range(n)])}
    y = np.ones((n, 2), "int32")
    token_weight = np.tile(np.array([[1.0, 0.0]], "float32"), (n, 1))  # padding mask
    ds = sampling.poisson_batches((x, y, token_weight), 0.3, 10, seed=0, num_steps=3,
                                  padding="max")
    for bx, by, marked in ds:
        real, _, bw = sampling.split_real_slots(marked)
        bw = bw.numpy()
        size = int(real.numpy().sum())
        assert bw.shape == (10, 2)
        np.testing.assert_array_equal(bw[:size], token_weight[:size])
        assert np.all(bw[size:] == 0)
        texts = bx["text"].numpy()[:size]
        ids = bx["ids"].numpy()[:size, 0] // 2
        assert [t.decode() for t in texts] == [f"s{i}" for i in ids]


def test_overflow_raises_or_truncates():
    x, y = np.arange(100), np.zeros(100)
    with pytest.raises(sampling.PoissonOverflowError, match="more than max_batch_size=10"):
        list(sampling.iter_poisson_batches((x, y), 0.5, 10, seed=0, num_steps=3))
    with pytest.warns(UserWarning, match="exceeded with probability 1 in 3 Poisson draws"):
        ds = sampling.poisson_batches((x, y), 0.5, 10, seed=0, num_steps=3)
    with pytest.raises(tf.errors.OpError, match="max_batch_size=10"):
        list(ds)
    for bx, _, marked in sampling.iter_poisson_batches((x, y), 0.5, 10, seed=0,
                                                       num_steps=20, overflow="truncate"):
        assert sampling.split_real_slots(marked)[0].sum() == 10 and len(set(bx)) == 10


def test_overflow_probability_and_suggested_cap():
    # Against scipy directly and a Monte Carlo estimate.
    p1 = sampling.overflow_probability(50, 0.2, 15)
    assert p1 == stats.binom.sf(15, 50, 0.2)
    draws = np.random.default_rng(0).binomial(50, 0.2, size=200_000)
    assert abs((draws > 15).mean() - p1) <= 5 * math.sqrt(p1 * (1 - p1) / 200_000)
    p100 = sampling.overflow_probability(50, 0.2, 15, steps=100)
    assert p100 == pytest.approx(1 - (1 - p1) ** 100, rel=1e-12)
    assert sampling.overflow_probability(50, 0.2, 50, steps=10) == 0.0
    # The suggested cap is the smallest one meeting the bound (for N + 1 examples).
    cap = sampling.suggest_max_batch_size(60000, 256 / 60000, steps=2000)
    assert cap == 378  # mean 256, sd 16: about 7.6 sd above the mean
    assert sampling.overflow_probability(60001, 256 / 60000, cap, steps=2000) <= 1e-9
    assert sampling.overflow_probability(60001, 256 / 60000, cap - 1, steps=2000) > 1e-9


def test_bad_arguments():
    x, y = np.arange(10), np.zeros(10)
    for kwargs, message in [
        (dict(sampling_rate=0.0, max_batch_size=5), "sampling_rate"),
        (dict(sampling_rate=0.5, max_batch_size=0), "max_batch_size"),
        (dict(sampling_rate=0.5, max_batch_size=5, overflow="drop"), "overflow"),
        (dict(sampling_rate=0.5, max_batch_size=5, num_steps=0), "num_steps"),
    ]:
        with pytest.raises(ValueError, match=message):
            sampling.poisson_batches((x, y), **kwargs)
    with pytest.raises(ValueError, match="same leading"):
        sampling.poisson_batches((x, np.zeros(9)), 0.5, 5)
    with pytest.raises(ValueError, match=r"\(x, y\)"):
        sampling.poisson_batches(x, 0.5, 5)
    with pytest.raises(ValueError, match="max_overflow_probability"):
        sampling.suggest_max_batch_size(10, 0.5, 3, max_overflow_probability=0)


def _model(noise, expected, weights=None):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=kdp.DPSGD(learning_rate=0.5, l2_norm_clip=0.5, noise_multiplier=noise,
                            expected_batch_size=expected, seed=7),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_padded_slots_have_no_effect_on_the_update(noise):
    rng = np.random.default_rng(0)
    n, q, cap = 40, 0.2, 20
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    bx, by, bw = next(sampling.iter_poisson_batches((x, y), q, cap, seed=1, num_steps=1))
    size = int(sampling.split_real_slots(bw)[0].sum())
    assert 0 < size < cap
    expected = q * n  # the optimizer divides by q*N, never by the padded size
    init = _model(noise, expected).get_weights()

    def one_step(inputs, labels, weights):
        model = _model(noise, expected, init)
        ds = tf.data.Dataset.from_tensors((inputs, labels, weights))
        model.fit(ds, epochs=1, verbose=0)
        return model.get_weights()

    padded = one_step(bx, by, bw)
    real_only = one_step(bx[:size], by[:size], np.ones(size, "float32"))
    # Garbage in the padded slots changes nothing either.
    gx, gy = bx.copy(), by.copy()
    gx[size:] = 1e3 * rng.normal(size=(cap - size, 4))
    gy[size:] = rng.integers(0, 3, cap - size)
    garbage = one_step(gx, gy, bw)
    for a, b, c, w0 in zip(padded, real_only, garbage, init):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(c, b, atol=1e-6)
        assert not np.allclose(a, w0)  # the step did move the weights


def test_fit_on_poisson_batches_with_accountant():
    n, q = 64, 0.125
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    cap = sampling.suggest_max_batch_size(n, q, steps=16)
    ds = sampling.poisson_batches((x, y), q, cap, seed=0)  # 8 steps = 1 expected epoch
    model = _model(1.0, q * n)
    accountant = PrivacyAccountant(delta=1e-3, batches=ds, accountant="rdp")
    history = model.fit(ds, epochs=2, callbacks=[accountant], verbose=0)
    report = accountant.report()
    assert report["dp_updates"] == 16
    assert report["sampling"] == "poisson"
    assert report["sampling_source"] == "batches"
    assert kdp.ledger_of(model).rows()[0][:2] == (1.0, q)
    assert report["sampling_rate"] == q
    assert history.history["epsilon"] == [compute_epsilon(1.0, q, k, 1e-3, "rdp")
                                          for k in (8, 16)]


# --- bucketed padding ----------------------------------------------------------------
def test_bucketed_padding_keeps_poisson_inclusion_and_bounds_the_overhead():
    n, q, steps = 2000, 0.032, 3000
    cap = sampling.suggest_max_batch_size(n, q, steps)
    buckets = sampling.padding_buckets(n, q, cap)
    assert buckets[-1] == cap and all(b2 / b1 <= 1.15 + 1e-9 or b1 == buckets[0]
                                      for b1, b2 in zip(buckets, buckets[1:]))
    counts = np.zeros(n)
    real_total = padded_total = 0
    for x, _, marked in sampling.iter_poisson_batches(
            (np.arange(n), np.zeros(n)), q, cap, seed=0, num_steps=steps, padding="bucket"):
        real, rate, _ = sampling.split_real_slots(marked)
        size = int(real.sum())
        assert len(real) in buckets and len(real) >= size and np.all(rate == q) and rate.shape == real.shape
        assert np.all(real[:size] == 1) and np.all(real[size:] == 0)
        if size >= buckets[0]:
            assert len(real) <= 1.15 * size
        counts[x[:size]] += 1
        real_total, padded_total = real_total + size, padded_total + len(real)
    rate = counts.sum() / (n * steps)
    assert abs(rate - q) <= 5 * math.sqrt(q * (1 - q) / (n * steps))
    assert padded_total / real_total <= 1.10  # about 1.06 on average


def test_bucketed_batches_train_like_real_only_batches_and_are_accounted_at_q():
    rng = np.random.default_rng(0)
    n, q = 64, 0.25
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    ds = sampling.poisson_batches((x, y), q, 40, seed=0, num_steps=3)
    assert ds.element_spec[0].shape[0] is None
    model = _model(0.0, q * n)
    init = model.get_weights()
    accountant = PrivacyAccountant(delta=1e-3, batches=ds, accountant="rdp")
    model.fit(ds, callbacks=[accountant], verbose=0)
    # the same updates on the real rows only, batch by batch
    reference = _model(0.0, q * n, init)
    for bx, by, marked in sampling.iter_poisson_batches((x, y), q, 40, seed=0, num_steps=3,
                                                        padding="bucket"):
        size = int(sampling.split_real_slots(marked)[0].sum())
        reference.fit(bx[:size], by[:size], batch_size=size, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    (sigma, rate, _, updates), = kdp.ledger_of(model).rows()
    assert (sigma, rate, updates) == (0.0, q, 3)
    assert accountant.epsilon == math.inf  # sigma = 0: no privacy, and the ledger says so
