"""The DP fine-tuning recipe: its rules, its budget (checked against dp_accounting
called directly) and the objects it builds."""

import dataclasses
import math
import warnings

import dp_accounting
import pytest

from keras_dp_lm.recipes import DPRecipe
from keras_dp_lm.recipes.fine_tuning import OVERFLOW_SHARE
from keras_dp_lm.recipes import suggest_recipe


def _pld_epsilon(sigma, q, steps, delta, extra=()):
    """dp_accounting called directly: the PLD of the subsampled Gaussian, composed
    with the worst-case PLD of each (epsilon, delta) release."""
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld

    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), steps)
    total = accountant._pld  # noqa: SLF001 - the accountant's own composed PLD
    for eps, d in extra:
        total = total.compose(pld.from_privacy_parameters(
            common.DifferentialPrivacyParameters(eps, d),
            value_discretization_interval=1e-4))
    return total.get_epsilon_for_delta(delta)


COMPOSED = 1e-6 * (1 - OVERFLOW_SHARE)  # delta minus the overflow reserve


def test_recipe_spends_at_most_the_target_and_not_much_less():
    recipe = suggest_recipe(20_000, 3.0, delta=1e-6, epochs=4.0)
    direct = _pld_epsilon(recipe.noise_multiplier, recipe.sampling_rate, recipe.steps,
                          COMPOSED)
    assert direct <= 3.0
    assert recipe.epsilon == pytest.approx(direct, rel=1e-9)
    # The noise is the smallest that fits (calibration tolerance 1e-3).
    assert _pld_epsilon(recipe.noise_multiplier / 1.002, recipe.sampling_rate,
                        recipe.steps, COMPOSED) > 3.0


def test_the_padded_cap_overflows_within_the_reserved_delta():
    from keras_dp_lm.data import overflow_probability

    recipe = suggest_recipe(50_000, 8.0, delta=1e-6, epochs=2.0)
    p = overflow_probability(recipe.dataset_size + 1, recipe.sampling_rate,
                             recipe.max_batch_size(), recipe.steps)
    assert (1 + math.exp(8.0)) * p <= OVERFLOW_SHARE * 1e-6
    assert recipe.training_delta == pytest.approx(COMPOSED)


def test_recipe_composes_extra_releases_into_the_budget():
    vocabulary = (1.0, 5e-7)
    recipe = suggest_recipe(69_801, 8.0, delta=1e-6, epochs=1.5,
                            extra_events=[vocabulary])
    direct = _pld_epsilon(recipe.noise_multiplier, recipe.sampling_rate, recipe.steps,
                          COMPOSED, extra=[vocabulary])
    assert direct <= 8.0
    assert _pld_epsilon(recipe.noise_multiplier / 1.002, recipe.sampling_rate,
                        recipe.steps, COMPOSED, extra=[vocabulary]) > 8.0
    assert recipe.training_delta == pytest.approx(COMPOSED - 5e-7)
    assert recipe.training_epsilon == pytest.approx(
        _pld_epsilon(recipe.noise_multiplier, recipe.sampling_rate, recipe.steps,
                     recipe.training_delta), rel=1e-9)


def test_rules_large_batch_few_hundred_steps_small_clip_scaled_rate():
    recipe = suggest_recipe(50_000, 8.0, epochs=2.0, learning_rate=1e-3,
                            reference_batch_size=64, micro_batch_size=256,
                            num_parameters=1_000)
    assert (recipe.steps, recipe.batch_size) == (100, 1000)
    assert recipe.sampling_rate == pytest.approx(1000 / 50_000)
    # Micro-batches are cut from the PADDED batch, so none exceeds micro_batch_size.
    cap = recipe.max_batch_size()
    assert cap > 1000 and recipe.gradient_accumulation_steps == math.ceil(cap / 256) == 5
    assert recipe.l2_norm_clip == 0.1
    assert recipe.noise_learning_rate_factor < 1.01  # r << 1: hardly any noise factor
    assert recipe.learning_rate == pytest.approx(
        1e-3 * math.sqrt(1000 / 64) * recipe.noise_learning_rate_factor)
    assert recipe.delta == 1e-6  # 10^floor(log10(1 / (10 N)))
    assert recipe.epochs == pytest.approx(2.0)
    text = recipe.explain()
    assert "Li et al." in text and "spends no privacy" in text


def test_batch_is_capped_and_the_budget_buys_more_steps():
    recipe = suggest_recipe(1_000_000, 8.0, epochs=1.0, max_batch_size=4096,
                            learning_rate=1e-4, max_learning_rate_scale=4.0,
                            num_parameters=1_000)
    assert recipe.batch_size == 4096 and recipe.steps == 244
    assert recipe.noise_learning_rate_factor < 1.001  # r << 1: hardly any noise factor
    assert recipe.learning_rate == pytest.approx(4e-4 * recipe.noise_learning_rate_factor)


@pytest.mark.filterwarnings("ignore::keras_dp_lm.recipes.NoiseDominatedWarning")
def test_learning_rate_is_raised_for_the_noise_in_adams_second_moment():
    kwargs = dict(dataset_size=10_222, target_epsilon=3.0, epochs=3.0, learning_rate=1e-4,
                  reference_batch_size=32)
    recipe = suggest_recipe(**kwargs, num_parameters=1_000_000)
    sigma, batch = recipe.noise_multiplier, recipe.batch_size
    r = sigma * math.sqrt(1_000_000) / (0.25 * batch)
    assert r > 10  # few examples, a million parameters: noise-dominated
    assert recipe.noise_learning_rate_factor == pytest.approx(math.sqrt(1 + r * r))
    assert recipe.learning_rate == pytest.approx(
        1e-4 * math.sqrt(batch / 32) * math.sqrt(1 + r * r))
    assert "noise factor" in recipe.explain()
    # The factor grows with the parameter count and the alignment assumption,
    # never changes the privacy, and is capped.
    smaller = suggest_recipe(**kwargs, num_parameters=100_000)
    assert 1.0 < smaller.noise_learning_rate_factor < recipe.noise_learning_rate_factor
    aligned = suggest_recipe(**kwargs, num_parameters=1_000_000, gradient_alignment=1.0)
    assert aligned.noise_learning_rate_factor < recipe.noise_learning_rate_factor
    assert (smaller.noise_multiplier, smaller.epsilon) == (sigma, recipe.epsilon)
    capped = suggest_recipe(**kwargs, num_parameters=3_700_000)
    assert capped.noise_learning_rate_factor == 16.0  # the default cap
    assert suggest_recipe(**kwargs, num_parameters=3_700_000,
                          max_noise_learning_rate_scale=4.0).noise_learning_rate_factor == 4.0


def test_a_new_head_gets_the_displacement_rate_whatever_the_non_private_rate():
    kwargs = dict(dataset_size=3_000, target_epsilon=3.0, delta=1e-6, epochs=50.0,
                  num_parameters=770, trainable="head")
    head = suggest_recipe(**kwargs, learning_rate=1e-4)
    assert head.learning_rate == pytest.approx(2.0 / head.steps)
    assert suggest_recipe(**kwargs, learning_rate=1.0).learning_rate == head.learning_rate
    assert suggest_recipe(**kwargs, head_displacement=3.0).learning_rate == pytest.approx(
        3.0 / head.steps)
    assert head.trainable == "head" and "trainable='head'" in head.explain()
    # the privacy is the same as fine-tuning's at the same budget
    tuned = suggest_recipe(**{**kwargs, "trainable": "pretrained"})
    assert (head.noise_multiplier, head.epsilon) == (tuned.noise_multiplier, tuned.epsilon)
    with pytest.raises(ValueError, match="trainable"):
        suggest_recipe(**{**kwargs, "trainable": "lora"})


def test_a_heads_explain_says_what_its_examples_per_class_lead_to_expect():
    kwargs = dict(target_epsilon=3.0, delta=1e-6, epochs=50.0, num_parameters=1540,
                  trainable="head")
    small = suggest_recipe(1_000, **kwargs, num_classes=4)  # 250 per class
    large = suggest_recipe(1_600, **kwargs, num_classes=4)  # 400 per class
    assert "data regime: small, 250 privacy units per class" in small.explain()
    assert "more than 3 below on 13" in small.explain()
    assert "132-220" in small.explain()      # the sixth and seventh held-out rounds
    assert "four of the eight newest" in small.explain()
    assert "worth about half the training data" in small.explain()
    assert "suggest_head" in large.explain()
    assert "data regime: 400 privacy units per class" in large.explain()
    assert "data regime: small" not in large.explain()
    assert all("count the smallest" in r.explain() for r in (small, large))
    # an expectation only: every hyperparameter and the privacy are unchanged
    bare = suggest_recipe(1_000, **kwargs)
    assert "data regime" not in bare.explain()
    assert dataclasses.replace(small, reasons=bare.reasons) == bare
    # fine-tuning pretrained weights: no head measurements to quote
    assert "data regime" not in suggest_recipe(
        1_000, **{**kwargs, "trainable": "pretrained"}, num_classes=4).explain()
    for bad in (1, 0, 2.5, True, "4"):
        with pytest.raises(ValueError, match="num_classes"):
            suggest_recipe(1_000, **kwargs, num_classes=bad)


def test_explain_names_the_regime_and_says_to_train_fewer_parameters_when_swamped():
    # the failing case: 3,600 examples, the whole 22M-parameter MiniLM
    from keras_dp_lm.recipes import NoiseDominatedWarning

    with pytest.warns(NoiseDominatedWarning):
        swamped = suggest_recipe(3_600, 3.0, 1e-6, epochs=3.0, learning_rate=5e-5,
                                 num_parameters=22_000_000)
    assert swamped.noise_to_signal > 100
    assert "regime: noise-dominated" in swamped.explain()
    assert "train fewer parameters" in swamped.explain()
    probe = suggest_recipe(3_000, 3.0, 1e-6, epochs=50.0, num_parameters=770)
    assert probe.noise_to_signal < 10 and "regime: signal-carrying" in probe.explain()
    assert "train fewer parameters" not in probe.explain()


def test_noise_dominated_fine_tuning_warns_and_names_the_fix():
    """The suite's failing case (MiniLM top 2 layers, 3,000 reviews, r = 74)
    warns; a head, a signal-carrying fine-tuning and a head rule do not."""
    from keras_dp_lm.recipes import NoiseDominatedWarning

    with pytest.warns(NoiseDominatedWarning, match="trainable='head'") as caught:
        swamped = suggest_recipe(3_000, 3.0, 1e-5, epochs=3.0, learning_rate=1e-4,
                                 num_parameters=3_697_538)
    assert swamped.noise_to_signal > 10
    assert caught[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseDominatedWarning)
        assert suggest_recipe(3_000, 3.0, 1e-5, epochs=3.0, trainable="head",
                              num_parameters=3_697_538).trainable == "head"
        assert suggest_recipe(50_000, 8.0, 1e-6, epochs=2.0, learning_rate=1e-3,
                              num_parameters=200_000).noise_to_signal < 10


def test_without_the_parameter_count_the_rate_is_uncorrected_and_says_so():
    with pytest.warns(UserWarning, match="num_parameters"):
        recipe = suggest_recipe(10_222, 3.0, epochs=3.0, learning_rate=1e-4)
    assert recipe.noise_learning_rate_factor == 1.0
    assert recipe.learning_rate == pytest.approx(1e-4 * math.sqrt(recipe.batch_size / 32))
    assert "no noise correction" in recipe.explain()


@pytest.mark.parametrize("kwargs", [
    dict(dataset_size=0, target_epsilon=1.0),
    dict(dataset_size=100, target_epsilon=-1.0),
    dict(dataset_size=100, target_epsilon=1.0, delta=1.5),
    dict(dataset_size=100, target_epsilon=1.0, epochs=0),
    dict(dataset_size=100, target_epsilon=1.0, delta=1e-6, extra_events=[(0.5, 1e-6)]),
    dict(dataset_size=100, target_epsilon=1.0, num_parameters=0),
    dict(dataset_size=100, target_epsilon=1.0, num_parameters=10, gradient_alignment=0),
])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        suggest_recipe(**kwargs)


def test_recipe_builds_the_optimizer_batches_and_accountant():
    import numpy as np

    import keras_dp_lm as kdp

    recipe = suggest_recipe(2_000, 4.0, epochs=5.0, micro_batch_size=64,
                            extra_events=[(0.5, 1e-8)])
    assert isinstance(recipe, DPRecipe)
    opt = recipe.optimizer(seed=0)
    assert isinstance(opt, kdp.DPAdam)
    assert opt.noise_multiplier == recipe.noise_multiplier
    assert opt.l2_norm_clip == recipe.l2_norm_clip
    assert opt.expected_batch_size == pytest.approx(recipe.batch_size)
    assert opt.dp_accumulation_steps == recipe.gradient_accumulation_steps
    with pytest.raises(ValueError, match="Adam"):
        recipe.optimizer("sgd")
    x = np.zeros((2_000, 3), "float32")
    batches = recipe.poisson_batches((x, np.zeros(2_000)), seed=0)
    assert batches.sampling_rate == recipe.sampling_rate
    assert int(batches.cardinality()) == recipe.steps
    accountant = recipe.accountant(batches=batches, verbose=0)
    assert accountant.target_epsilon >= recipe.training_epsilon
    assert accountant.delta == recipe.training_delta
    assert recipe.to_dict()["steps"] == recipe.steps


def test_adambc_takes_the_recipe_rate_without_the_noise_factor():
    import keras_dp_lm as kdp

    recipe = suggest_recipe(3_000, 3.0, epochs=3.0, learning_rate=5e-5,
                            reference_batch_size=32, num_parameters=2_000_000)
    assert recipe.noise_learning_rate_factor > 1
    bc = recipe.optimizer("adambc", seed=0)
    assert isinstance(bc, kdp.DPAdamBC)
    assert float(bc.learning_rate.numpy()) == pytest.approx(
        recipe.learning_rate / recipe.noise_learning_rate_factor, rel=1e-6)
    assert bc.noise_multiplier == recipe.noise_multiplier
    assert float(recipe.optimizer("adambc", learning_rate=1e-3).learning_rate.numpy()) == (
        pytest.approx(1e-3))
