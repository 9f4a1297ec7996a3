"""DPFeatureNormalization: the released mean's noise and sensitivity, its events and
their accounting, per-example outputs, saving, and the refusals."""

import dp_accounting
import keras
import numpy as np
import pytest

from keras_dp_lm.accounting import compose_epsilon
from keras_dp_lm.accounting import ledger_events
from keras_dp_lm.data import DPFeatureNormalization
from keras_dp_lm.data.feature_normalization import COUNT_NOISE_SCALE
from keras_dp_lm.data.feature_normalization import MEAN_NOISE_MULTIPLIER
from keras_dp_lm.data.releases import release_sensitivity
from keras_dp_lm.recipes import suggest_recipe
from keras_dp_lm.training.model_ledgers import ledger_of


def _release(layer, features, **kwargs):
    """What one ``adapt`` released, as the vector its event's sensitivity is about:
    ``(noised sum, noised count / COUNT_NOISE_SCALE)``."""
    layer.adapt(features, **kwargs)
    return np.append(layer.released_sum, layer.released_count / COUNT_NOISE_SCALE)


def test_noise_std_matches_the_noise_multiplier():
    d = 20000
    features = np.zeros((10, d))
    features[:, 0] = 3.0  # ten copies of 3 e_0: the noiseless sum is 10 e_0
    layer = DPFeatureNormalization(noise_multiplier=2.5, seed=3)
    layer.adapt(features)
    noise = layer.released_sum - np.eye(d)[0] * 10
    # std of d draws: relative standard error 1 / sqrt(2 d) = 0.5%
    assert np.std(noise) == pytest.approx(2.5, rel=0.02)
    assert np.mean(noise) == pytest.approx(0.0, abs=3 * 2.5 / np.sqrt(d))
    counts = [_release(DPFeatureNormalization(noise_multiplier=2.5, seed=s), features[:, :2])[-1]
              * COUNT_NOISE_SCALE - 10 for s in range(2000)]
    # the count's noise: std COUNT_NOISE_SCALE * 2.5 (relative standard error 1.6%)
    assert np.std(counts) == pytest.approx(COUNT_NOISE_SCALE * 2.5, rel=0.06)


def test_the_mean_is_the_released_sum_over_the_released_count():
    """Post-processing of the release only: no divisor computed from the data."""
    features = np.random.default_rng(0).normal(1.0, 1.0, (300, 6))
    layer = DPFeatureNormalization(seed=2)
    layer.adapt(features)
    np.testing.assert_allclose(layer.mean.numpy(),
                               layer.released_sum / max(layer.released_count, 1.0), rtol=1e-6)
    assert layer.released_count != 300


def _claimed_bound(layer):
    """The largest move of the released vector (in units of its noise std) that
    the layer's event allows: 1 / the event's noise multiplier."""
    return 1.0 / layer.dp_event().noise_multiplier


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_sensitivity_on_neighbouring_datasets_is_what_the_event_claims(scale):
    """Add/remove one record, the added one opposite the mean (the worst case
    for a mean), paired noise: the released vector moves by at most what the
    event allows, and by exactly that for a record opposite every other."""
    rng = np.random.default_rng(0)
    features = rng.normal(0.5, 1.0, size=(50, 16)) * scale
    features[7] *= 1e6  # an outlier moves the release by no more than anyone else
    opposite = -features.mean(0, keepdims=True)
    neighbours = [np.delete(features, 0, axis=0), np.delete(features, 7, axis=0),
                  np.concatenate([features, opposite])]
    sigma = MEAN_NOISE_MULTIPLIER
    for neighbour in neighbours:
        # same seed, same release index: the same noise, so the difference is the
        # noiseless statistics' difference
        full = _release(DPFeatureNormalization(seed=1), features)
        other = _release(DPFeatureNormalization(seed=1), neighbour)
        moved = np.linalg.norm(full - other) / sigma
        assert moved <= _claimed_bound(DPFeatureNormalization()) * (1 + 1e-9)
        assert moved == pytest.approx(release_sensitivity() / sigma, rel=1e-6)


def test_the_released_mean_moves_no_more_than_its_noise_allows():
    """Before: dividing the noised sum by the data's own count
    moved the released mean by up to 2 in units of the sum under add/remove; the
    mean now moves like a function of the released pair, i.e. by about 1 (the
    sum's part), whatever the neighbour."""
    rng = np.random.default_rng(3)
    features = rng.normal(1.0, 0.3, size=(400, 8))
    opposite = -features.mean(0, keepdims=True)
    moves = []
    for seed in range(50):
        a = DPFeatureNormalization(seed=seed)
        b = DPFeatureNormalization(seed=seed)
        a.adapt(features)
        b.adapt(np.concatenate([features, opposite]))
        # the mean scaled by the released count: in units of the sum
        moves.append(np.linalg.norm(b.mean.numpy() * b.released_count
                                    - a.mean.numpy() * a.released_count))
    assert max(moves) <= release_sensitivity() * (1 + 1e-5)


def test_user_level_sensitivity_is_what_the_event_claims():
    rng = np.random.default_rng(1)
    features = rng.normal(size=(60, 8))
    users = np.repeat(np.arange(6), 10)
    features[users == 2] = rng.normal(size=8) * 100  # a user with ten identical rows
    keep = users != 2
    full = _release(DPFeatureNormalization(seed=4), features, user_ids=users)
    less = _release(DPFeatureNormalization(seed=4), features[keep], user_ids=users[keep])
    moved = np.linalg.norm(full - less) / MEAN_NOISE_MULTIPLIER
    assert moved == pytest.approx(release_sensitivity() / MEAN_NOISE_MULTIPLIER, rel=1e-6)
    assert moved <= _claimed_bound(DPFeatureNormalization()) * (1 + 1e-9)


def test_outputs_have_the_norm_and_are_per_example():
    rng = np.random.default_rng(2)
    features = rng.normal(2.0, 1.0, (300, 12)).astype("float32")
    layer = DPFeatureNormalization(norm=3.0, seed=0)
    layer.adapt(features)
    batch = np.asarray(layer(features[:20]))
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 3.0, rtol=1e-5)
    one_by_one = np.concatenate([np.asarray(layer(features[i:i + 1])) for i in range(20)])
    np.testing.assert_allclose(batch, one_by_one, rtol=1e-6, atol=1e-6)
    mean = layer.mean.numpy()
    units = features[:20] / np.linalg.norm(features[:20], axis=1, keepdims=True)
    expected = units - mean
    expected = 3.0 * expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(batch, expected, rtol=1e-5, atol=1e-5)


def test_every_release_is_an_event_and_epsilon_matches_dp_accounting():
    layer = DPFeatureNormalization(noise_multiplier=4.0, seed=0)
    planned = layer.dp_event()  # before adapt: the release it will make
    assert planned == dp_accounting.GaussianDpEvent(4.0 / np.sqrt(1 + COUNT_NOISE_SCALE**-2))
    features = np.random.default_rng(0).normal(size=(100, 4))
    layer.adapt(features)
    assert layer.num_releases == 1 and layer.dp_event() == planned
    first = layer.mean.numpy().copy()
    layer.adapt(features)
    assert layer.num_releases == 2
    assert not np.allclose(first, layer.mean.numpy())  # a fresh noise stream
    direct = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=1e-4)
    direct.compose(dp_accounting.GaussianDpEvent(4.0 / np.sqrt(1 + 1 / 16)), 2)
    assert compose_epsilon([layer.dp_event()], 1e-6) == pytest.approx(
        direct.get_epsilon(1e-6), rel=1e-3)


def test_the_recipe_accountant_composes_the_mean_with_training():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, (400, 6)).astype("float32")
    y = (x[:, 0] > 1.0).astype("int32")
    norm = DPFeatureNormalization(seed=0)
    norm.adapt(x)
    recipe = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=10, trainable="head",
                            extra_events=[norm.dp_event()])
    head = keras.Sequential([keras.Input((6,)), norm, keras.layers.Dense(2)])
    head.compile(optimizer=recipe.optimizer(seed=0),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = recipe.poisson_batches((x, y), seed=0)
    accountant = recipe.accountant(batches=batches, verbose=0)
    head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    ledger = ledger_of(head)
    assert ledger.updates == recipe.steps
    report = accountant.report()
    rows = [row for row in ledger.rows() if row[3]]
    direct = compose_epsilon(ledger_events(rows, len(y)) + [dp_accounting.GaussianDpEvent(
        norm.noise_multiplier / np.sqrt(1 + 1 / 16))], report["total_delta"])
    assert report["total_epsilon"] == pytest.approx(direct, rel=1e-3)
    assert report["total_epsilon"] > accountant.epsilon
    assert report["total_epsilon"] <= 3.0
    np.testing.assert_array_equal(norm.mean.numpy(), head.layers[0].mean.numpy())
    assert not head.layers[0].trainable_weights


def test_saving_keeps_the_mean_and_the_release_count(tmp_path):
    features = np.random.default_rng(5).normal(size=(80, 5)).astype("float32")
    layer = DPFeatureNormalization(norm=2.0, seed=9)
    layer.adapt(features)
    model = keras.Sequential([keras.Input((5,)), layer, keras.layers.Dense(3)])
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    again = loaded.layers[0]
    assert isinstance(again, DPFeatureNormalization)
    assert (again.norm, again.noise_multiplier, again.seed, again.num_releases) == (
        2.0, 5.0, 9, 1)
    np.testing.assert_array_equal(again.mean.numpy(), layer.mean.numpy())
    np.testing.assert_allclose(loaded.predict(features, verbose=0),
                               model.predict(features, verbose=0), rtol=1e-6)
    again.adapt(features)  # counts on from the saved releases, with a new stream
    assert again.num_releases == 2
    assert not np.allclose(again.mean.numpy(), layer.mean.numpy())


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="not differentially private"):
        DPFeatureNormalization(noise_multiplier=0.0)
    with pytest.raises(ValueError, match="`norm` must be > 0"):
        DPFeatureNormalization(norm=0.0)
    with pytest.raises(ValueError, match="`seed` must be an int"):
        DPFeatureNormalization(seed=1.5)
    layer = DPFeatureNormalization()
    with pytest.raises(ValueError, match="call `adapt"):
        layer(np.ones((2, 3), "float32"))
    with pytest.raises(ValueError, match=r"non-empty \[N, d\]"):
        layer.adapt(np.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        layer.adapt(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="user_ids"):
        layer.adapt(np.ones((4, 3)), user_ids=[0, 1])
    assert layer.num_releases == 0  # nothing was released by a refused call
    layer.adapt(np.ones((4, 3)))
    with pytest.raises(ValueError, match="built for 3 features"):
        layer.adapt(np.ones((4, 5)))
    assert layer.num_releases == 1


def _head_and_recipe(x, y, norm, extra_events, users=None):
    units = len(np.unique(users)) if users is not None else len(y)
    recipe = suggest_recipe(units, 3.0, 1e-6, epochs=5, min_steps=5, trainable="head",
                            extra_events=extra_events)
    head = keras.Sequential([keras.Input((x.shape[1],)), norm, keras.layers.Dense(2)])
    head.compile(optimizer=recipe.optimizer(seed=0),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = (recipe.poisson_batches((x, y), seed=0) if users is None
               else recipe.poisson_user_batches((x, y), users, 4, seed=0))
    return head, recipe, batches


def test_the_accountant_refuses_a_release_left_out_of_its_total():
    from keras_dp_lm import PrivacyAccountant
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    norm = DPFeatureNormalization(seed=0)
    norm.adapt(x)
    head, recipe, batches = _head_and_recipe(x, y, norm, [])
    plain = PrivacyAccountant(target_epsilon=3.0, delta=1e-6, batches=batches, verbose=0)
    with pytest.raises(PrivacyRefusalError, match=r"extra_events=\[layer.dp_event\(\)\]"):
        head.fit(batches, epochs=1, callbacks=[plain], verbose=0)
    assert ledger_of(head).updates == 0  # refused before any update
    # an event taken before a second adapt is stale: it counts one release of two
    stale = norm.dp_event()
    norm.adapt(x)
    head, recipe, batches = _head_and_recipe(x, y, norm, [stale])
    with pytest.raises(PrivacyRefusalError, match="2 time"):
        head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)],
                 verbose=0)
    head, recipe, batches = _head_and_recipe(x, y, norm, [norm.dp_event()])
    head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)], verbose=0)
    assert ledger_of(head).updates == recipe.steps


def test_the_report_refuses_a_release_made_after_training():
    """A layer adapted again after ``fit`` holds a release the report's total would
    leave out: ``report()`` makes the accountant's check again and refuses."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    norm = DPFeatureNormalization(seed=0)
    norm.adapt(x)
    head, recipe, batches = _head_and_recipe(x, y, norm, [norm.dp_event()])
    accountant = recipe.accountant(batches=batches, verbose=0)
    head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    spent = accountant.report()["total_epsilon"]
    assert spent <= 3.0
    norm.adapt(x)   # a second release, now in the trained model
    with pytest.raises(PrivacyRefusalError, match=r"report\(\): .*2 time\(s\)"):
        accountant.report()
    with pytest.raises(PrivacyRefusalError, match=r"report\(\)"):
        accountant.statement()


def test_the_accountant_refuses_a_per_record_mean_for_user_level_training():
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(240, 4)).astype("float32"), rng.integers(0, 2, 240)
    users = np.repeat(np.arange(40), 6)
    per_record = DPFeatureNormalization(seed=0)
    per_record.adapt(x)  # one record as the unit: a user with 6 records moves it 6x
    head, recipe, batches = _head_and_recipe(x, y, per_record, [per_record.dp_event()],
                                             users)
    with pytest.raises(PrivacyRefusalError, match="adapt it again with `user_ids`"):
        head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)],
                 verbose=0)
    assert ledger_of(head).updates == 0
    per_user = DPFeatureNormalization(seed=0)
    per_user.adapt(x, user_ids=users)
    assert per_user.privacy_unit == "user"
    head, recipe, batches = _head_and_recipe(x, y, per_user, [per_user.dp_event()], users)
    head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)], verbose=0)
    assert ledger_of(head).privacy_unit == "user"
    with pytest.raises(ValueError, match="same unit"):
        per_user.adapt(x)  # a later release must protect the same unit


def test_weights_alone_keep_the_count_and_a_clone_has_no_mean(tmp_path):
    x = np.random.default_rng(3).normal(size=(50, 3)).astype("float32")
    layer = DPFeatureNormalization(seed=0)
    layer.adapt(x)
    layer.adapt(x)
    model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(2)])
    path = tmp_path / "head.weights.h5"
    model.save_weights(path)
    fresh = keras.Sequential([keras.Input((3,)), DPFeatureNormalization(),
                              keras.layers.Dense(2)])
    fresh.load_weights(path)
    assert fresh.layers[0].num_releases == 2
    assert fresh.layers[0].dp_event() == layer.dp_event()
    clone = keras.models.clone_model(model)  # config only: the mean is not copied
    with pytest.raises(ValueError, match="no mean yet"):
        clone(x)
    with pytest.raises(ValueError, match="`num_releases` must be an int >= 0"):
        DPFeatureNormalization(num_releases=-1)


def test_the_group_privacy_line_says_it_leaves_other_releases_out():
    from keras_dp_lm.accounting.report import privacy_report
    from keras_dp_lm.accounting.report import privacy_statement

    with_mean = privacy_statement(privacy_report(
        1.0, 0.01, 100, 1e-6, extra_events=[dp_accounting.GaussianDpEvent(5.0)],
        examples_per_user=4))
    assert "training alone: the other releases are not in it" in with_mean
    alone = privacy_statement(privacy_report(1.0, 0.01, 100, 1e-6, examples_per_user=4))
    assert "(group privacy over example-level DP)." in alone


def test_without_batches_the_unit_is_checked_after_the_first_update():
    from keras_dp_lm import PrivacyAccountant
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(240, 4)).astype("float32"), rng.integers(0, 2, 240)
    users = np.repeat(np.arange(40), 6)
    per_user = DPFeatureNormalization(seed=0)
    per_user.adapt(x, user_ids=users)
    head, recipe, batches = _head_and_recipe(x, y, per_user, [per_user.dp_event()])
    accountant = PrivacyAccountant(delta=1e-6, dataset_size=len(y),
                                   batch_size=recipe.batch_size,
                                   extra_events=[per_user.dp_event()], verbose=0)
    with pytest.raises(PrivacyRefusalError, match=r"the 1 update\(s\) already applied"):
        head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    assert ledger_of(head).updates == 1
    # the same layer with user batches: the unit matches once the ledger knows it
    head, recipe, batches = _head_and_recipe(x, y, per_user, [per_user.dp_event()], users)
    accountant = PrivacyAccountant(delta=1e-6, dataset_size=40, batch_size=recipe.batch_size,
                                   extra_events=[per_user.dp_event()], verbose=0)
    head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    assert ledger_of(head).privacy_unit == "user"


def test_one_event_accounts_for_one_layer_only():
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    first, second = DPFeatureNormalization(seed=0), DPFeatureNormalization(seed=1)
    first.adapt(x)
    second.adapt(x)  # two releases of the same data, each GaussianDpEvent(5)
    inner = keras.Sequential([keras.Input((4,)), second, keras.layers.Dense(2)])
    for events, refused in (([first.dp_event()], True),
                            ([first.dp_event(), second.dp_event()], False)):
        head, recipe, batches = _head_and_recipe(x, y, first, events)
        head = keras.Sequential([keras.Input((4,)), first, inner])
        head.compile(optimizer=recipe.optimizer(seed=0),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit = lambda: head.fit(batches, epochs=1,  # noqa: E731
                               callbacks=[recipe.accountant(batches=batches)], verbose=0)
        if refused:
            with pytest.raises(PrivacyRefusalError, match="not in the accountant's"):
                fit()
            assert ledger_of(head).updates == 0
        else:
            fit()
            assert ledger_of(head).updates == recipe.steps


class _CallsAGlobalLayer(keras.layers.Layer):
    """A custom layer calling a release layer it does not hold (a global)."""

    def __init__(self, outside, **kwargs):
        super().__init__(**kwargs)
        self._outside = lambda: outside  # a closure: Keras does not track it

    def call(self, x):
        return self._outside()(x)


@pytest.mark.parametrize("hidden_in", ["lambda", "custom_call"])
def test_a_release_the_model_does_not_list_is_refused_before_any_update(hidden_in):
    """Before: a DPFeatureNormalization called from a Lambda (or from a custom
    layer that does not hold it) was invisible to the accountant, whose total
    then left its release out. The DP step refuses it when traced."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    norm = DPFeatureNormalization(seed=0)
    norm.adapt(x)
    hiding = (keras.layers.Lambda(lambda t: norm(t)) if hidden_in == "lambda"
              else _CallsAGlobalLayer(norm))
    recipe = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=5, trainable="head",
                            extra_events=[norm.dp_event()])
    head = keras.Sequential([keras.Input((4,)), hiding, keras.layers.Dense(2)])
    head.compile(optimizer=recipe.optimizer(seed=0),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = recipe.poisson_batches((x, y), seed=0)
    with pytest.raises(PrivacyRefusalError, match=r"does not list it among its layers.*"
                       r"keras.layers.Lambda"):
        head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches)],
                 verbose=0)
    assert ledger_of(head).updates == 0  # refused before any update


def test_the_quick_start_spends_at_most_what_it_asks_for_at_the_delta_it_asks_for():
    """The README's head path, N = 3,000, target epsilon 3 at delta 1e-6. The
    accountant's total is printed at 1e-6 (less the recipe's overflow reserve,
    which the report adds back), and dp_accounting
    composing what was applied (the ledger's rows and the release's real
    sensitivity, measured above) at 1e-6 agrees and is at most 3."""
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, (3000, 8)).astype("float32")
    y = (x[:, 0] > 1.0).astype("int32")
    norm = DPFeatureNormalization()
    norm.adapt(x)
    head = keras.Sequential([keras.Input((8,)), norm, keras.layers.Dense(2)])
    recipe = suggest_recipe(len(y), target_epsilon=3.0, delta=1e-6, epochs=50.0,
                            trainable="head", extra_events=[norm.dp_event()],
                            num_parameters=18, num_classes=2)
    batches = recipe.poisson_batches((x, y), seed=0)
    head.compile(optimizer=recipe.optimizer(),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = recipe.accountant(batches=batches, verbose=0)
    head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    report = accountant.report()
    assert ledger_of(head).updates == recipe.steps
    assert report["total_delta"] <= 1e-6
    assert report.get("delta_with_overflow", report["total_delta"]) <= 1e-6 * (1 + 1e-9)
    printed = accountant.statement().split("The whole pipeline")[1]
    assert float(printed.split("delta = ")[1].split(")")[0]) <= 1e-6
    # independently: dp_accounting's PLD on the ledger's rows and the release, with
    # the release's sensitivity as measured on neighbours (not the layer's claim)
    (sigma, q, steps), = {(row[0], recipe.sampling_rate, row[3])
                          for row in ledger_of(head).rows() if row[3]}
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                steps)
    pld.compose(dp_accounting.GaussianDpEvent(MEAN_NOISE_MULTIPLIER / np.sqrt(1 + 1 / 16)))
    direct = pld.get_epsilon(1e-6)
    assert direct <= 3.0
    assert report["total_epsilon"] == pytest.approx(direct, rel=2e-3)
