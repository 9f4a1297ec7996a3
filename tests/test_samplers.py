"""Tests for DP decoding (issue 7): DPSampler, epsilon formulas, DecodingBudget."""

import math
import random

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from keras_dp_lm import samplers, testing
from keras_dp_lm.samplers import (BudgetExhaustedError, DecodingBudget, DPSampler,
                                  epsilon_per_sequence, epsilon_per_token,
                                  lambda_for_epsilon)

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 4.0, 0.25], dtype="float32")
N_DRAWS = 20_000


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _mixture(logits, lambda_, temperature=1.0):
    return lambda_ * _softmax(logits / temperature) + (1 - lambda_) / len(logits)


def _draw(sampler, logits, n=N_DRAWS, jit=False):
    batch = tf.constant(np.tile(logits, (n, 1)))

    def step(x):
        return sampler.get_next_token(sampler.compute_probabilities(x))

    if jit:
        step = tf.function(step, jit_compile=True)
    return np.asarray(step(batch))


# --------------------------------------------------------------------------
# Sampling distribution
# --------------------------------------------------------------------------

@pytest.mark.parametrize("lambda_,temperature,jit", [
    (0.7, 1.0, False), (0.9, 0.5, True), (0.3, 2.0, True)])
def test_frequencies_match_mixture(lambda_, temperature, jit):
    sampler = DPSampler(lambda_, temperature=temperature, seed=123)
    expected = _mixture(LOGITS.astype("float64"), lambda_, temperature)
    tokens = _draw(sampler, LOGITS, jit=jit)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    assert counts.sum() == N_DRAWS
    _, p = stats.chisquare(counts, expected / expected.sum() * N_DRAWS)
    assert p > 1e-3
    # The test has power: the model alone (or uniform) is rejected.
    model = _softmax(LOGITS.astype("float64") / temperature)
    _, p_model = stats.chisquare(counts, model / model.sum() * N_DRAWS)
    _, p_uniform = stats.chisquare(counts, np.full(8, N_DRAWS / 8))
    assert p_model < 1e-10 and p_uniform < 1e-10


def test_lambda_zero_is_uniform():
    sampler = DPSampler(0.0, seed=5)
    probs = np.asarray(sampler.mixture_probabilities(tf.constant(LOGITS[None])))
    np.testing.assert_allclose(probs, np.full((1, 8), 1 / 8), rtol=0, atol=1e-7)
    assert sampler.effective_lambda == 0.0
    counts = np.bincount(_draw(sampler, LOGITS, jit=True), minlength=8)
    _, p = stats.chisquare(counts, np.full(8, N_DRAWS / 8))
    assert p > 1e-3


def test_mixture_probabilities_formula_and_floor():
    sampler = DPSampler(0.8, temperature=1.5, seed=0)
    logits = np.stack([LOGITS, 50 * LOGITS])   # second row: q is one-hot in float32
    q = np.asarray(sampler.compute_probabilities(tf.constant(logits)))
    np.testing.assert_allclose(q[0], _softmax(LOGITS.astype("float64") / 1.5), rtol=1e-6)
    probs = np.asarray(sampler.mixture_probabilities(tf.constant(logits)))
    np.testing.assert_allclose(probs[0], _mixture(LOGITS.astype("float64"), 0.8, 1.5),
                               rtol=1e-6)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-6)
    # Every token keeps at least (1 - lambda_) / |V|: the source of the DP bound.
    assert probs.min() >= (1 - 0.8) / 8 * (1 - 1e-6)
    assert probs.max() <= (0.8 + 0.2 / 8) * (1 + 1e-6)


def test_floor_holds_even_when_model_branch_gives_zero_mass():
    # A one-hot q (log q = -inf elsewhere): every token must still appear with
    # probability (1 - lambda_) / |V|, from the integer uniform branch alone.
    sampler = DPSampler(0.5, seed=11)
    one_hot = np.zeros((N_DRAWS, 8), "float32")
    one_hot[:, 6] = 1.0
    tokens = np.asarray(tf.function(sampler.get_next_token, jit_compile=True)(
        tf.constant(one_hot)))
    expected = np.full(8, 0.5 / 8)
    expected[6] += 0.5
    counts = np.bincount(tokens, minlength=8)
    _, p = stats.chisquare(counts, expected * N_DRAWS)
    assert p > 1e-3 and counts.min() > 0


def test_effective_lambda_rounds_down_exactly():
    for lam in [0.9, 0.5, 1 / 3, math.nextafter(1.0, 0.0), 1e-30]:
        s = DPSampler(lam)
        assert s.effective_lambda <= lam and lam - s.effective_lambda <= 2.0 ** -62
        assert epsilon_per_token(s.effective_lambda, 50_257) <= epsilon_per_token(lam, 50_257)
    assert DPSampler(0.5).effective_lambda == 0.5
    assert DPSampler(math.nextafter(1.0, 0.0)).effective_lambda < 1.0


def test_seeds_reproduce_and_advance():
    a, b = DPSampler(0.5, seed=42), DPSampler(0.5, seed=42)
    first_a, first_b = _draw(a, LOGITS, 500), _draw(b, LOGITS, 500)
    np.testing.assert_array_equal(first_a, first_b)
    assert not np.array_equal(first_a, _draw(a, LOGITS, 500))   # state advanced


def test_unseeded_sampler_uses_os_entropy_not_python_random():
    random.seed(0)
    s1 = DPSampler(0.5)
    random.seed(0)
    s2 = DPSampler(0.5)
    assert s1.seed is None and s2.seed is None
    state1, state2 = np.asarray(s1.seed_generator.state), np.asarray(s2.seed_generator.state)
    assert not np.array_equal(state1, state2)
    assert state1[1] != 0 and state2[1] != 0      # both state words from os.urandom


# --------------------------------------------------------------------------
# Epsilon
# --------------------------------------------------------------------------

def test_epsilon_per_token_hand_computed():
    # (1 + (V-1) lam) / (1 - lam):  V=2, lam=.5 -> 3;  V=300, lam=.5 -> 301;
    # V=150000, lam=.9 -> (1 + 134999.1) / 0.1 = 1350001.
    assert epsilon_per_token(0.5, 2) == pytest.approx(1.0986122886681098, rel=1e-12)
    assert epsilon_per_token(0.5, 300) == pytest.approx(5.707110264748875, rel=1e-12)
    assert epsilon_per_token(0.9, 150_000) == pytest.approx(14.115615891155079, rel=1e-12)
    assert epsilon_per_token(0.0, 150_000) == 0.0
    assert DPSampler(0.9).epsilon_per_token(150_000) == epsilon_per_token(0.9, 150_000)
    # Tiny lambda: eps ~ V * lambda (log1p keeps it accurate).
    assert epsilon_per_token(1e-12, 150_000) == pytest.approx(150_000e-12, rel=1e-6)


def test_epsilon_per_sequence_hand_computed():
    # V=150000, lam=.5: per token log(150001); 20 tokens.
    assert epsilon_per_sequence(0.5, 150_000, 20) == pytest.approx(238.36794479445675,
                                                                   rel=1e-12)
    assert DPSampler(0.5).epsilon_per_sequence(150_000, 20) == pytest.approx(
        20 * 11.918397239722838, rel=1e-12)
    assert epsilon_per_sequence(0.5, 150_000, 0) == 0.0
    assert samplers.num_sampled_tokens(40, 3) == 37
    assert samplers.num_sampled_tokens(10, 12) == 0


def test_lambda_for_epsilon_inverts_and_never_overspends():
    assert lambda_for_epsilon(math.log(3), 2, 1) == pytest.approx(0.5, rel=1e-12)
    assert lambda_for_epsilon(238.36794479445675, 150_000, 20) == pytest.approx(0.5, rel=1e-9)
    assert lambda_for_epsilon(0.0, 150_000, 20) == 0.0
    for eps, v, t in [(1.0, 150_000, 50), (10.0, 50_257, 1), (3.0, 8, 7), (30.0, 10, 1)]:
        lam = lambda_for_epsilon(eps, v, t)
        assert 0 <= lam < 1
        assert epsilon_per_sequence(lam, v, t) <= eps
        # Float resolution of lambda_ near 1 limits the match for large eps/T.
        assert epsilon_per_sequence(lam, v, t) == pytest.approx(eps, rel=1e-5)
        DPSampler(lam)   # always a valid sampler argument
    # Beyond what a float lambda_ < 1 can reach: the largest float below 1.
    lam = lambda_for_epsilon(1e6, 10, 1)
    assert lam == math.nextafter(1.0, 0.0)
    assert epsilon_per_sequence(lam, 10, 1) == pytest.approx(math.log(10 / 2 ** -53), rel=1e-9)


# --------------------------------------------------------------------------
# Argument checks and serialization
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, float("nan"), True, "0.5", None])
def test_bad_lambda_raises(bad):
    with pytest.raises(ValueError, match="lambda_"):
        DPSampler(bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1"])
def test_bad_temperature_raises(bad):
    with pytest.raises(ValueError, match="temperature"):
        DPSampler(0.5, temperature=bad)


def test_bad_formula_arguments_raise():
    with pytest.raises(ValueError, match="vocabulary_size"):
        epsilon_per_token(0.5, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        epsilon_per_sequence(0.5, 10, -1)
    with pytest.raises(ValueError, match="epsilon"):
        lambda_for_epsilon(-1.0, 10, 1)
    with pytest.raises(ValueError, match="seed"):
        DPSampler(0.5, seed=1.5)


def test_get_config_round_trip():
    sampler = DPSampler(0.75, temperature=0.8, seed=9)
    config = sampler.get_config()
    assert config == {"temperature": 0.8, "lambda_": 0.75, "seed": 9}
    assert DPSampler.from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(sampler)
    assert serialized["registered_name"] == "keras_dp_lm>DPSampler"
    restored = keras_hub.samplers.get(serialized)     # how KerasHub resolves samplers
    assert isinstance(restored, DPSampler) and restored.get_config() == config
    np.testing.assert_array_equal(_draw(sampler, LOGITS, 300), _draw(restored, LOGITS, 300))


# --------------------------------------------------------------------------
# Inside KerasHub generate() (XLA)
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("presets") / "tiny_gpt2"
    testing.save_tiny_gpt2_preset(path, texts=[testing.DEFAULT_TEXT], vocabulary_size=300)
    return str(path)


@pytest.fixture(scope="module")
def llama_preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("presets") / "tiny_llama"
    testing.save_tiny_llama_preset(path, texts=[testing.DEFAULT_TEXT], vocabulary_size=320)
    return str(path)


PROMPTS = ["To be, or", "Shall I compare"]


def test_gpt2_generate_with_dp_sampler_under_xla(gpt2_preset):
    lm = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    lm.compile(sampler=DPSampler(0.8, seed=7), jit_compile=True)
    out = lm.generate(PROMPTS, max_length=16)
    assert [o.startswith(p) and len(o) > len(p) for o, p in zip(out, PROMPTS)] == [True, True]
    assert lm.generate_function._jit_compile is True
    # The sampler's SeedGenerator state is carried across calls.
    assert lm.generate(PROMPTS, max_length=16) != out
    # A model compiled with the sampler rebuilt from its config reproduces it.
    twin = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    twin.compile(sampler=keras_hub.samplers.get(
        keras.saving.serialize_keras_object(DPSampler(0.8, seed=7))), jit_compile=True)
    assert isinstance(twin.sampler, DPSampler)
    assert twin.generate(PROMPTS, max_length=16) == out


def test_gpt2_generate_lambda_zero_samples_uniformly(gpt2_preset):
    lm = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    lm.compile(sampler=DPSampler(0.0, seed=3), jit_compile=False)   # XLA: tests above
    x = lm.preprocessor.generate_preprocess(["To be"] * 32, sequence_length=40)
    prompt_len = int(np.asarray(x["padding_mask"])[0].sum())
    lm.preprocessor = None     # token ids in, token ids out
    out = lm.generate({"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]},
                      stop_token_ids=None)
    tokens = np.asarray(out["token_ids"])[:, prompt_len:].ravel()
    assert tokens.size == 32 * (40 - prompt_len)
    # Group the 300 ids into 10 bins of 30 ids: each bin has probability 1/10.
    counts = np.bincount(tokens // 30, minlength=10)
    _, p = stats.chisquare(counts)
    assert p > 1e-3


def test_llama_generate_with_dp_sampler_under_xla(llama_preset):
    lm = keras_hub.models.LlamaCausalLM.from_preset(llama_preset)
    lm.compile(sampler=DPSampler(0.9, temperature=0.7, seed=1), jit_compile=True)
    out = lm.generate(PROMPTS, max_length=24)
    assert [o.startswith(p) and len(o) > len(p) for o, p in zip(out, PROMPTS)] == [True, True]
    assert lm.generate_function._jit_compile is True
    budget = DecodingBudget(1e6)
    budget.generate(lm, PROMPTS, max_length=24, composition="parallel")
    v = lm.backbone.vocabulary_size
    x = lm.preprocessor.generate_preprocess(PROMPTS, sequence_length=24)
    shortest = int(np.asarray(x["padding_mask"]).sum(axis=-1).min())
    assert 0 < shortest < 24
    assert budget.spent == pytest.approx(epsilon_per_sequence(0.9, v, 24 - shortest),
                                         rel=1e-12)


# --------------------------------------------------------------------------
# Budget
# --------------------------------------------------------------------------

def test_budget_charge_and_exhaustion():
    budget = DecodingBudget(1.0)
    assert budget.charge(0.7) == pytest.approx(0.3)
    budget.charge(0.3)                      # exactly the total: allowed (fsum)
    assert budget.spent == 1.0 and budget.remaining == 0.0
    with pytest.raises(BudgetExhaustedError, match="budget exhausted") as err:
        budget.charge(1e-6)
    assert isinstance(err.value, RuntimeError)
    assert budget.spent == 1.0 and budget.num_charges == 2   # failed charge not recorded
    assert DecodingBudget.from_config(budget.get_config()).spent == 1.0
    with pytest.raises(ValueError, match="total_epsilon"):
        DecodingBudget(-1)
    with pytest.raises(ValueError, match="epsilon"):
        budget.charge(float("nan"))


def test_budget_generate_charges_before_generating(gpt2_preset):
    lm = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    lm.compile(sampler=DPSampler(0.5, seed=0), jit_compile=False)
    v = lm.backbone.vocabulary_size
    x = lm.preprocessor.generate_preprocess(PROMPTS, sequence_length=12)
    lengths = np.asarray(x["padding_mask"]).sum(axis=-1)
    per_seq = [epsilon_per_sequence(0.5, v, 12 - int(n)) for n in lengths]
    budget = DecodingBudget(2.5 * max(per_seq))
    assert budget.epsilon_for(lm, PROMPTS, 12, composition="parallel") == pytest.approx(
        max(per_seq), rel=1e-12)
    assert budget.epsilon_for(lm, PROMPTS, 12) == pytest.approx(  # default: sequential
        sum(per_seq), rel=1e-12)

    calls = []
    real_generate = lm.generate
    lm.generate = lambda *a, **k: calls.append(1) or real_generate(*a, **k)
    out = budget.generate(lm, PROMPTS, max_length=12, composition="parallel")
    assert len(out) == 2 and len(calls) == 1
    budget.generate(lm, PROMPTS, max_length=12, composition="parallel")
    assert budget.spent == pytest.approx(2 * max(per_seq), rel=1e-12)
    with pytest.raises(BudgetExhaustedError):
        budget.generate(lm, PROMPTS, max_length=12, composition="parallel")
    assert len(calls) == 2                              # nothing generated
    assert budget.spent == pytest.approx(2 * max(per_seq), rel=1e-12)


def test_budget_refuses_non_dp_sampler(gpt2_preset):
    lm = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    lm.compile(sampler="greedy")
    with pytest.raises(ValueError, match=r"compile\(sampler=keras_dp_lm.DPSampler"):
        DecodingBudget(10).generate(lm, PROMPTS, max_length=12)
    lm.compile(sampler=DPSampler(0.5))
    with pytest.raises(ValueError, match="composition"):
        DecodingBudget(10).generate(lm, PROMPTS, max_length=12, composition="max")


# --------------------------------------------------------------------------
# Utility
# --------------------------------------------------------------------------

def test_mixture_perplexity(gpt2_preset):
    lm = keras_hub.models.GPT2CausalLM.from_preset(gpt2_preset)
    text = testing.DEFAULT_TEXT[:400]
    ppl = samplers.mixture_perplexity(lm, [text], [0.0, 0.5, 1.0], sequence_length=16)
    assert list(ppl) == [0.0, 0.5, 1.0]
    assert ppl[0.0] == pytest.approx(300, rel=1e-9)     # uniform over |V|
    # Reference for lambda = 0.5 and 1 computed naively from the logits.
    ids = np.asarray(lm.preprocessor.tokenizer(text))
    nll = {0.5: [], 1.0: []}
    for start in range(0, len(ids) - 1, 16):
        chunk = ids[start:start + 16]
        if len(chunk) < 2:
            continue
        logits = np.asarray(lm({"token_ids": chunk[None].astype("int32"),
                                "padding_mask": np.ones((1, len(chunk)), bool)}))[0]
        for t in range(len(chunk) - 1):
            q = _softmax(logits[t].astype("float64"))[chunk[t + 1]]
            nll[0.5].append(-math.log(0.5 * q + 0.5 / 300))
            nll[1.0].append(-math.log(q))
    for lam in (0.5, 1.0):
        assert ppl[lam] == pytest.approx(math.exp(np.mean(nll[lam])), rel=1e-5)
    # -log is convex: the mixture's perplexity is at most the geometric mean.
    assert ppl[0.5] <= math.sqrt(ppl[0.0] * ppl[1.0])


# --------------------------------------------------------------------------
# What is charged is what is applied (DESIGN invariant 9)
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_lm():
    """A tiny offline GPT-2 (|V| = 300) and its preprocessor, used with token ids."""
    lm = testing.tiny_gpt2_causal_lm(texts=[testing.DEFAULT_TEXT], vocabulary_size=300,
                                     seed=0)
    preprocessor = lm.preprocessor
    lm.preprocessor = None     # token ids in and out: the sampled ids are visible
    return lm, preprocessor


def _first_new_tokens(lm, budget, prompts):
    out = budget.generate(lm, prompts, stop_token_ids=None)
    start = int(np.asarray(prompts["padding_mask"])[0].sum())
    return np.asarray(out["token_ids"])[:, start]


@pytest.mark.parametrize("jit", [False, True])
def test_lambda_changed_after_generate_was_traced_is_applied_as_charged(tiny_lm, jit):
    # Regression: the traced sampler kept the lambda_ it was traced with while
    # epsilon was charged at the new value (traced at 0.999, set to 0: charged 0
    # per token, spent epsilon_per_token(0.999, 300) = 12.6 per token).
    lm, preprocessor = tiny_lm
    sampler = DPSampler(0.999, temperature=1e-3, seed=0)   # ~greedy model branch
    lm.compile(sampler=sampler, jit_compile=jit)
    prompts = preprocessor.generate_preprocess(["To be"] * 64, sequence_length=6)
    v = samplers.vocabulary_size_of(lm)
    new_tokens = 6 - int(np.asarray(prompts["padding_mask"])[0].sum())
    budget = DecodingBudget(1e9)

    # 64 identical prompts: the model branch gives (nearly) one token, the
    # uniform branch ~57 distinct of 300 (P[< 40 distinct] < 1e-6).
    assert len(set(_first_new_tokens(lm, budget, prompts))) <= 3
    traced = _budget_function(budget, lm, sampler)
    sampler.lambda_ = 0.0
    assert budget.epsilon_for(lm, prompts) == 0.0
    assert len(set(_first_new_tokens(lm, budget, prompts))) >= 40
    assert budget.spent == pytest.approx(64 * epsilon_per_sequence(0.999, v, new_tokens),
                                         rel=1e-12)
    sampler.lambda_ = 0.999
    assert len(set(_first_new_tokens(lm, budget, prompts))) <= 3
    assert _budget_function(budget, lm, sampler) is traced   # applied without retracing
    assert budget.spent == pytest.approx(
        2 * 64 * epsilon_per_sequence(0.999, v, new_tokens), rel=1e-12)
    assert sampler.get_config()["lambda_"] == 0.999
    with pytest.raises(ValueError, match="lambda_"):
        sampler.lambda_ = 1.0
    assert sampler.lambda_ == 0.999 and sampler.applied_lambda() == 0.999


def _budget_function(budget, lm, sampler):
    return budget._traced[lm]["functions"][id(sampler)][1]


def test_a_sampler_assigned_without_compile_is_the_one_applied(tiny_lm):
    # Regression: KerasHub keeps its traced generate function, which reads
    # `lm.sampler` only when tracing. Assigning `lm.sampler = DPSampler(...)`
    # after a greedy trace sampled greedily (no privacy) while the budget charged
    # the DPSampler; a greedy trace made outside the budget at another width did
    # the same when the DPSampler was assigned back.
    lm, preprocessor = tiny_lm
    prompts = preprocessor.generate_preprocess(["To be"] * 64, sequence_length=6)
    wider = preprocessor.generate_preprocess(["To be"] * 64, sequence_length=7)
    lm.compile(sampler="greedy")
    lm.generate(prompts, stop_token_ids=None)          # traced with greedy
    uniform = DPSampler(0.0, seed=0)                   # lambda 0: uniform tokens
    lm.sampler = uniform
    budget = DecodingBudget(1e9)
    # 64 identical prompts: greedy gives one token, uniform ~57 distinct of 300.
    assert len(set(_first_new_tokens(lm, budget, prompts))) >= 40
    lm.sampler = keras_hub.samplers.GreedySampler()
    greedy = lm.generate(wider, stop_token_ids=None)   # a greedy trace outside the budget
    start = int(np.asarray(wider["padding_mask"])[0].sum())
    assert len(set(np.asarray(greedy["token_ids"])[:, start])) == 1
    lm.sampler = uniform
    assert len(set(_first_new_tokens(lm, budget, wider))) >= 40
    assert len(set(_first_new_tokens(lm, budget, prompts))) >= 40
    assert budget.spent == 0.0                          # lambda 0 costs nothing
    lm.sampler = keras_hub.samplers.GreedySampler()     # the model's own function is back
    again = lm.generate(wider, stop_token_ids=None)
    np.testing.assert_array_equal(np.asarray(again["token_ids"]),
                                  np.asarray(greedy["token_ids"]))


def test_compile_drops_the_budgets_traces(tiny_lm):
    # Before: after `sampler.temperature = ...; lm.compile(sampler=sampler)` the budget
    # kept sampling with its old trace (temperature is in no charge: functional).
    lm, preprocessor = tiny_lm
    sampler = DPSampler(0.999, temperature=1e-3, seed=0)   # ~greedy model branch
    lm.compile(sampler=sampler)
    prompts = preprocessor.generate_preprocess(["To be"] * 64, sequence_length=6)
    budget = DecodingBudget(1e9)
    assert len(set(_first_new_tokens(lm, budget, prompts))) <= 3
    sampler.temperature = 1e6                               # ~uniform model branch
    lm.compile(sampler=sampler)
    assert len(set(_first_new_tokens(lm, budget, prompts))) >= 40


def test_masks_and_lengths_generate_would_misread_are_refused_before_charging(tiny_lm):
    # Regression: a -1 in the padding mask made XLA's generate sample 10
    # positions per row (and overwrite the prompt) where the budget charged 2.
    lm, preprocessor = tiny_lm
    lm.compile(sampler=DPSampler(0.5, seed=0), jit_compile=True)
    prompts = preprocessor.generate_preprocess(["To be"] * 4, sequence_length=6)
    budget = DecodingBudget(1e9)
    bad = {"token_ids": prompts["token_ids"],
           "padding_mask": np.where(np.asarray(prompts["padding_mask"]), 1, -1)}
    with pytest.raises(ValueError, match="only 0 and 1"):
        budget.generate(lm, bad, stop_token_ids=None)
    with pytest.raises(ValueError, match="max_length"):
        budget.generate(lm, ["To be"], max_length=10.5)
    assert budget.spent == 0.0
    ints = {"token_ids": prompts["token_ids"],
            "padding_mask": np.asarray(prompts["padding_mask"]).astype("int32")}
    budget.generate(lm, ints, stop_token_ids=None)     # 0 / 1 integers are fine
    assert budget.spent > 0


def test_a_sampler_swapped_during_generate_withholds_the_output(tiny_lm, monkeypatch):
    # Before: a swap between the budget's check and KerasHub's trace (another thread)
    # sampled greedily while the lambda-0 sampler was charged.
    lm, preprocessor = tiny_lm
    uniform = DPSampler(0.0, seed=0)
    lm.compile(sampler=uniform)
    prompts = preprocessor.generate_preprocess(["To be"] * 4, sequence_length=6)
    generate = lm.generate

    def swapping_generate(*args, **kwargs):
        lm.sampler = keras_hub.samplers.GreedySampler()
        return generate(*args, **kwargs)

    monkeypatch.setattr(lm, "generate", swapping_generate)
    with pytest.raises(RuntimeError, match="output is withheld"):
        DecodingBudget(1e9).generate(lm, prompts, stop_token_ids=None)


def test_charge_refuses_a_coin_threshold_assigned_behind_lambda():
    sampler = DPSampler(0.1, seed=0)
    sampler._coin_threshold_variable.assign(2 ** 61)     # applies 0.5, lambda_ says 0.1
    with pytest.raises(RuntimeError, match="modified directly"):
        sampler.epsilon_per_token(300)
    with pytest.raises(RuntimeError, match="modified directly"):
        sampler.epsilon_per_sequence(300, 5)
    sampler.lambda_ = 0.1                                # the public way resets it
    assert sampler.epsilon_per_token(300) == epsilon_per_token(0.1, 300)


def test_vocabulary_size_charged_is_the_logits_size(tiny_lm):
    # Regression: the charge read backbone.vocabulary_size while the sampler
    # draws over the logits' size; a smaller attribute under-charged
    # (|V| = 100 instead of 300 at lambda 0.9: 6.80 instead of 7.90 per token).
    lm, preprocessor = tiny_lm
    lm.compile(sampler=DPSampler(0.9, seed=0), jit_compile=False)
    prompts = preprocessor.generate_preprocess(["To be"] * 2, sequence_length=6)
    assert samplers.vocabulary_size_of(lm) == 300
    lm.backbone.vocabulary_size = 100
    try:
        with pytest.raises(ValueError, match="logits have size 300"):
            DecodingBudget(1e6).epsilon_for(lm, prompts)
        # Also refused inside generate, at trace time, before any token is drawn.
        lm.compile(sampler=DPSampler(0.9, seed=0), jit_compile=False)
        with pytest.raises(ValueError, match="logits have size 300"):
            lm.generate(prompts, stop_token_ids=None)
    finally:
        lm.backbone.vocabulary_size = 300


def test_token_prompts_are_charged_for_the_width_generate_samples(tiny_lm):
    # Regression: with token ids wider than padding_mask, generate samples up to
    # the token ids' width but the charge used the mask's width.
    lm, _ = tiny_lm
    lm.compile(sampler=DPSampler(0.5, seed=0), jit_compile=False)
    prompts = {"token_ids": np.zeros((2, 10), "int32"),
               "padding_mask": np.array([[True] * 2 + [False] * 4] * 2)}
    with pytest.raises(ValueError, match="same 1-D or 2-D shape"):
        DecodingBudget(1e6).epsilon_for(lm, prompts)
    prompts["padding_mask"] = np.array([[True] * 2 + [False] * 8] * 2)
    assert DecodingBudget(1e6).epsilon_for(lm, prompts) == pytest.approx(
        2 * epsilon_per_sequence(0.5, 300, 8), rel=1e-12)


@pytest.mark.parametrize("jit", [False, True])
def test_nan_probabilities_never_give_an_out_of_range_token(jit):
    # Regression: categorical() on NaN log-probabilities returns the id |V|, an
    # output the uniform branch never produces (unbounded privacy loss).
    sampler = DPSampler(0.9, seed=0)
    step = sampler.get_next_token
    if jit:
        step = tf.function(step, jit_compile=True)
    tokens = np.asarray(step(tf.constant(np.full((4096, 8), np.nan, "float32"))))
    assert tokens.min() >= 0 and tokens.max() <= 7

