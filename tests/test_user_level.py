"""User-level DP: each user's summed gradient is the clipped unit.

Checked against a naive loop that differentiates each user's rows together,
clips, and sums; on neighbouring batches (one user's rows changed) the update
moves by at most C; and end to end through ``fit`` with Poisson user batches
and the accountant.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_hub

from keras_dp_lm import clipping as fc
from reference import naive_clip
from reference import naive_per_unit
from reference import token_loss

RTOL = 1e-4


def assert_user_level_matches(model, loss_fn, data, k, fn=fc.clipped_sum, method="auto"):
    per_user = naive_per_unit(model, loss_fn, data, k)
    ref_norms, _ = naive_clip(per_user, 1.0)
    clip = float(np.median(ref_norms))   # some users clipped, some not
    ref_norms, ref_sums = naive_clip(per_user, clip)
    # The per-EXAMPLE norms differ: the test would catch a k ignored.
    per_example, _ = naive_clip(naive_per_unit(model, loss_fn, data, 1), 1.0)
    assert not np.allclose(np.sqrt(np.add.reduceat(per_example ** 2, np.arange(0, len(per_example), k))),
                           ref_norms, rtol=1e-3)
    result = fn(model, loss_fn, data, clip, method=method, examples_per_user=k)
    np.testing.assert_allclose(np.asarray(result.norms, np.float64), ref_norms, rtol=RTOL)
    total = np.sqrt(sum(float(np.sum(s * s)) for s in ref_sums))
    err = np.sqrt(sum(float(np.sum((np.asarray(g, np.float64) - s) ** 2))
                      for g, s in zip(result.grads, ref_sums)))
    assert err <= RTOL * total, (err, total)
    assert np.asarray(result.losses).shape == (len(tf.nest.flatten(data)[0]),)
    return result


def tokens(rng, batch, length, vocab):
    ids = rng.integers(1, vocab, (batch, length)).astype("int32")
    ids[1] = ids[0]              # one user's two examples are identical
    mask = np.ones((batch, length), "int32")
    mask[2, length // 2:] = 0
    return ids, mask


def tiny_gpt2(vocab=80):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


# ---------------------------------------------------------------------------
# Clipping engines: per-user norms and clipped sums equal the naive loop


@pytest.mark.parametrize("force", ["ghost", "instantiate"], indirect=True)
def test_dense_mlp_per_user(force):
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((3, 5)), keras.layers.Dense(7, activation="tanh"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(2)])
    x = rng.normal(size=(6, 3, 5)).astype("float32")
    y = rng.normal(size=(6, 3, 2)).astype("float32")

    def loss_fn(data):
        return tf.reduce_mean(tf.square(model(data[0], training=True) - data[1]), axis=[1, 2])

    assert_user_level_matches(model, loss_fn, (x, y), k=3)
    assert set(fc.clipping_coverage(model).values()) <= {force, "instantiate"}


@pytest.mark.parametrize("force", ["ghost", "instantiate"], indirect=True)
def test_gpt2_tied_embedding_and_positions_per_user(force):
    """Positions are distinct within an example but repeat across a user's examples,
    and the tied table's lookup/projection cross term spans the user's rows."""
    rng = np.random.default_rng(1)
    lm = tiny_gpt2()
    ids, mask = tokens(rng, 6, 9, 80)
    assert_user_level_matches(lm, lambda d: token_loss(lm, *d), (ids, mask), k=2,
                              method="fast")


def test_gpt2_per_user_graph_and_xla():
    rng = np.random.default_rng(2)
    lm = tiny_gpt2()
    ids, mask = tokens(rng, 4, 9, 80)

    def run(m, f, d, c, method, examples_per_user):
        return fc.clipped_sum(m, f, d, c, method=method, examples_per_user=examples_per_user)

    for compiled in (tf.function(run), tf.function(run, jit_compile=True)):
        assert_user_level_matches(lm, lambda d: token_loss(lm, *d), (ids, mask), k=2,
                                  fn=compiled, method="fast")


def test_llama_lora_per_user():
    rng = np.random.default_rng(3)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=60, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32)
    lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    backbone.enable_lora(2)
    for v in lm.trainable_variables:   # LoRA's B starts at zero: move it off zero
        if "lora_kernel_b" in v.path or "lora_embeddings_b" in v.path:
            v.assign(rng.normal(scale=0.1, size=v.shape).astype("float32"))
    ids, mask = tokens(rng, 6, 8, 60)
    assert_user_level_matches(lm, lambda d: token_loss(lm, *d), (ids, mask), k=3,
                              method="fast")


def test_exact_engine_and_exact_fallback_per_user():
    """The exact engine (and fast clipping's exact fallback for an uncovered
    layer) differentiate a user's rows together."""
    rng = np.random.default_rng(4)
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.Conv1DTranspose(3, 2),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    x = rng.normal(size=(6, 6, 2)).astype("float32")
    y = rng.integers(0, 2, 6)

    def loss_fn(data):
        return keras.losses.sparse_categorical_crossentropy(
            data[1], model(data[0], training=True), from_logits=True)

    assert_user_level_matches(model, loss_fn, (x, y), k=2, method="auto")
    assert_user_level_matches(model, loss_fn, (x, y), k=2, method="exact")
    vec = fc.exact_clipped_sum(loss_fn, (x, y), model.trainable_variables, 0.5,
                               vectorize=True, examples_per_user=3)
    loop = fc.exact_clipped_sum(loss_fn, (x, y), model.trainable_variables, 0.5,
                                vectorize=False, examples_per_user=3)
    np.testing.assert_allclose(vec.norms, loop.norms, rtol=1e-5)
    np.testing.assert_allclose(vec.losses, loop.losses, rtol=1e-5)
    for a, b in zip(vec.grads, loop.grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_padding_users_and_rows_add_nothing():
    """A user whose slots are all padding gets factor 0; a padded row of a real
    user adds nothing (its loss is zeroed by the step; here by the loss_fn)."""
    rng = np.random.default_rng(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = rng.normal(size=(6, 4)).astype("float32")
    x[4:] = 1e6                                    # garbage in the padding user's rows
    mask = np.array([1, 1, 1, 0, 0, 0], "float32")  # user 2 is padding

    def loss_fn(data):
        out = tf.reduce_sum(tf.square(model(data[0], training=True)), axis=1)
        return out * data[1]

    result = fc.clipped_sum(model, loss_fn, (x, mask), 1.0, slot_mask=mask,
                            examples_per_user=2)
    reference = fc.clipped_sum(model, loss_fn, (x[:4], mask[:4]), 1.0,
                               slot_mask=mask[:4], examples_per_user=2)
    for a, b in zip(result.grads, reference.grads):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of examples_per_user"):
        fc.clipped_sum(model, loss_fn, (x[:5], mask[:5]), 1.0, examples_per_user=2)


# ---------------------------------------------------------------------------
# Poisson user batches and the DP step

import keras_dp_lm as kdp  # noqa: E402
from keras_dp_lm.data import poisson_user_batches, split_real_slots  # noqa: E402


def user_records(seed=0, users=12):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 6, users)            # 1..5 records per user
    user_ids = np.repeat(np.arange(users) * 7 + 3, counts)
    x = rng.normal(size=(len(user_ids), 4)).astype("float32")
    y = rng.integers(0, 3, len(user_ids))
    return x, y, user_ids


def test_poisson_user_batches_layout_and_inclusion_rate():
    x, y, user_ids = user_records(users=40)
    k = 3
    ds = poisson_user_batches((x, np.arange(len(x))), user_ids, 0.25, max_users=30,
                              examples_per_user=k, seed=1, num_steps=400)
    assert (ds.dataset_size, ds.sampling_rate, ds.examples_per_user) == (40, 0.25, k)
    included = np.zeros(40)
    for xb, rows, marked in ds:
        real, rate, weight = split_real_slots(marked)
        real, rows = real.numpy(), rows.numpy().reshape(real.shape)
        assert weight is None and np.all(np.asarray(rate) == 0.25) and np.shape(rate) == real.shape[:1] and xb.shape[0] == real.size
        for slots, row in zip(real, rows):
            if slots.sum() == 0:
                continue
            owners = set(user_ids[row[slots > 0]])
            assert len(owners) == 1                  # a group holds one user
            assert slots.tolist() == sorted(slots.tolist(), reverse=True)
            owner = owners.pop()
            assert slots.sum() == min(k, int((user_ids == owner).sum()))
            assert len(set(row[slots > 0])) == int(slots.sum())   # no record twice
            included[np.searchsorted(np.unique(user_ids), owner)] += 1
        real_users = [set(user_ids[r[s > 0]]) for s, r in zip(real, rows) if s.sum()]
        assert len(set().union(*real_users)) == len(real_users)  # a user once per batch
    rate = included / 400
    assert abs(rate.mean() - 0.25) < 0.02 and rate.min() > 0.15 and rate.max() < 0.35


def classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


def naive_user_update(model, x, y, real, clip, expected, lr):
    """SGD step: -lr * sum_u clip(mean over u's real rows of g) / expected."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = [np.zeros(v.shape) for v in model.trainable_variables]
    k = real.shape[1]
    for u in range(real.shape[0]):
        rows = np.flatnonzero(real[u]) + u * k
        if len(rows) == 0:
            continue
        with tf.GradientTape() as tape:
            per = loss(y[rows], model(x[rows], training=True))   # mean over the rows
        grads = [np.asarray(g, np.float64) for g in tape.gradient(per, model.trainable_variables)]
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
        factor = min(1.0, clip / norm)
        total = [t + factor * g for t, g in zip(total, grads)]
    return [np.asarray(v, np.float64) - lr * t / expected
            for v, t in zip(model.trainable_variables, total)]


@pytest.mark.parametrize("accumulation,clipping", [(1, "fast"), (2, "fast"), (1, "exact")])
def test_user_level_step_equals_naive_update(accumulation, clipping):
    x, y, user_ids = user_records()
    ds = poisson_user_batches((x, y), user_ids, 0.5, max_users=12, examples_per_user=3,
                              seed=2, num_steps=1, padding="max")
    batch = next(iter(ds))
    real = split_real_slots(batch[2])[0].numpy()
    model = classifier()
    expected = 0.5 * 12
    model.compile(optimizer=kdp.DPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=0.0,
                                      expected_batch_size=expected, clipping=clipping,
                                      gradient_accumulation_steps=accumulation),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference = naive_user_update(model, batch[0].numpy(), batch[1].numpy(), real,
                                  0.3, expected, 0.5)
    step = kdp.make_private(model)
    logs = step(batch)
    for v, r in zip(model.trainable_variables, reference):
        np.testing.assert_allclose(np.asarray(v), r, rtol=1e-5, atol=1e-6)
    ledger = kdp.ledger_of(model)
    users = float((real.sum(axis=1) > 0).sum())
    assert ledger.privacy_unit == "user"
    assert ledger.rows() == [(0.0, 0.5, users, 1)]
    assert np.isfinite(float(logs["loss"]))


def test_one_user_moves_the_update_by_at_most_c():
    """Neighbouring user batches (one user's rows replaced by adversarial ones,
    as many as k): the summed clipped gradient moves by at most C."""
    x, y, user_ids = user_records(seed=3)
    ds = poisson_user_batches((x, y), user_ids, 0.6, max_users=12, examples_per_user=4,
                              seed=3, num_steps=1, padding="max")
    xb, yb, marked = next(iter(ds))
    real = split_real_slots(marked)[0].numpy()
    model = classifier()
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.05, noise_multiplier=0.0,
                                      expected_batch_size=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    from keras_dp_lm.training import dp_clipped_gradient
    base = dp_clipped_gradient(model, (xb, yb, marked))
    victim = int(np.flatnonzero(real.sum(axis=1) > 0)[0])
    worst = 0.0
    for scale in (1.0, 1e3):
        xa, ya, ra = xb.numpy().copy(), yb.numpy().copy(), real.copy()
        rows = slice(victim * 4, victim * 4 + 4)
        xa[rows] = scale * np.random.default_rng(4).normal(size=(4, 4))
        ya[rows] = (ya[rows] + 1) % 3
        ra[victim] = 1.0                       # the neighbour has all 4 slots real
        changed = dp_clipped_gradient(model, (xa, ya, kdp.data.attach_real_slots(
            None, ra, 0.6)))
        diff = np.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2))
                           for a, b in zip(base.grads, changed.grads)))
        worst = max(worst, diff)
        ra[victim] = 0.0                       # the neighbour without that user
        removed = dp_clipped_gradient(model, (xa, ya, kdp.data.attach_real_slots(
            None, ra, 0.6)))
        gone = np.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2))
                           for a, b in zip(base.grads, removed.grads)))
        assert gone <= 0.05 * (1 + 1e-5)
    assert 0.05 < worst <= 2 * 0.05 * (1 + 1e-5)   # replace-one: 2C; add/remove: C
    # Example-level clipping of the same rows would allow 4 * C for that user.
    assert base.norms.shape == (real.shape[0],)


def test_user_and_example_updates_never_mix_in_one_ledger():
    x, y, user_ids = user_records(seed=5)
    ds = poisson_user_batches((x, y), user_ids, 0.5, max_users=12, examples_per_user=2,
                              seed=5, num_steps=1, padding="max")
    model = classifier()
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                      expected_batch_size=6.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = kdp.make_private(model)
    step(next(iter(ds)))
    before = [np.asarray(v).copy() for v in model.trainable_variables]
    example_batch = (x[:6], y[:6], kdp.data.attach_real_slots(None, np.ones(6, "float32"),
                                                              0.5))
    with pytest.raises(kdp.PrivacyRefusalError, match="privacy unit"):
        step(example_batch)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(np.asarray(v), b)
    assert kdp.ledger_of(model).updates == 1


def test_fit_with_user_batches_reports_user_level_epsilon(tmp_path):
    x, y, user_ids = user_records(seed=6, users=60)
    q, steps = 0.1, 12
    ds = poisson_user_batches((x, y), user_ids, q, max_users=25, examples_per_user=3,
                              seed=6, num_steps=steps)
    model = classifier()
    model.compile(optimizer=kdp.DPAdam(1e-2, l2_norm_clip=1.0, noise_multiplier=1.2,
                                       expected_batch_size=q * 60),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = kdp.PrivacyAccountant(delta=1e-3, batches=ds)
    model.fit(ds, epochs=1, verbose=0, callbacks=[accountant])
    ledger = kdp.ledger_of(model)
    assert ledger.privacy_unit == "user" and ledger.updates == steps
    import dp_accounting
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(1.2)), steps)
    direct = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-3)
    assert abs(kdp.accounting.ledger_epsilon(ledger.rows(), 60, 1e-3) - direct) < 1e-3 * direct
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert kdp.ledger_of(loaded).privacy_unit == "user"
    statement = accountant.statement()
    assert accountant.report()["privacy_unit"] == "user"
    assert "for each user (all of its examples)" in statement and "of 60 users" in statement


# ---------------------------------------------------------------------------
# Review findings (a separate privacy review of the user-level path)


def _compiled(expected=1.0):
    model = classifier()
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=0.0,
                                      expected_batch_size=expected),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_user_batches_without_a_user_rate_are_refused():
    """Without the rate, fixed-size accounting would divide users by records."""
    x, y, _ = user_records()
    step = kdp.make_private(_compiled())
    with pytest.raises(ValueError, match="Poisson-sampled"):
        step((x[:6], y[:6], kdp.data.attach_real_slots(None, np.ones((3, 2), "float32"))))


def test_fractional_mask_values_count_whole_units():
    x, y, _ = user_records()
    model = _compiled()
    mask = np.full((4, 2), 0.5, "float32")
    kdp.make_private(model)((x[:8], y[:8], kdp.data.attach_real_slots(None, mask, 0.5)))
    assert kdp.ledger_of(model).rows() == [(0.0, 0.5, 4.0, 1)]


def test_a_mask_that_does_not_match_the_rows_at_run_time_is_refused():
    """Unknown batch dimension: a [1, 1] mask must not broadcast over 6 rows."""
    x, y, _ = user_records()
    model = _compiled()

    def batches(mask):
        ds = tf.data.Dataset.from_generator(lambda: iter([(x[:6], y[:6], mask)]),
                                            output_signature=(
            tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, mask.shape[1]], tf.float32)))
        return ds.map(lambda a, b, c: (a, b, kdp.data.attach_real_slots(None, c, 0.1)))

    before = [np.asarray(v).copy() for v in model.trainable_variables]
    with pytest.raises(kdp.PrivacyRefusalError, match="one entry per row|mask has 1"):
        model.fit(batches(np.ones((1, 1), "float32")), verbose=0)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(np.asarray(v), b)
    model = _compiled()   # (a new k on the same model would relax the traced shape)
    model.fit(batches(np.ones((2, 3), "float32")), verbose=0)
    assert kdp.ledger_of(model).rows() == [(0.0, pytest.approx(0.1), 2.0, 1)]


def test_reported_per_user_norms_are_the_clipped_norms_and_padding_users_zero():
    from keras_dp_lm.training import dp_clipped_gradient
    x, y, _ = user_records(seed=7)
    x, y = x[:8].copy(), y[:8]
    x[6:] = np.nan                                   # a padding user holding NaN
    real = np.array([[1, 0], [1, 1], [1, 0], [0, 0]], "float32")
    model = _compiled()
    result = dp_clipped_gradient(model, (x, y, kdp.data.attach_real_slots(None, real, 0.5)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = []
    for u in range(3):
        rows = np.flatnonzero(real[u]) + 2 * u
        with tf.GradientTape() as tape:
            value = loss(y[rows], model(x[rows], training=True))
        grads = tape.gradient(value, model.trainable_variables)
        expected.append(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
    np.testing.assert_allclose(np.asarray(result.norms), expected + [0.0], rtol=1e-5)


def test_group_privacy_on_a_user_level_ledger_is_refused():
    x, y, user_ids = user_records(seed=8, users=30)
    ds = poisson_user_batches((x, y), user_ids, 0.2, max_users=20, examples_per_user=2,
                              seed=8, num_steps=2)
    model = _compiled(expected=6.0)
    accountant = kdp.PrivacyAccountant(delta=1e-3, batches=ds, examples_per_user=3)
    model.fit(ds, verbose=0)
    accountant.set_model(model)
    with pytest.raises(ValueError, match="user-level already"):
        accountant.report()


def test_a_mismatched_mask_under_xla_adds_nothing():
    """XLA drops assertions: the mismatched mask becomes all padding instead."""
    x, y, _ = user_records()
    model = classifier()
    model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=0.0,
                                      expected_batch_size=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    ds = tf.data.Dataset.from_generator(
        lambda: iter([(x[:6], y[:6], np.ones((1, 1), "float32"))]), output_signature=(
            tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, 1], tf.float32)))
    ds = ds.map(lambda a, b, c: (a, b, kdp.data.attach_real_slots(None, c, 0.1)))
    before = [np.asarray(v).copy() for v in model.trainable_variables]
    try:
        model.fit(ds, verbose=0)
    except kdp.PrivacyRefusalError as err:   # refused outright is fine too
        assert "one entry per row" in str(err) or "real-slot mask has 1" in str(err)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(np.asarray(v), b)
    assert all(row[2] == 0.0 for row in kdp.ledger_of(model).rows())
