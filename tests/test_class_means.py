"""DPClassMeans: the release against a naive loop, its noise and sensitivity on
neighbouring datasets, its epsilon against dp_accounting, the head it sets, saving,
the accountant's checks, and the refusals."""

import dp_accounting
import keras
import numpy as np
import pytest

from keras_dp_lm.accounting import compose_epsilon
from keras_dp_lm.data import DPClassMeans
from keras_dp_lm.data import DPFeatureNormalization
from keras_dp_lm.data.class_means import class_mean_logits
from keras_dp_lm.data.feature_normalization import COUNT_NOISE_SCALE
from keras_dp_lm.data.releases import release_sensitivity
from keras_dp_lm.data.releases import CLASS_MEANS_STREAM
from keras_dp_lm.recipes import suggest_recipe
from keras_dp_lm.training.model_ledgers import ledger_of

SIGMA = 2.0


def _release(features, labels, classes=3, max_norm=1.0, seed=1, **kwargs):
    """What one ``adapt`` released, as the vector its event's sensitivity is about:
    ``(noised sums, noised counts / COUNT_NOISE_SCALE)``, flattened."""
    layer = DPClassMeans(classes, SIGMA, max_norm=max_norm, seed=seed)
    layer.adapt(features, labels, **kwargs)
    return np.append(layer.released_sums.ravel(), layer.released_counts / COUNT_NOISE_SCALE)


def test_the_release_is_the_naive_per_example_sums_plus_the_drawn_noise():
    """A per-example loop (scale each row to norm <= max_norm, divide by it, add it to
    its class) against the layer, with the layer's own seeded draws subtracted."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 3.0, (40, 5))
    y = rng.integers(0, 3, 40)
    layer = DPClassMeans(3, SIGMA, max_norm=2.0, seed=7)
    layer.adapt(x, y)
    sums, counts = np.zeros((3, 5)), np.zeros(3)
    for row, label in zip(x, y):
        norm = np.sqrt(np.sum(row ** 2))
        sums[label] += row * min(1.0, 2.0 / norm) / 2.0
        counts[label] += 1
    draws = np.random.default_rng(np.random.SeedSequence(7, spawn_key=(CLASS_MEANS_STREAM, 0)))
    noise_sums = draws.normal(0.0, SIGMA, (3, 5))
    noise_counts = draws.normal(0.0, COUNT_NOISE_SCALE * SIGMA, 3)
    np.testing.assert_allclose(layer.released_sums, sums + noise_sums, rtol=1e-12)
    np.testing.assert_allclose(layer.released_counts, counts + noise_counts, rtol=1e-12)


def test_noise_std_matches_the_noise_multiplier():
    d = 20000
    x = np.zeros((10, d))
    x[:, 0] = 1.0
    y = np.zeros(10, "int32")
    layer = DPClassMeans(2, 2.5, max_norm=1.0, seed=3)
    layer.adapt(x, y)
    noise = layer.released_sums - np.outer([10, 0], np.eye(d)[0])
    # 2 d draws: relative standard error 1 / sqrt(4 d) = 0.35%
    assert np.std(noise) == pytest.approx(2.5, rel=0.02)
    counts = []
    for seed in range(1500):
        one = DPClassMeans(2, 2.5, max_norm=1.0, seed=seed)
        one.adapt(x[:, :2], y)
        counts.extend(one.released_counts - [10, 0])
    assert np.std(counts) == pytest.approx(COUNT_NOISE_SCALE * 2.5, rel=0.05)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_sensitivity_on_neighbouring_datasets_is_what_the_event_claims(scale):
    """Add or remove one record (an outlier, a record of the rarest class, a new
    record of a class nobody had), paired noise: the released vector moves by at
    most what the event allows (1 / its noise multiplier, in units of sigma), and
    by exactly that for a record of norm >= max_norm."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.5, 1.0, (30, 6)) * scale
    x[4] *= 1e6
    y = np.array([0] * 20 + [1] * 9 + [2])
    bound = 1.0 / DPClassMeans(3, SIGMA).dp_event().noise_multiplier
    full = _release(x, y)
    neighbours = [(np.delete(x, 4, 0), np.delete(y, 4)), (np.delete(x, 29, 0), y[:29]),
                  (x[:29], y[:29]), (np.concatenate([x, -x[:1] * 1e3]), np.append(y, 2)),
                  (x[y != 2], y[y != 2])]
    for features, labels in neighbours:
        moved = np.linalg.norm(full - _release(features, labels)) / SIGMA
        assert moved <= bound * (1 + 1e-9)
    moved = np.linalg.norm(full - _release(np.delete(x, 4, 0), np.delete(y, 4))) / SIGMA
    assert moved == pytest.approx(release_sensitivity() / SIGMA, rel=1e-9)


def test_user_level_sensitivity_is_what_the_event_claims():
    """A user with rows in every class (weight 1 / rows each) moves the release no
    more than one record does."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 8)) * 10
    y = rng.integers(0, 3, 60)
    users = np.repeat(np.arange(6), 10)
    y[users == 2] = np.arange(10) % 3
    keep = users != 2
    full = _release(x, y, user_ids=users)
    less = _release(x[keep], y[keep], user_ids=users[keep])
    bound = 1.0 / DPClassMeans(3, SIGMA).dp_event().noise_multiplier
    assert np.linalg.norm(full - less) / SIGMA <= bound * (1 + 1e-9)
    # ten identical rows of one class and norm >= max_norm: exactly the bound
    x[users == 2] = rng.normal(size=8) * 100
    y[users == 2] = 1
    full = _release(x, y, user_ids=users)
    assert np.linalg.norm(full - less) / SIGMA == pytest.approx(bound, rel=1e-9)


def test_for_budget_meets_the_target_by_dp_accounting_and_is_tight():
    norm = DPFeatureNormalization()
    means = DPClassMeans.for_budget(4, 3.0, 1e-6, extra_events=[norm.dp_event()])
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(norm.noise_multiplier
                                                     / release_sensitivity()))
    accountant.compose(dp_accounting.GaussianDpEvent(means.noise_multiplier
                                                     / release_sensitivity()))
    assert accountant.get_epsilon(1e-6) <= 3.0
    assert compose_epsilon([norm.dp_event(), means.dp_event()], 1e-6) <= 3.0
    noisier_by_less = DPClassMeans(4, means.noise_multiplier / 1.002)
    assert compose_epsilon([norm.dp_event(), noisier_by_less.dp_event()], 1e-6) > 3.0


def test_every_release_is_one_more_event():
    x, y = np.eye(4), np.array([0, 1, 0, 1])
    layer = DPClassMeans(2, SIGMA, seed=0)
    planned = layer.dp_event()
    layer.adapt(x, y)
    assert layer.dp_event() == planned and layer.num_releases == 1
    layer.adapt(x, y)
    assert layer.dp_event() == dp_accounting.ComposedDpEvent([planned] * 2)
    assert compose_epsilon([layer.dp_event()], 1e-6) > compose_epsilon([planned], 1e-6)


def test_the_head_is_the_nearest_debiased_class_mean():
    """Post-processing of the release only; argmax = the class mean nearest to the
    input in units of max_norm, with each mean's squared norm debiased."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(500, 6)) + np.repeat(np.eye(6)[:3] * 2, [300, 150, 50], 0)
    y = np.repeat([0, 1, 2], [300, 150, 50])
    layer = DPClassMeans(3, 0.5, max_norm=3.0, seed=0)
    layer.adapt(x, y)
    counts = np.maximum(layer.released_counts, 1.0)
    means = layer.released_sums / counts[:, None]
    squared = np.sum(means ** 2, 1) - 6 * 0.25 / counts ** 2
    probe = rng.normal(size=(200, 6)) * 3
    scaled = probe / np.maximum(np.linalg.norm(probe, axis=1, keepdims=True), 3.0)
    nearest = np.argmin(np.sum(scaled ** 2, 1)[:, None] - 2 * scaled @ means.T + squared, 1)
    np.testing.assert_array_equal(np.asarray(layer(probe)).argmax(-1), nearest)
    kernel, bias = class_mean_logits(layer.released_sums, layer.released_counts, 0.5)
    np.testing.assert_allclose(layer.kernel.numpy(), kernel, rtol=1e-5)
    np.testing.assert_allclose(layer.bias.numpy(), bias, rtol=1e-5)


def test_a_rare_class_is_predicted():
    rng = np.random.default_rng(0)
    y = (rng.random(1000) < 0.05).astype("int32")  # 5% rare: about 50 examples
    x = rng.normal(size=(1000, 16)) + 1.2 * y[:, None]
    norm = DPFeatureNormalization(seed=0)
    norm.adapt(x)
    means = DPClassMeans.for_budget(2, 8.0, 1e-6, extra_events=[norm.dp_event()], seed=0)
    means.adapt(norm(x), y)
    model = keras.Sequential([keras.Input((16,)), norm, means])
    xt = rng.normal(size=(400, 16)) + 1.2 * np.repeat([0, 1], 200)[:, None]
    predicted = model.predict(xt, verbose=0).argmax(-1)
    recalls = [np.mean(predicted[:200] == 0), np.mean(predicted[200:] == 1)]
    assert min(recalls) > 0.6, recalls


def test_saving_keeps_the_head_and_the_release_count(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 4)), rng.integers(0, 2, 100)
    means = DPClassMeans(2, SIGMA, seed=0)
    means.adapt(x, y)
    means.adapt(x, y)
    model = keras.Sequential([keras.Input((4,)), means])
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    layer = loaded.layers[-1]
    assert isinstance(layer, DPClassMeans) and layer.num_releases == 2
    assert layer.dp_event() == means.dp_event()
    fresh = keras.Sequential([keras.Input((4,)), DPClassMeans(2, SIGMA)])
    fresh.load_weights(path)
    assert fresh.layers[-1].num_releases == 2


def test_refusals_name_the_problem():
    x, y = np.eye(4), np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="noise_multiplier.*not differentially private"):
        DPClassMeans(2, 0.0)
    with pytest.raises(ValueError, match="num_classes"):
        DPClassMeans(1, SIGMA)
    for max_norm in (0, 1e-200, 1e200):
        with pytest.raises(ValueError, match="max_norm"):
            DPClassMeans(2, SIGMA, max_norm=max_norm)
    layer = DPClassMeans(2, SIGMA, seed=0)
    with pytest.raises(ValueError, match=r"no class means yet.*call `adapt`"):
        layer(np.ones((1, 4), "float32"))
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        layer.adapt(x, np.array([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="integer class ids"):
        layer.adapt(x, np.array([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        layer.adapt(np.full((4, 4), np.nan), y)
    assert layer.num_releases == 0  # nothing released by a refused call
    layer.adapt(x, y)
    with pytest.raises(ValueError, match="one example; adapt again with the same unit"):
        layer.adapt(x, y, user_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="built for 4 features, got 3"):
        layer.adapt(x[:, :3], y)


def _dp_fit(model, x, y, events=()):
    """Compile ``model`` with a DP recipe whose budget lists ``events`` and fit one
    epoch of Poisson batches under its accountant; returns the recipe."""
    recipe = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=5, trainable="head",
                            extra_events=list(events))
    model.compile(optimizer=recipe.optimizer(seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = recipe.poisson_batches((x, y), seed=0)
    model.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)], verbose=0)
    return recipe


def test_the_accountant_refuses_a_dp_fit_that_leaves_the_release_out():
    """A model holding the layer, trained further with a DP optimizer: the release
    must be in the accountant's total, as for DPFeatureNormalization."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    means = DPClassMeans(2, SIGMA, seed=0)
    means.adapt(x, y)

    def fit(events):
        model = keras.Sequential([keras.Input((4,)), means, keras.layers.Dense(2)])
        return model, _dp_fit(model, x, y, events)

    with pytest.raises(PrivacyRefusalError, match=r"released statistics of this training "
                       r"data 1 time.*extra_events"):
        fit([])
    model, recipe = fit([means.dp_event()])
    assert ledger_of(model).updates == recipe.steps


def test_a_call_inside_a_lambda_is_refused_before_any_update():
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    means = DPClassMeans(2, SIGMA, seed=0)
    means.adapt(x, y)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: means(t)),
                              keras.layers.Dense(2)])
    with pytest.raises(PrivacyRefusalError, match="DPClassMeans.*does not list it"):
        _dp_fit(model, x, y, [means.dp_event()])
    assert ledger_of(model).updates == 0


@pytest.mark.parametrize("row_scale", [1e-170, 1e-300, 1e155, 1e300])
def test_rows_of_extreme_magnitude_move_the_release_no_more_than_the_event_claims(row_scale):
    """Before: a row of 1e-170 had a float64 norm of 0 and, with a max_norm under
    1e-154, was divided by max_norm instead of scaled down (a move of 1e30 against
    1.03). Norms are computed without under- or overflow, and max_norm is bounded."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 5)), np.arange(20) % 3
    bound = 1.0 / DPClassMeans(3, SIGMA).dp_event().noise_multiplier
    for max_norm in (1e-100, 1.0, 1e100):
        added = np.concatenate([x, np.full((1, 5), row_scale)])
        moved = np.linalg.norm(_release(x, y, max_norm=max_norm)
                               - _release(added, np.append(y, 1), max_norm=max_norm)) / SIGMA
        assert moved <= bound * (1 + 1e-9), (max_norm, moved)


def test_one_seed_on_two_release_layers_draws_independent_noise():
    """Before: release 0 of DPFeatureNormalization and of DPClassMeans (and of
    DPClassPriors) with one seed drew the same normals, so a public difference of
    the releases cancelled the noise. Each release class has its own stream."""
    from keras_dp_lm.data import DPClassPriors

    x, y = np.zeros((4, 64)), np.array([0, 1, 0, 1])
    norm = DPFeatureNormalization(noise_multiplier=SIGMA, seed=0)
    norm.adapt(x + 1.0)  # unit rows, so the noiseless sum is known
    means = DPClassMeans(2, SIGMA, seed=0)
    means.adapt(x, y)
    priors = DPClassPriors(2, noise_multiplier=SIGMA, seed=0)
    priors.release(y)
    noise_norm = norm.released_sum - 4 * np.ones(64) / 8.0
    noise_means = means.released_sums[0]
    assert abs(np.corrcoef(noise_norm, noise_means)[0, 1]) < 0.5
    assert not np.allclose(priors.released_counts - 2, noise_means[:2])
    assert not np.allclose(priors.released_counts - 2, noise_norm[:2])


def test_the_release_count_survives_set_weights_and_is_never_lowered():
    """Before: set_weights into a fresh layer left num_releases at 0 (one event
    instead of 3), and a later adapt restarted the count."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 4)), rng.integers(0, 2, 50)
    means = DPClassMeans(2, SIGMA)
    for _ in range(3):
        means.adapt(x, y)
    fresh = DPClassMeans(2, SIGMA)
    fresh.build((None, 4))
    fresh.set_weights(means.get_weights())
    assert fresh.num_releases == 3 and fresh.dp_event() == means.dp_event()
    fresh.adapt(x, y)
    assert fresh.num_releases == 4
    # loading an older copy (1 release) into a layer that made 4 keeps 4
    older = DPClassMeans(2, SIGMA)
    older.adapt(x, y)
    fresh.set_weights(older.get_weights())
    assert fresh.num_releases == 4
    assert fresh.dp_event() == dp_accounting.ComposedDpEvent([older.dp_event()] * 4)


def test_the_noise_level_is_read_only_after_a_release():
    """Before: setting noise_multiplier after two releases at sigma 2 made their
    event say epsilon 0.28 instead of 3.42."""
    from keras_dp_lm.data import DPClassPriors

    means = DPClassMeans(2, SIGMA)
    means.noise_multiplier = 3.0  # before any release: allowed
    means.adapt(np.eye(4), np.array([0, 1, 0, 1]))
    norm = DPFeatureNormalization()
    norm.adapt(np.eye(4) + 1.0)
    priors = DPClassPriors(2)
    priors.release(np.array([0, 1, 0, 1]))
    for layer in (means, norm, priors):
        spent = layer.dp_event()
        with pytest.raises(AttributeError, match="cannot change after a release"):
            layer.noise_multiplier = 20.0
        assert layer.dp_event() == spent


@pytest.mark.parametrize("bad", [np.nan, None])
def test_unknown_user_ids_are_refused_not_merged_into_one_user(bad):
    """Before: NaN ids were one user to np.unique, so two people with unknown ids
    moved a user-level release by 1.44 against a claim of 1.03."""
    from keras_dp_lm.data import DPClassPriors
    from keras_dp_lm.data import poisson_user_batches

    x, y = np.eye(4), np.array([0, 1, 0, 1])
    users = np.array([1.0, 2.0, bad, bad], dtype=float if bad is not None else object)
    match = "NaN or infinite" if bad is not None else "None"
    with pytest.raises(ValueError, match=match):
        DPClassMeans(2, SIGMA).adapt(x, y, user_ids=users)
    with pytest.raises(ValueError, match=match):
        DPFeatureNormalization().adapt(x, user_ids=users)
    with pytest.raises(ValueError, match=match):
        DPClassPriors(2).release(y, user_ids=users)
    with pytest.raises(ValueError, match=match):
        poisson_user_batches((x, y), users, sampling_rate=0.5, max_users=4,
                             examples_per_user=1)


def test_user_ids_of_mixed_types_are_refused_not_merged():
    """``[1, 1, "1"]`` becomes three ``"1"`` strings in one NumPy array: two people
    merged into one user moved a user-level release by 1.33 against a claim of 1.03."""
    from keras_dp_lm.data import DPClassPriors
    from keras_dp_lm.data import poisson_user_batches
    from keras_dp_lm.data import records_per_user

    x, y = np.eye(4), np.array([0, 1, 0, 1])
    for users in ([1, 1, 2, "1"], [True, 1, 2, 2], np.array([1, "a", 2, 2], dtype=object)):
        layers = (DPClassMeans(2, SIGMA), DPFeatureNormalization(), DPClassPriors(2))
        with pytest.raises(ValueError, match="`user_ids` mix .* Give every id the same type"):
            layers[0].adapt(x, y, user_ids=users)
        with pytest.raises(ValueError, match="`user_ids` mix"):
            layers[1].adapt(x, user_ids=users)
        with pytest.raises(ValueError, match="`user_ids` mix"):
            layers[2].release(y, user_ids=users)
        with pytest.raises(ValueError, match="`user_ids` mix"):
            poisson_user_batches((x, y), users, sampling_rate=0.5, max_users=4,
                                 examples_per_user=1)
        with pytest.raises(ValueError, match="`user_ids` mix"):
            records_per_user(users)
        assert [layer.num_releases for layer in layers] == [0, 0, 0]
    # one type each, however given: accepted
    assert records_per_user(["a", "b", "a", "c"]).tolist() == [1, 1, 2]
    assert records_per_user(np.array([3, 1, 3])).tolist() == [1, 2]


def test_16_bit_dtypes_are_refused_before_any_release():
    """The logits scale with d / spread (about 1e5 for well separated classes):
    float16 overflowed to inf and NaN after the release was counted."""
    for dtype in ("float16", "bfloat16", "mixed_float16", "mixed_bfloat16"):
        with pytest.raises(ValueError, match="needs float32 or float64.*dtype='float32'"):
            DPClassMeans(2, SIGMA, dtype=dtype)
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="needs float32"):
            DPClassMeans(2, SIGMA)
        layer = DPClassMeans(2, SIGMA, seed=0, dtype="float32")
    finally:
        keras.config.set_dtype_policy(policy)
    x = np.repeat(np.eye(2) * 50, 20, axis=0)   # well separated: the spread's floor
    layer.adapt(x, np.repeat([0, 1], 20))
    assert np.all(np.isfinite(np.asarray(layer(x.astype("float32")))))


def test_a_release_count_restored_into_the_weights_alone_is_checked_and_counted():
    """A count that reaches the layer only through its ``releases`` weight (a
    restore path that writes the variables and nothing else) still makes the
    accountant require the release, and the event count it."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    trained = DPClassMeans(2, SIGMA, seed=0)
    trained.adapt(x, y)
    trained.adapt(x, y)
    restored = DPClassMeans(2, SIGMA)
    restored.build((None, 4))
    for target, value in zip(restored.weights, trained.get_weights()):
        target.assign(value)                   # variables only: num_releases stays 0
    restored._has_release = True
    assert restored.num_releases == 0 and restored.releases_made() == 2
    assert restored.dp_event() == trained.dp_event()
    model = keras.Sequential([keras.Input((4,)), restored, keras.layers.Dense(2)])
    with pytest.raises(PrivacyRefusalError, match="2 time"):
        _dp_fit(model, x, y)
    assert ledger_of(model).updates == 0
