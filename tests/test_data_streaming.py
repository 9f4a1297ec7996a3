"""Poisson batches gathered (and preprocessed) inside tf.data, from raw records."""

import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp_lm as kdp
from keras_dp_lm import data as sampling
from keras_dp_lm import testing
from keras_dp_lm.callbacks import PrivacyAccountant


def _numbers(text):
    """Record "r17" -> 17 (in graph mode); a padding slot's "" -> -1."""
    text = tf.where(text == "", "r-1", text)
    return tf.strings.to_number(tf.strings.substr(text, 1, 9), tf.int32)


def _flat(batch):
    return [t.numpy() for t in tf.nest.flatten(batch)]


# --- the tf.data gather is the NumPy sampler --------------------------------------------
def test_gather_in_tf_data_equals_numpy_generator_with_buckets_strings_and_token_weights():
    n, q, cap, steps = 300, 0.05, 40, 60
    rng = np.random.default_rng(0)
    x = {"ids": rng.integers(1, 9, (n, 3)).astype("int32"),
         "text": np.array([f"s{i}" for i in range(n)])}
    y = np.arange(n, dtype="int64")
    weight = rng.random((n, 3)).astype("float32")  # per-token weights
    ds = sampling.poisson_batches((x, y, weight), q, cap, seed=5, num_steps=steps)
    assert ds.element_spec[0]["ids"].shape.as_list() == [None, 3]  # bucketed
    got = [_flat(batch) for batch in ds]
    want = list(sampling.iter_poisson_batches((x, y, weight), q, cap, seed=5,
                                              num_steps=steps, padding="bucket"))
    assert len(got) == len(want) == steps
    shapes = set()
    for a, b in zip(got, want):
        for u, v in zip(a, _flat_np(b)):
            np.testing.assert_array_equal(u, v)  # same draws, same padding content
        shapes.add(a[0].shape[0])
    assert len(shapes) > 1  # several buckets were met


def _flat_np(batch):  # tf.data gives strings as bytes
    return [np.char.encode(t) if t.dtype.kind == "U" else t
            for t in map(np.asarray, tf.nest.flatten(batch))]


def test_inclusion_rate_and_batch_sizes_through_the_preprocessed_dataset():
    n, q, steps = 200, 0.1, 1500
    records = [f"r{i}" for i in range(n)]
    ds = sampling.poisson_batches(
        records, q, sampling.suggest_max_batch_size(n, q, steps), seed=0, num_steps=steps,
        preprocessor=lambda text: (_numbers(text), _numbers(text)))
    counts, sizes = np.zeros(n), []
    for x, y, marked in ds:
        real, rate, weight = sampling.split_real_slots(marked)
        real, x = real.numpy(), x.numpy()
        size = int(real.sum())
        assert np.all(np.asarray(rate) == q) and weight is None
        assert np.all(real[:size] == 1) and np.all(real[size:] == 0)
        assert len(set(x[:size])) == size and np.all(x[size:] == -1)  # padding: ""
        counts[x[:size]] += 1
        sizes.append(size)
    # Each example's count ~ Binomial(steps, q) (5.5 sd over 200 examples), and the
    # overall rate within 5 sd of q.
    assert np.max(np.abs(counts - steps * q)) <= 5.5 * math.sqrt(steps * q * (1 - q))
    assert abs(counts.sum() / (n * steps) - q) <= 5 * math.sqrt(q * (1 - q) / (n * steps))
    # Batch size ~ Binomial(n, q): mean (5 sd of the mean) and variance.
    sizes = np.array(sizes)
    assert abs(sizes.mean() - n * q) <= 5 * math.sqrt(n * q * (1 - q) / steps)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)


def test_only_drawn_records_are_preprocessed():
    n, q, steps = 5000, 0.004, 6
    records = np.array([f"r{i}" for i in range(n)])
    seen = []  # one entry per preprocessor call: the records it was given

    def record_batch(text):
        seen.append([int(t[1:]) if t else -1 for t in text.numpy().astype(str)])
        return text

    def counting(text):
        text = tf.py_function(record_batch, [text], tf.string)
        return _numbers(text), _numbers(text)

    cap = sampling.suggest_max_batch_size(n, q, steps)
    ds = sampling.poisson_batches(records, q, cap, seed=3, num_steps=steps,
                                  preprocessor=counting)
    assert seen == []  # building the dataset preprocesses nothing
    batches = [(x.numpy(), sampling.split_real_slots(m)[0].numpy()) for x, _, m in ds]
    draws = list(sampling.iter_poisson_batches((np.arange(n), np.zeros(n)), q, cap, seed=3,
                                               num_steps=steps, padding="bucket"))
    # The map runs in parallel, so calls may come in any order: compare as multisets.
    expected = []
    for (x, real), (want, _, want_marked) in zip(batches, draws):
        size = int(real.sum())
        drawn = want[:int(sampling.split_real_slots(want_marked)[0].sum())].tolist()
        # exactly the drawn records, then padding slots holding "" (never a record)
        assert x[:size].tolist() == drawn and np.all(x[size:] == -1)
        assert len(x) <= max(1.15 * size, sampling.padding_buckets(n, q, cap)[0])
        expected.append(drawn + [-1] * (len(x) - size))
    assert sorted(seen) == sorted(expected)
    assert sum(map(len, seen)) < 0.01 * n * steps


def test_truncation_keeps_exactly_the_cap_as_a_uniform_subset():
    n, cap, steps = 100, 10, 2000
    with pytest.warns(UserWarning, match="exceeded with probability"):
        ds = sampling.poisson_batches(np.array([f"r{i}" for i in range(n)]), 0.5, cap,
                                      seed=0, num_steps=steps, overflow="truncate",
                                      preprocessor=_numbers)
    counts, pairs = np.zeros(n), np.zeros((n, n))
    for x, y, marked in ds:
        real = sampling.split_real_slots(marked)[0].numpy()
        x = x.numpy()
        assert y is None and real.tolist() == [1.0] * cap  # ~50 drawn, always cut to 10
        assert len(set(x)) == cap
        counts[x] += 1
        pairs[np.ix_(x, x)] += 1
    # A uniform 10-subset: each example in with probability 10/100, each pair with
    # (10/100)(9/99); per example 5.5 sd, the mean over pairs 5 sd (pairs are only
    # weakly dependent; 4950 of them).
    p = cap / n
    assert np.max(np.abs(counts - steps * p)) <= 5.5 * math.sqrt(steps * p * (1 - p))
    p2 = p * (cap - 1) / (n - 1)
    off = pairs[~np.eye(n, dtype=bool)]
    assert abs(off.mean() - steps * p2) <= 5 * math.sqrt(steps * p2 / off.size)
    assert off.var() == pytest.approx(steps * p2 * (1 - p2), rel=0.2)


def test_preprocessor_inputs_outputs_and_misuse():
    n = 50
    x, y = np.arange(n, dtype="float32")[:, None], np.arange(n) % 3

    def with_labels(bx, by):  # gets (x, y) as given; returns (x, y, sample_weight)
        return {"f": bx * 2}, by, tf.ones_like(bx[:, 0]) * 3

    ds = sampling.poisson_batches((x, y), 0.2, 30, seed=1, num_steps=4, preprocessor=with_labels)
    reference = sampling.iter_poisson_batches((x, y), 0.2, 30, seed=1, num_steps=4,
                                              padding="bucket")
    for (bx, by, marked), (rx, ry, _) in zip(ds, reference):
        real, _, weight = sampling.split_real_slots(marked)
        size = int(real.numpy().sum())
        np.testing.assert_array_equal(bx["f"].numpy(), 2 * rx)  # padding rows: 0
        np.testing.assert_array_equal(by.numpy(), ry)
        assert weight.numpy().tolist() == [3.0] * size + [0.0] * (len(real) - size)
    # a tf.data.Dataset of raw strings is loaded and sampled the same way
    strings = [f"r{i}" for i in range(n)]
    a = sampling.poisson_batches(strings, 0.2, 30, seed=2, num_steps=2, preprocessor=_numbers)
    b = sampling.poisson_batches(tf.data.Dataset.from_tensor_slices(strings), 0.2, 30, seed=2,
                                 num_steps=2, preprocessor=_numbers)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u[0].numpy(), v[0].numpy())
    with pytest.raises(ValueError, match="callable"):
        sampling.poisson_batches(strings, 0.2, 30, preprocessor="tokenizer")
    with pytest.raises(ValueError, match="preprocessor="):
        sampling.poisson_batches(strings, 0.2, 30)
    dropping = sampling.poisson_batches(strings, 0.2, 30, seed=0, num_steps=1,
                                        preprocessor=lambda t: _numbers(t)[1:])
    with pytest.raises(tf.errors.InvalidArgumentError, match="one row per input row"):
        next(iter(dropping))


# --- padding is inert end to end: KerasHub preprocessor -> DP step -------------------
RECORDS = [line for line in testing.DEFAULT_TEXT.splitlines() if line.strip()]


@pytest.mark.parametrize("jit_compile,accumulation,noise", [
    (False, 1, 1.0), (True, 1, 0.0), (True, 2, 0.0)])
def test_keras_hub_padding_slots_are_inert_end_to_end(jit_compile, accumulation, noise):
    """Raw strings -> poisson_batches(preprocessor=lm.preprocessor) -> lm.fit: the
    update equals the one on the real rows alone, and garbage (with full weight) in
    the padding slots changes nothing; under XLA and with gradient accumulation."""
    n, q, cap = len(RECORDS), 0.25, 16

    def tiny_llama():
        return testing.tiny_llama_causal_lm(
            texts=[testing.DEFAULT_TEXT], vocabulary_size=512, num_layers=1, hidden_dim=16,
            intermediate_dim=32, sequence_length=12, seed=0)

    lm = tiny_llama()
    init = lm.get_weights()
    preprocessor, lm.preprocessor = lm.preprocessor, None  # batches come preprocessed

    def batches():
        with warnings.catch_warnings():  # 28 records: a 7e-5 overflow risk
            warnings.simplefilter("ignore")
            return sampling.poisson_batches(RECORDS, q, cap, seed=4, num_steps=1,
                                            padding="max", preprocessor=preprocessor)

    x, y, marked = next(iter(batches()))
    real, rate, weight = sampling.split_real_slots(marked)
    size = int(real.numpy().sum())
    assert 0 < size < cap and np.all(np.asarray(rate) == q)
    assert weight.shape == (cap, 12) and not np.any(weight.numpy()[size:])  # [B, T] mask
    real_only = tf.data.Dataset.from_tensors(tf.nest.map_structure(
        lambda t: t[:size], (x, y, weight)))
    rng = np.random.default_rng(0)  # garbage in the padding slots, with full weight
    gx = {"token_ids": np.concatenate([x["token_ids"][:size],
                                       rng.integers(3, 300, (cap - size, 12))]).astype("int32"),
          "padding_mask": np.concatenate([x["padding_mask"][:size],
                                          np.ones((cap - size, 12), bool)])}
    gy = np.concatenate([y[:size], rng.integers(3, 300, (cap - size, 12))]).astype("int32")
    gw = np.concatenate([weight[:size], np.ones((cap - size, 12), "float32")])
    garbage = tf.data.Dataset.from_tensors((gx, gy, sampling.attach_real_slots(gw, real, rate)))

    def updates(datasets, jit, k):
        """One DP step from `init` on each dataset; one compile (the same noise
        needs the same seed and ledger count, which it is folded with: with
        noise, a fresh model and optimizer per dataset)."""
        nonlocal lm
        out = []
        for i, data in enumerate(datasets):
            if noise and kdp.ledger_of(lm).updates:
                lm = tiny_llama()
                lm.preprocessor = None
            if i == 0 or noise:
                lm.compile(optimizer=kdp.DPSGD(
                    learning_rate=0.5, l2_norm_clip=1.0, noise_multiplier=noise,
                    expected_batch_size=q * n, gradient_accumulation_steps=k, seed=7),
                    jit_compile=jit)
                assert lm.jit_compile == jit
            lm.set_weights(init)
            lm.fit(data, epochs=1, verbose=0)
            out.append(lm.get_weights())
        return out

    reference, = updates([real_only], False, 1)
    streamed, padded_garbage = updates([batches(), garbage], jit_compile, accumulation)
    assert kdp.ledger_of(lm).rows()[-1][1] == q  # the streamed rate reached the ledger
    for a, b, c, w0 in zip(streamed, padded_garbage, reference, init):
        np.testing.assert_allclose(a, c, atol=2e-6)
        np.testing.assert_allclose(b, c, atol=2e-6)
    assert not all(np.allclose(a, w0) for a, w0 in zip(streamed, init))  # it did train


# --- accounting: the accountant's epsilon is dp_accounting's ---------------------------
@pytest.mark.parametrize("overflow", ["raise", "truncate"])
def test_accountant_epsilon_equals_dp_accounting_composed_directly(overflow):
    n, q, sigma, delta, steps = 400, 0.05, 1.1, 1e-4, 12
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    # truncate: a cap at the mean, so about half the batches are cut (the accounting
    # stays the Poisson one; see the module docstring for the overflow term)
    cap = sampling.suggest_max_batch_size(n, q, steps) if overflow == "raise" else 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = sampling.poisson_batches((x, y), q, cap, seed=0, num_steps=steps,
                                      overflow=overflow)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=sigma, expected_batch_size=q * n,
                                      seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = PrivacyAccountant(delta=delta, batches=ds, accountant="pld")
    history = model.fit(ds, callbacks=[accountant], verbose=0)
    assert accountant.dp_updates == steps
    assert kdp.ledger_of(model).rows()[0][:2] == (sigma, q)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    pld = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4)
    pld.compose(event, steps)
    # equal up to FFT round-off (~1e-8 relative); one step more or a 1% larger q
    # would move epsilon by percents
    assert accountant.epsilon == pytest.approx(pld.get_epsilon(delta), rel=1e-6)
    assert history.history["epsilon"][-1] == pytest.approx(pld.get_epsilon(delta), rel=1e-6)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event, steps)
    rdp_accountant = PrivacyAccountant(delta=delta, batches=ds, accountant="rdp")
    rdp_accountant.set_model(model)
    assert rdp_accountant.epsilon == pytest.approx(rdp.get_epsilon(delta), rel=1e-12)
