"""DPClassPriors and LogitAdjustedSparseCategoricalCrossentropy: the released counts'
noise and sensitivity on neighbouring datasets, the event against dp_accounting, the
recipe's composed total, the loss against its formula, per-example independence and
one DP step against a naive per-example loop, saving, and the refusals."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp_lm as kdp
from keras_dp_lm.accounting import compose_epsilon
from keras_dp_lm.accounting import ledger_events
from keras_dp_lm.data import DPClassPriors
from keras_dp_lm.data import LogitAdjustedSparseCategoricalCrossentropy as LASCCE
from keras_dp_lm.recipes import suggest_recipe
from keras_dp_lm.training import dp_clipped_gradient
from keras_dp_lm.training import per_example_losses
from keras_dp_lm.training.model_ledgers import ledger_of
from reference import max_relative_error
from reference import naive_clipped_sum


def test_noise_std_matches_the_noise_multiplier():
    labels = np.repeat(np.arange(500), 3)  # 500 classes, 3 records each
    priors = DPClassPriors(num_classes=500, noise_multiplier=2.5, seed=3)
    noise = []
    for _ in range(20):  # 20 releases of 500 counts: 10,000 draws
        priors.release(labels)
        noise.append(priors.released_counts - 3.0)
    noise = np.concatenate(noise)
    # relative standard error of a std from 10,000 draws: 0.7%
    assert np.std(noise) == pytest.approx(2.5, rel=0.03)
    assert np.mean(noise) == pytest.approx(0.0, abs=3 * 2.5 / np.sqrt(noise.size))
    assert priors.num_releases == 20


def test_the_priors_are_the_floored_released_counts_normalised():
    """Post-processing of the release only: no divisor computed from the data."""
    y = np.array([0] * 900 + [1] * 100 + [2] * 2)
    priors = DPClassPriors(num_classes=3, noise_multiplier=10.0, min_count=1.0, seed=5)
    p = priors.release(y)
    floored = np.maximum(priors.released_counts, 1.0)
    np.testing.assert_allclose(p, floored / floored.sum(), rtol=1e-12)
    assert p.sum() == pytest.approx(1.0)
    assert not np.allclose(priors.released_counts, [900, 100, 2])
    # a count noised below the floor: the floor keeps log(prior) finite
    low = DPClassPriors(num_classes=2, noise_multiplier=50.0, seed=0)
    floored_releases = 0
    for _ in range(30):  # a count of 3 noised with std 50 falls below 1 about half the time
        q = low.release(np.array([0] * 50 + [1] * 3))
        assert np.all(q > 0)
        c0, c1 = low.released_counts
        if c1 < 1.0:
            floored_releases += 1
            assert q[1] == pytest.approx(1.0 / (max(c0, 1.0) + 1.0), rel=1e-12)
    assert floored_releases >= 5


def _claimed_bound(priors):
    """The largest move of the released counts, in units of their noise std, that
    the event allows: 1 / its noise multiplier."""
    return 1.0 / priors.dp_event().noise_multiplier


@pytest.mark.parametrize("num_classes", [2, 5])
def test_sensitivity_on_neighbouring_datasets_is_what_the_event_claims(num_classes):
    """Add a record, remove a record (of every class), paired seeds: the released
    counts move by exactly 1 in L2, i.e. by the event's bound in noise units."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, num_classes, 300)
    sigma = 7.0
    neighbours = ([np.delete(y, np.flatnonzero(y == c)[0]) for c in range(num_classes)]
                  + [np.append(y, c) for c in range(num_classes)])
    for seed in range(5):
        full = DPClassPriors(num_classes, noise_multiplier=sigma, seed=seed)
        full.release(y)
        for neighbour in neighbours:
            other = DPClassPriors(num_classes, noise_multiplier=sigma, seed=seed)
            other.release(neighbour)
            moved = np.linalg.norm(full.released_counts - other.released_counts) / sigma
            assert moved <= _claimed_bound(full) * (1 + 1e-9)
            assert moved == pytest.approx(_claimed_bound(full), rel=1e-9)


def test_user_level_sensitivity_is_what_the_event_claims():
    """A user's histogram counts with total weight 1: removing any user (one with
    many records of one class, or a mixed one) moves the counts by at most 1."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 120)
    users = np.repeat(np.arange(12), 10)
    y[users == 4] = 2  # ten records of one class: the worst case, moves by exactly 1
    sigma = 4.0
    full = DPClassPriors(3, noise_multiplier=sigma, seed=2)
    full.release(y, user_ids=users)
    assert full.privacy_unit == "user"
    moves = []
    for user in range(12):
        keep = users != user
        less = DPClassPriors(3, noise_multiplier=sigma, seed=2)
        less.release(y[keep], user_ids=users[keep])
        moves.append(np.linalg.norm(full.released_counts - less.released_counts) / sigma)
    assert max(moves) <= _claimed_bound(full) * (1 + 1e-9)
    assert moves[4] == pytest.approx(_claimed_bound(full), rel=1e-9)
    # a per-record release of the same data would move by sqrt(10^2) = 10 for user 4
    per_record = [DPClassPriors(3, noise_multiplier=sigma, seed=2) for _ in range(2)]
    per_record[0].release(y)
    per_record[1].release(y[users != 4])
    assert np.linalg.norm(per_record[0].released_counts - per_record[1].released_counts) \
        == pytest.approx(10.0)
    with pytest.raises(ValueError, match="same unit"):
        full.release(y)


def test_every_release_is_an_event_and_epsilon_matches_dp_accounting():
    priors = DPClassPriors(2, noise_multiplier=6.0, seed=0)
    planned = priors.dp_event()
    assert planned == dp_accounting.GaussianDpEvent(6.0)
    priors.release(np.array([0, 0, 1]))
    assert priors.dp_event() == planned
    priors.release(np.array([0, 0, 1]))
    assert priors.dp_event() == dp_accounting.ComposedDpEvent([planned, planned])
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    direct.compose(dp_accounting.GaussianDpEvent(6.0), 2)
    assert compose_epsilon([priors.dp_event()], 1e-6) == pytest.approx(
        direct.get_epsilon(1e-6), rel=1e-3)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(6.0), 2)
    # the PLD epsilon is the tighter one, and of the same size as RDP's
    assert compose_epsilon([priors.dp_event()], 1e-6) <= rdp.get_epsilon(1e-6) * (1 + 1e-3)
    assert compose_epsilon([priors.dp_event()], 1e-6) > 0.5 * rdp.get_epsilon(1e-6)


def test_the_loss_is_cross_entropy_on_adjusted_logits_with_class_weights():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3)).astype("float32")
    y = np.array([0, 1, 2, 2, 1, 0])
    p = np.array([0.7, 0.2, 0.1])
    adjusted = logits + 0.5 * np.log(p)
    log_softmax = adjusted - np.log(np.exp(adjusted).sum(1, keepdims=True))
    expected = -log_softmax[np.arange(6), y]
    weights = p.min() / p
    none = LASCCE(p, tau=0.5, reduction="none")
    np.testing.assert_allclose(np.asarray(none(y, logits)), expected, rtol=1e-5)
    weighted = LASCCE(p, tau=0.5, class_weighting=True, reduction="none")
    np.testing.assert_allclose(np.asarray(weighted(y, logits)), expected * weights[y],
                               rtol=1e-5)
    assert weights.max() == pytest.approx(1.0) and weights.min() > 0
    # tau = 0, no weights: Keras's own cross-entropy
    np.testing.assert_allclose(
        float(LASCCE(p, tau=0.0)(y, logits)),
        float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)),
        rtol=1e-6)
    # labels of shape [B, 1] work too
    np.testing.assert_allclose(np.asarray(none(y[:, None], logits)), expected, rtol=1e-5)


def _head(seed=0, dim=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("class_weighting", [False, True])
def test_the_dp_step_clips_its_per_example_gradients_like_the_naive_loop(class_weighting):
    """The package derives each example's loss from this compiled loss: per-example
    losses are batch-of-one losses, one example's label leaves the others' losses
    alone, and the DP step's norms and clipped sum equal a naive loop's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = np.array([0, 0, 0, 1, 0, 0, 1, 0])
    loss = LASCCE([0.8, 0.2], tau=1.0, class_weighting=class_weighting)
    model = _head()
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.0),
                  loss=loss)
    pred = model(x)
    batched = per_example_losses(model, x, y, pred).numpy()
    singles = [float(model.compute_loss(x=x[i:i + 1], y=y[i:i + 1], y_pred=pred[i:i + 1]))
               for i in range(8)]
    np.testing.assert_allclose(batched, singles, rtol=1e-6)
    flipped = y.copy()
    flipped[0] = 1
    other = per_example_losses(model, x, flipped, pred).numpy()
    np.testing.assert_allclose(other[1:], batched[1:], rtol=1e-7)
    assert other[0] != pytest.approx(batched[0])
    _, norms, _ = naive_clipped_sum(model, x, y, None, 1.0)
    clip = float(np.median(norms))
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=clip, noise_multiplier=0.0),
                  loss=loss)
    expected, expected_norms, _ = naive_clipped_sum(model, x, y, None, clip)
    assert (expected_norms > clip).any() and (expected_norms < clip).any()

    @tf.function
    def run():
        return dp_clipped_gradient(model, (x, y, None))

    result = run()
    np.testing.assert_allclose(result.norms.numpy(), expected_norms, rtol=1e-5)
    assert max_relative_error([g.numpy() for g in result.grads], expected) < 1e-5


def test_the_recipe_composes_the_release_and_a_dp_fit_runs():
    rng = np.random.default_rng(0)
    y = (rng.uniform(size=600) < 0.1).astype("int32")
    x = (rng.normal(size=(600, 6)) + 1.5 * y[:, None]).astype("float32")
    priors = DPClassPriors(2, seed=0)
    priors.release(y)
    recipe = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=10, trainable="head",
                            extra_events=[priors.dp_event()])
    head = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    head.compile(optimizer=recipe.optimizer(seed=0), loss=LASCCE(priors, tau=1.0))
    batches = recipe.poisson_batches((x, y), seed=0)
    accountant = recipe.accountant(batches=batches, verbose=0)
    head.fit(batches, epochs=1, callbacks=[accountant], verbose=0)
    ledger = ledger_of(head)
    assert ledger.updates == recipe.steps
    report = accountant.report()
    rows = [row for row in ledger.rows() if row[3]]
    direct = compose_epsilon(ledger_events(rows, len(y))
                             + [dp_accounting.GaussianDpEvent(priors.noise_multiplier)],
                             report["total_delta"])
    assert report["total_epsilon"] == pytest.approx(direct, rel=1e-3)
    assert report["total_epsilon"] > accountant.epsilon  # the release is in the total
    assert report["total_epsilon"] <= 3.0
    assert report["total_delta"] <= 1e-6 * (1 + 1e-9)
    assert recipe.epsilon <= 3.0
    # without the release the same recipe spends less on training: it made room
    alone = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=10, trainable="head")
    assert alone.noise_multiplier < recipe.noise_multiplier


def test_saving_keeps_the_loss_and_its_priors(tmp_path):
    x = np.random.default_rng(5).normal(size=(20, 5)).astype("float32")
    y = np.array([0] * 15 + [1] * 5)
    model = _head()
    model.compile(optimizer="sgd", loss=LASCCE([0.75, 0.25], tau=0.5, class_weighting=True))
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    loss = loaded.loss
    assert isinstance(loss, LASCCE)
    np.testing.assert_allclose(loss.priors, [0.75, 0.25])
    assert (loss.tau, loss.class_weighting) == (0.5, True)
    assert float(loss(y, model(x))) == pytest.approx(float(model.loss(y, model(x))), rel=1e-6)
    assert loss.release_event is None   # public priors: no release to carry


def test_a_reloaded_loss_still_carries_its_release(tmp_path):
    """Saved and loaded, the loss still names the release its priors came from,
    so the accountant still refuses a fit that leaves it out."""
    priors = DPClassPriors(2, noise_multiplier=5.0, seed=0)
    priors.release([0] * 30 + [1] * 10)
    priors.release([0] * 30 + [1] * 10)
    model = _head()
    model.compile(optimizer="sgd", loss=LASCCE(priors))
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.models.load_model(path).loss
    assert loaded.release_event == priors.dp_event()   # both releases, at sigma 5
    np.testing.assert_allclose(loaded.priors, priors.priors)


def test_the_released_vector_carries_its_release_like_the_object():
    """Given as a plain vector (``priors.priors`` or what ``release`` returned), the
    released priors still name their release, so the accountant still requires it;
    any other vector is public priors."""
    priors = DPClassPriors(2, noise_multiplier=5.0, seed=1)
    returned = priors.release([0] * 30 + [1] * 10)
    for given in (priors.priors, returned, list(priors.priors)):
        assert LASCCE(given).release_event == priors.dp_event()
    # only the returned vector kept, the DPClassPriors object gone
    kept = DPClassPriors(2, noise_multiplier=7.0, seed=2).release([0] * 30 + [1] * 10)
    import gc
    gc.collect()
    assert LASCCE(kept).release_event == DPClassPriors(2, noise_multiplier=7.0).dp_event()
    assert LASCCE([0.75, 0.25]).release_event is None


def test_a_cast_or_rounded_released_vector_still_carries_its_release():
    """Cast to float32 or rounded, the released priors are still the release: taken
    as public they would drop its event from the accountant's total."""
    priors = DPClassPriors(3, noise_multiplier=4.0, seed=3)
    priors.release([0] * 50 + [1] * 30 + [2] * 20)
    for given in (priors.priors.astype("float32"), np.round(priors.priors, 3),
                  np.round(priors.priors, 6).tolist()):
        loss = LASCCE(given)
        assert loss.release_event == priors.dp_event()
        assert loss.release_unit == "example"
    # a vector further than RELEASE_MATCH_ATOL from every release is public
    assert LASCCE(priors.priors + np.array([0.01, -0.005, -0.005])).release_event is None


def test_training_refuses_priors_released_for_another_privacy_unit(tmp_path):
    """Priors released per example, in training that protects users (or the reverse),
    are refused before any update: a user with k records of one class moves the
    per-example counts by k, not 1. The unit is saved with the loss."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(4)
    users = np.repeat(np.arange(120), 4)
    y = np.repeat((rng.uniform(size=120) < 0.3).astype("int32"), 4)
    x = (rng.normal(size=(480, 4)) + y[:, None]).astype("float32")
    per_example, per_user = DPClassPriors(2, seed=0), DPClassPriors(2, seed=1)
    per_example.release(y)
    per_user.release(y, user_ids=users)
    for priors, user_level in ((per_example, True), (per_user, False)):
        recipe = suggest_recipe(120 if user_level else 480, 3.0, 1e-6, epochs=2,
                                min_steps=5, trainable="head",
                                extra_events=[priors.dp_event()])
        head = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        head.compile(optimizer=recipe.optimizer(seed=0), loss=LASCCE(priors))
        batches = (recipe.poisson_user_batches((x, y), users, examples_per_user=4, seed=0)
                   if user_level else recipe.poisson_batches((x, y), seed=0))
        unit = "user" if user_level else "example"
        with pytest.raises(PrivacyRefusalError, match=f"protects one {unit}.*refused before"):
            head.fit(batches, epochs=1, verbose=0,
                     callbacks=[recipe.accountant(batches=batches, verbose=0)])
        assert ledger_of(head).updates == 0
    path = tmp_path / "head.keras"
    head.save(path)
    assert keras.models.load_model(path).loss.release_unit == "user"


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="not differentially private"):
        DPClassPriors(2, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="`num_classes` must be an int >= 2"):
        DPClassPriors(1)
    for bad in (0.0, float("inf"), float("nan")):   # refused before any release
        with pytest.raises(ValueError, match="`min_count` must be a finite number > 0"):
            DPClassPriors(2, min_count=bad)
    with pytest.raises(ValueError, match="`seed` must be an int"):
        DPClassPriors(2, seed=1.5)
    priors = DPClassPriors(2)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        priors.release([0, 1, 2])
    with pytest.raises(ValueError, match="integer class ids"):
        priors.release([0.5, 1.0])
    with pytest.raises(ValueError, match="`user_ids` must have one entry per record"):
        priors.release([0, 1], user_ids=[0])
    assert priors.num_releases == 0  # nothing released by a refused call
    with pytest.raises(ValueError, match="no priors yet"):
        LASCCE(priors)
    with pytest.raises(ValueError, match="from_logits=True"):
        LASCCE([0.5, 0.5], from_logits=False)
    with pytest.raises(ValueError, match="`tau` must be"):
        LASCCE([0.5, 0.5], tau=-1.0)
    with pytest.raises(ValueError, match="positive numbers"):
        LASCCE([1.0, 0.0])
    # a head with another number of outputs than the priors' classes
    with pytest.raises(ValueError, match=r"outputs 2 logits .* priors have 4 classes.*Dense\(4\)"):
        LASCCE([0.25] * 4)(np.array([0, 1]), np.zeros((2, 2), "float32"))


def test_the_accountant_refuses_a_loss_whose_priors_release_it_does_not_count():
    """The priors live in the loss, where the accountant cannot walk to them as it
    does to layers: the loss carries its release's event, and an accountant
    without it among extra_events refuses before any update."""
    from keras_dp_lm.errors import PrivacyRefusalError

    rng = np.random.default_rng(1)
    y = (rng.uniform(size=400) < 0.2).astype("int32")
    x = rng.normal(size=(400, 4)).astype("float32")
    priors = DPClassPriors(2, seed=0)
    priors.release(y)
    recipe = suggest_recipe(len(y), 3.0, 1e-6, epochs=5, min_steps=5, trainable="head")
    head = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    head.compile(optimizer=recipe.optimizer(seed=0), loss=LASCCE(priors))
    batches = recipe.poisson_batches((x, y), seed=0)
    with pytest.raises(PrivacyRefusalError, match=r"priors.dp_event\(\)"):
        head.fit(batches, epochs=1, callbacks=[recipe.accountant(batches=batches, verbose=0)],
                 verbose=0)
    assert ledger_of(head).updates == 0  # refused before any update
    # public priors (a plain vector) carry no release
    assert LASCCE([0.8, 0.2]).release_event is None
