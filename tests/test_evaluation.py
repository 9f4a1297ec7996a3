"""Tests for keras_dp_lm.evaluation: canaries, exposure, extraction, one-run audit."""

import math

import numpy as np
import pytest
import scipy.stats

from keras_dp_lm import evaluation as ev


# --------------------------------------------------------------------------------------
# Canaries
# --------------------------------------------------------------------------------------


def test_make_canaries_distinct_formatted_and_seeded():
    canaries = ev.make_canaries(50, format="my ssn is {digits}", num_digits=3, seed=1)
    assert len({c.secret for c in canaries}) == 50
    for c in canaries:
        assert len(c.secret) == 3 and c.secret.isdigit()
        assert c.text == f"my ssn is {c.secret}" == str(c)
        assert c.space.size == 1000
    again = ev.make_canaries(50, num_digits=3, seed=1)
    assert [c.text for c in again] == [c.text for c in canaries]
    spaced = ev.make_canaries(1, format="pin {digits} end", num_digits=4, seed=0,
                              digit_separator=" ")[0]
    assert spaced.text == "pin " + " ".join(spaced.secret) + " end"
    with pytest.raises(ValueError, match="distinct"):
        ev.make_canaries(11, num_digits=1)
    with pytest.raises(ValueError, match="digits"):
        ev.make_canaries(1, format="no field")


def test_insert_canaries_counts_and_order():
    texts = [f"line {i}" for i in range(20)]
    canaries = ev.make_canaries(3, num_digits=5, seed=0)
    out = ev.insert_canaries(texts, canaries, repetitions=[4, 0, 2], seed=3)
    assert len(out) == 26
    assert out.count(canaries[0].text) == 4
    assert out.count(canaries[1].text) == 0
    assert out.count(canaries[2].text) == 2
    assert [t for t in out if t.startswith("line")] == texts  # original order kept
    assert out == ev.insert_canaries(texts, canaries, repetitions=[4, 0, 2], seed=3)


def test_canary_space_sample_excludes():
    space = ev.CanarySpace("x{digits}", 1)
    sample = space.sample(200, seed=0, exclude=["x3"])
    assert "x3" not in sample and set(sample) == {f"x{d}" for d in range(10)} - {"x3"}


# --------------------------------------------------------------------------------------
# Exposure against hand-made log-probability functions
# --------------------------------------------------------------------------------------


def _digits(text):
    return int(text.rsplit(" ", 1)[-1])


def test_rank_exposure_exact_numbers():
    space = ev.CanarySpace("my ssn is {digits}", 2)  # |R| = 100

    def loglik(texts):  # secret 00 is the most likely, 99 the least
        return [-float(_digits(t)) for t in texts]

    top = ev.exposure(loglik, space.text(0), space)
    assert top.method == "rank" and top.rank == 1.0 and top.space_size == 100
    assert top.exposure == pytest.approx(math.log2(100), abs=1e-12)
    eighth = ev.exposure(loglik, space.text(7), space)
    assert eighth.rank == 8.0
    assert eighth.exposure == pytest.approx(math.log2(100) - 3.0, abs=1e-12)
    last = ev.exposure(loglik, space.text(99), space)
    assert last.exposure == pytest.approx(0.0, abs=1e-12)

    # A model that cannot tell candidates apart: mid-rank (1 + 99/2), about 1 bit.
    flat = ev.exposure(lambda texts: np.zeros(len(texts)), space.text(42), space)
    assert flat.rank == 50.5
    assert flat.exposure == pytest.approx(math.log2(100 / 50.5), abs=1e-12)


def test_rank_exposure_with_explicit_candidates_and_canary_object():
    canary = ev.make_canaries(1, num_digits=2, seed=5)[0]
    scores = {canary.text: 0.0}

    def loglik(texts):
        return [scores.get(t, -1.0 - _digits(t) / 100) for t in texts]

    res = ev.exposure(loglik, canary)  # its own 100-text space, enumerated
    assert res.rank == 1.0 and res.exposure == pytest.approx(math.log2(100))
    # An explicit list without the canary: |R| = len(list) + 1.
    others = [f"my ssn is {d:02d}" for d in range(10) if f"{d:02d}" != canary.secret]
    res = ev.exposure(loglik, canary, others)
    assert res.space_size == len(others) + 1
    assert res.exposure == pytest.approx(math.log2(len(others) + 1))


def test_extrapolated_exposure_normal_matches_formula():
    # Candidates' log-perplexities are exact N(5, 2^2) quantiles; the canary sits at 5 - 3*2.
    n = 4000
    quantiles = 5.0 + 2.0 * scipy.stats.norm.ppf((np.arange(n) + 0.5) / n)
    res = ev.exposure_from_log_perplexities(-1.0, quantiles, method="extrapolate",
                                            distribution="normal")
    expected = -math.log2(scipy.stats.norm.cdf(-3.0))  # 9.53 bits
    assert res.exposure == pytest.approx(expected, abs=0.03)
    assert res.fit_params[0] == pytest.approx(5.0, abs=1e-3)
    # Capped at log2 |R| when the space is known.
    capped = ev.exposure_from_log_perplexities(-1.0, quantiles, method="extrapolate",
                                               distribution="normal", space_size=100)
    assert capped.capped and capped.exposure == pytest.approx(math.log2(100))


def test_extrapolated_exposure_skewnorm_through_a_scoring_function():
    # A space of 10^4 candidates whose log-perplexities follow a skew-normal (a=4):
    # scoring maps secret d to the (d + 0.5)/10^4 quantile; the canary gets 0.2.
    dist = scipy.stats.skewnorm(4.0, loc=1.0, scale=1.5)
    space = ev.CanarySpace("code {digits}", 4)
    canary = ev.Canary(space.text(1234), "1234", space)

    def loglik(texts):
        out = []
        for t in texts:
            d = int(t.split()[-1])
            out.append(-0.2 if t == canary.text else -dist.ppf((d + 0.5) / 1e4))
        return out

    res = ev.exposure(loglik, canary, method="extrapolate", num_samples=3000, seed=0)
    assert res.method == "extrapolate" and res.distribution == "skewnorm"
    expected = -math.log2(dist.cdf(0.2))  # about 10.0 bits (|R| = 10^4)
    assert res.exposure == pytest.approx(expected, abs=0.5)
    # The exact rank of the same canary agrees with the extrapolation.
    exact = ev.exposure(loglik, canary, method="rank")
    assert exact.exposure == pytest.approx(expected, abs=0.2)


def test_exposure_rejects_bad_input():
    with pytest.raises(ValueError, match="max_enumerate"):
        ev.exposure(lambda t: np.zeros(len(t)), ev.make_canaries(1, num_digits=6)[0],
                    method="rank")
    with pytest.raises(ValueError, match="candidates_or_space"):
        ev.exposure(lambda t: np.zeros(len(t)), "plain string")
    with pytest.raises(ValueError, match="finite"):
        ev.exposure_from_log_perplexities(0.0, [np.inf, 1.0])


# --------------------------------------------------------------------------------------
# One-run audit math
# --------------------------------------------------------------------------------------


def test_audit_bound_all_correct_closed_form():
    # v = r: P[Bin(r, q) >= r] = q^r = beta  =>  q = beta^(1/r), eps = logit(q).
    for r in (10, 50):
        q = 0.05 ** (1 / r)
        assert ev.audit_lower_bound(r, r, confidence=0.95) == pytest.approx(
            math.log(q / (1 - q)), abs=1e-5)


def test_audit_bound_zero_at_chance_and_monotone():
    assert ev.audit_lower_bound(100, 50) == 0.0
    assert ev.audit_lower_bound(100, 58) == 0.0  # P[Bin(100,.5) >= 58] = 0.067 > 0.05
    bounds = [ev.audit_lower_bound(100, v) for v in range(50, 101)]
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert bounds[-1] > bounds[20] > 0
    # Higher confidence -> smaller bound; delta > 0 -> smaller bound.
    assert ev.audit_lower_bound(100, 80, confidence=0.99) < ev.audit_lower_bound(100, 80)
    pure = ev.audit_lower_bound(100, 80, num_examples=1000)
    approx = ev.audit_lower_bound(100, 80, delta=1e-5, num_examples=1000)
    assert 0 < approx < pure
    with pytest.raises(ValueError, match="num_examples"):
        ev.audit_lower_bound(100, 80, delta=1e-5)


def test_audit_p_value_at_bound_is_beta():
    eps = ev.audit_lower_bound(60, 50, confidence=0.9)
    assert ev.audit_p_value(60, 60, 50, eps) == pytest.approx(0.1, abs=1e-5)
    # delta term: 2 m delta max_i P[v-i <= B < v]/i, by direct summation.
    m, r, v, e, d = 200, 40, 30, 1.0, 1e-4
    q = math.exp(e) / (1 + math.exp(e))
    pmf = scipy.stats.binom(r, q).pmf
    alpha = max(sum(pmf(v - j) for j in range(1, i + 1)) / i for i in range(1, v + 1))
    expected = scipy.stats.binom(r, q).sf(v - 1) + 2 * m * d * alpha
    assert ev.audit_p_value(m, r, v, e, d) == pytest.approx(expected, rel=1e-10)


def test_audit_is_valid_for_randomized_response():
    # An eps-DP mechanism (randomized response on membership): the 95% lower bound
    # exceeds eps in at most 5% of runs (binomial slack: <= 10 of 100), and it has
    # power (median bound well above 0).
    eps = 1.0
    rng = np.random.default_rng(0)
    bounds = []
    for _ in range(100):
        mask = rng.random(1000) < 0.5
        keep = rng.random(1000) < math.exp(eps) / (1 + math.exp(eps))
        scores = np.where(mask == keep, 1.0, -1.0) + 1e-3 * rng.random(1000)
        bounds.append(ev.one_run_audit(scores, mask, k_plus=100).epsilon_lower_bound)
    bounds = np.array(bounds)
    assert np.sum(bounds > eps) <= 10
    assert np.median(bounds) > 0.5


def test_one_run_audit_counts_guesses():
    mask = np.array([True, False] * 10)
    perfect = ev.one_run_audit(mask.astype(float), mask, k_plus=5, k_minus=5)
    assert perfect.num_guesses == 10 and perfect.num_correct == 10
    assert perfect.num_included == 10 and perfect.num_canaries == 20
    assert perfect.epsilon_lower_bound == pytest.approx(
        ev.audit_lower_bound(10, 10), abs=1e-9)
    inverted = ev.one_run_audit(-mask.astype(float), mask, k_plus=5, k_minus=5)
    assert inverted.num_correct == 0 and inverted.epsilon_lower_bound == 0.0
    with pytest.raises(ValueError, match="k_plus"):
        ev.one_run_audit(np.zeros(4), np.zeros(4, bool), k_plus=3)


# --------------------------------------------------------------------------------------
# Scoring and extraction with a (random) tiny KerasHub GPT-2
# --------------------------------------------------------------------------------------

LINES = ["To be, or not to be, that is the question:",
         "Whether 'tis nobler in the mind to suffer", "short"]


@pytest.fixture(scope="module")
def random_lm():
    from keras_dp_lm import testing

    return testing.tiny_gpt2_causal_lm(texts=[testing.DEFAULT_TEXT], vocabulary_size=300,
                                       sequence_length=16, seed=3)


def test_sequence_log_likelihood_matches_keras_loss(random_lm):
    import keras

    ll, counts = ev.sequence_log_likelihood(random_lm, LINES, return_token_counts=True)
    one_by_one = np.concatenate([ev.sequence_log_likelihood(random_lm, [t]) for t in LINES])
    np.testing.assert_allclose(ll, one_by_one, rtol=1e-5)
    x, y, sw = random_lm.preprocessor(LINES)
    per_token = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)(y, random_lm(x))
    expected = -np.sum(np.asarray(per_token) * np.asarray(sw), axis=1)
    np.testing.assert_allclose(ll, expected, rtol=1e-5)
    np.testing.assert_array_equal(counts, np.asarray(sw).sum(axis=1))
    assert counts[2] < counts[0] <= 16  # "short" has few tokens; long lines truncated
    # Truncation to a shorter sequence_length scores fewer tokens.
    _, short = ev.sequence_log_likelihood(random_lm, LINES, sequence_length=4,
                                          return_token_counts=True)
    assert short.max() <= 4


def test_extraction_greedy_matches_keras_hub_greedy_generate(random_lm):
    res = ev.extraction_test(random_lm, LINES, prefix_tokens=4, suffix_tokens=5)
    assert res.num_examples == 2  # "short" has fewer than 9 tokens
    random_lm.compile(sampler="greedy")
    tokenizer = random_lm.preprocessor.tokenizer
    for example, line in zip(res.examples, LINES):
        ids = np.asarray(tokenizer(line))[:4]
        prompt = tokenizer.detokenize(ids)
        assert example["prefix"] == prompt
        generated = random_lm.generate(prompt, max_length=1 + 4 + 5)  # start token + 9
        assert generated == prompt + example["generated_suffix"]
    # Token accuracy is the fraction of matching positions, recomputed from the texts.
    matches = []
    for example in res.examples:
        true = np.asarray(tokenizer(example["true_suffix"]))
        got = np.asarray(tokenizer(example["generated_suffix"]))
        if len(true) == len(got) == 5:
            matches.append(true == got)
    if len(matches) == res.num_examples:  # detokenize/tokenize round-tripped exactly
        assert res.token_accuracy == pytest.approx(float(np.mean(matches)))
        assert res.exact_match_rate == pytest.approx(float(np.mean([m.all() for m in matches])))
    assert res.exact_match_rate in (0.0, 0.5, 1.0)


# --------------------------------------------------------------------------------------
# End to end: a tiny GPT-2 trained with and without DP on data carrying canaries
# --------------------------------------------------------------------------------------

TARGET_EPSILON, DELTA, BATCH, STEPS = 1.0, 1e-5, 32, 200


@pytest.fixture(scope="module")
def trained_pair():
    """Non-private and DP runs (same data, steps, batches, init) of a tiny GPT-2.

    Data: 100 Shakespeare lines, one exposure canary ("my ssn is DDD") repeated 16
    times, and 100 audit canaries ("the code of DDDDDD is secret") each included once
    with probability 1/2 (once, so that the audit tests the per-record guarantee the
    accountant states; repeated canaries would test group privacy). About 40 epochs.
    """
    import keras
    import tensorflow as tf

    import keras_dp_lm as kdp
    from keras_dp_lm import accounting, testing

    texts = testing.default_texts(60_000)
    lines = [s.strip() for s in "\n".join(texts).split("\n") if len(s.strip()) > 15][:100]
    canary = ev.make_canaries(1, format="my ssn is {digits}", num_digits=3, seed=1)[0]
    audit = ev.make_canaries(100, format="the code of {digits} is secret",
                             num_digits=6, seed=2)
    included = np.random.default_rng(3).random(100) < 0.5
    data = ev.insert_canaries(lines, [canary] + audit,
                              [16] + [1 if inc else 0 for inc in included], seed=4)
    sampling_rate = BATCH / len(data)
    sigma = accounting.calibrate_noise_multiplier(TARGET_EPSILON, DELTA, sampling_rate,
                                                  STEPS)

    def run(optimizer, callbacks=()):
        lm = testing.tiny_gpt2_causal_lm(texts=lines, vocabulary_size=400,
                                         sequence_length=24, hidden_dim=64,
                                         num_heads=2, intermediate_dim=128, seed=0)
        lm.compile(optimizer=optimizer, weighted_metrics=[])
        ds = (tf.data.Dataset.from_tensor_slices(data).shuffle(len(data), seed=0)
              .repeat().batch(BATCH, drop_remainder=True))
        lm.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=list(callbacks))
        return lm

    plain = run(keras.optimizers.Adam(3e-3))
    accountant = kdp.PrivacyAccountant(
        delta=DELTA, dataset_size=len(data), batch_size=BATCH, sampling="shuffle",
        verbose=0)
    private = run(kdp.DPAdam(learning_rate=3e-3, l2_norm_clip=1.0, noise_multiplier=sigma,
                             seed=0), [accountant])
    report = accountant.report()
    assert report["dp_updates"] == STEPS
    epsilon = report["epsilon"]  # from the optimizer's ledger (PLD)
    return dict(plain=plain, private=private, canary=canary, audit=audit,
                included=included, epsilon=epsilon, lines=lines)


@pytest.mark.slow
def test_canary_exposure_high_without_dp_and_near_chance_with_dp(trained_pair):
    canary = trained_pair["canary"]
    plain = ev.exposure(trained_pair["plain"], canary, batch_size=500)
    private = ev.exposure(trained_pair["private"], canary, batch_size=500)
    assert plain.method == private.method == "rank" and plain.space_size == 1000
    print(f"exposure (rank): non-private {plain.exposure:.2f}, DP {private.exposure:.2f}")
    # Max is log2(1000) = 9.97 bits. A random rank exceeds k bits with prob 2^-k.
    assert plain.exposure >= 8.0
    assert private.exposure <= 4.0
    # The extrapolated estimate agrees in kind.
    plain_x = ev.exposure(trained_pair["plain"], canary, method="extrapolate",
                          num_samples=300, batch_size=300)
    private_x = ev.exposure(trained_pair["private"], canary, method="extrapolate",
                            num_samples=300, batch_size=300)
    print(f"exposure (extrapolated): non-private {plain_x.exposure:.2f}, "
          f"DP {private_x.exposure:.2f}")
    assert plain_x.exposure >= 8.0 and private_x.exposure <= 4.0


@pytest.mark.slow
def test_extraction_of_canary_digits(trained_pair):
    canary = trained_pair["canary"]
    tokenizer = trained_pair["plain"].preprocessor.tokenizer
    full = list(np.asarray(tokenizer(canary.text)))
    prefix = list(np.asarray(tokenizer("my ssn is")))
    assert full[:len(prefix)] == prefix
    suffix = len(full) - len(prefix)
    plain = ev.extraction_test(trained_pair["plain"], [canary.text], len(prefix), suffix)
    private = ev.extraction_test(trained_pair["private"], [canary.text], len(prefix),
                                 suffix)
    assert plain.num_examples == private.num_examples == 1
    assert plain.exact_match_rate == 1.0
    assert plain.examples[0]["generated_suffix"] == plain.examples[0]["true_suffix"]
    assert private.exact_match_rate == 0.0
    # Ordinary training lines: token accuracies are fractions, non-private higher.
    lines_plain = ev.extraction_test(trained_pair["plain"], trained_pair["lines"], 4, 4)
    lines_private = ev.extraction_test(trained_pair["private"], trained_pair["lines"], 4, 4)
    assert lines_plain.num_examples > 50
    print(f"extraction: canary exact match non-private {plain.exact_match_rate}, DP "
          f"{private.exact_match_rate}; lines token accuracy non-private "
          f"{lines_plain.token_accuracy:.3f}, DP {lines_private.token_accuracy:.3f}")
    assert 0.0 <= lines_private.token_accuracy < lines_plain.token_accuracy <= 1.0


@pytest.mark.slow
def test_one_run_audit_below_dp_epsilon_and_above_it_without_dp(trained_pair):
    eps = trained_pair["epsilon"]
    assert eps <= TARGET_EPSILON
    results = {}
    for name in ("plain", "private"):
        scores = ev.membership_scores(trained_pair[name], trained_pair["audit"])
        results[name] = ev.one_run_audit(scores, trained_pair["included"], k_plus=20,
                                         k_minus=20, confidence=0.95)
    print(f"accountant epsilon {eps:.3f}; audit: " + "; ".join(
        f"{k} {r.num_correct}/{r.num_guesses} correct, bound {r.epsilon_lower_bound:.3f}"
        for k, r in results.items()))
    assert results["private"].epsilon_lower_bound < eps
    assert results["plain"].epsilon_lower_bound > eps
    assert results["plain"].num_correct > results["private"].num_correct
    # The delta-adjusted bound for the DP claim is below the pure-eps one.
    scores = ev.membership_scores(trained_pair["plain"], trained_pair["audit"])
    adjusted = ev.one_run_audit(scores, trained_pair["included"], k_plus=20, delta=DELTA)
    assert adjusted.epsilon_lower_bound <= results["plain"].epsilon_lower_bound
