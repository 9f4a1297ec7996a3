"""public_mixture_perplexity (issue 17, item 4): held-out perplexity of the distribution
PublicMixtureSampler draws from, against an independent NumPy reference."""

import math

import numpy as np
import pytest

from keras_dp_lm import testing
from keras_dp_lm.samplers import PublicMixtureSampler, mixture_perplexity, renyi
from keras_dp_lm.samplers.perplexity import public_mixture_perplexity

TEXT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def models():
    def tiny(seed):
        return testing.tiny_gpt2_causal_lm([testing.DEFAULT_TEXT], vocabulary_size=270,
                                           seed=seed)

    return tiny(0), [tiny(1), tiny(2)]


def _reference(public, privates, text, alpha, beta, floor, packing="preprocessor"):
    """exp(mean -log q(target)) with q rebuilt in NumPy from the module's definition:
    integer weights, then the float64 reference projection renyi.project_to_ball."""
    if packing == "preprocessor":   # start token as context, end token predicted
        x, y, sw = public.preprocessor([text])
        x = {k: np.asarray(v) for k, v in x.items()}
        real = np.asarray(sw)[0] > 0
        targets = np.asarray(y)[0][real]
    else:                           # the raw tokens, the first one as context
        ids = np.asarray(public.preprocessor.tokenizer(text)).astype("int32").ravel()
        x = {"token_ids": ids[None], "padding_mask": np.ones((1, len(ids)), bool)}
        real = np.r_[np.ones(len(ids) - 1, bool), False]
        targets = ids[1:]

    def softmax(lm):
        z = np.asarray(lm(x, training=False), "float64")[0][real]
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    v = public.backbone.vocabulary_size
    w0 = np.floor(softmax(public) * ((1 - floor) * 2.0 ** 32)) + max(
        1, math.floor(floor * 2.0 ** 32 / v))
    p0 = w0 / w0.sum(-1, keepdims=True)
    q = np.zeros_like(p0)
    lams = []
    for lm in privates:
        w = np.floor(softmax(lm) * 2.0 ** 32)
        lam, p_hat = renyi.project_to_ball(w / w.sum(-1, keepdims=True), p0, beta, alpha)
        q += p_hat / len(privates)
        lams.append(lam)
    log_q = np.log(q[np.arange(len(targets)), targets])
    return math.exp(-log_q.mean()), float(np.mean(lams))


@pytest.mark.parametrize("packing", ["preprocessor", "windows"])
def test_matches_numpy_reference_of_the_sampler_distribution(models, packing):
    public, privates = models
    balls = [(3.0, 0.05), (8.0, 0.5), (16.0, 0.002)]
    ppl, lam = public_mixture_perplexity(public, privates, TEXT, balls, packing=packing,
                                         return_mean_lambda=True)
    assert list(ppl) == balls
    for alpha, beta in balls:
        expected, expected_lam = _reference(public, privates, TEXT, alpha, beta, 1e-3,
                                            packing)
        assert ppl[(alpha, beta)] == pytest.approx(expected, rel=1e-9)
        assert lam[(alpha, beta)] == pytest.approx(expected_lam, abs=1e-9)
        assert 0.0 < lam[(alpha, beta)] <= 1.0


def test_one_step_is_the_samplers_mixture_probabilities(models):
    """The scorer's q(target) is PublicMixtureSampler.mixture_probabilities, row by row."""
    public, privates = models
    ids = np.asarray(public.preprocessor.tokenizer(TEXT)).astype("int32").ravel()
    x = {"token_ids": ids[None], "padding_mask": np.ones((1, len(ids)), bool)}
    z0 = np.asarray(public(x), "float32")[0, :-1]
    z = np.stack([np.asarray(m(x), "float32")[0, :-1] for m in privates])
    sampler = PublicMixtureSampler(privates, beta=0.05, alpha=3.0, public_model=public)
    q = np.asarray(sampler.mixture_probabilities(z0, z))
    expected = math.exp(-np.log(q[np.arange(len(ids) - 1), ids[1:]]).mean())
    got = public_mixture_perplexity(public, privates, TEXT, [(3.0, 0.05)],
                                    packing="windows")[(3.0, 0.05)]
    assert got == pytest.approx(expected, rel=1e-12)


def test_limits_public_alone_and_private_average(models):
    public, privates = models
    # beta below the ball's safety margin: lam = 0, the (floored) public model itself.
    tiny_ball, huge_ball = (8.0, 1e-13), (8.0, 1e3)
    texts = [TEXT, TEXT[:20], "x" * 200]       # the last one is truncated by the packing
    ppl, lam = public_mixture_perplexity(public, privates[:1], texts,
                                         [tiny_ball, huge_ball], public_floor=0.0,
                                         batch_size=2, return_mean_lambda=True)
    assert lam[tiny_ball] == 0.0 and lam[huge_ball] == 1.0
    alone = {lm: mixture_perplexity(lm, texts, [1.0], packing="preprocessor")[1.0]
             for lm in (public, privates[0])}
    assert ppl[tiny_ball] == pytest.approx(alone[public], rel=1e-6)
    assert ppl[huge_ball] == pytest.approx(alone[privates[0]], rel=1e-6)


def test_bad_arguments_raise(models):
    public, privates = models
    with pytest.raises(ValueError, match="list of causal LMs"):
        public_mixture_perplexity(public, privates[0], TEXT, [(8.0, 0.1)])
    with pytest.raises(ValueError, match="at least one"):
        public_mixture_perplexity(public, privates, TEXT, [])
    with pytest.raises(ValueError, match="beta"):
        public_mixture_perplexity(public, privates, TEXT, [(8.0, -1.0)])
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        public_mixture_perplexity(public, privates, "", [(8.0, 0.1)], packing="windows")
    with pytest.raises(ValueError, match="packing"):
        public_mixture_perplexity(public, privates, TEXT, [(8.0, 0.1)], packing="pack")
    with pytest.raises(ValueError, match="max_tokens"):
        public_mixture_perplexity(public, privates, TEXT, [(8.0, 0.1)], max_tokens=5)


def test_preprocessor_packing_matches_sequence_log_likelihood(models):
    """packing='preprocessor' scores the tokens the demo's held-out perplexity scores."""
    from keras_dp_lm import evaluation

    public = models[0]
    texts = [TEXT, "Shall I compare thee"]
    ll, counts = evaluation.sequence_log_likelihood(public, texts, return_token_counts=True)
    expected = math.exp(-ll.sum() / counts.sum())
    got = mixture_perplexity(public, texts, [1.0], packing="preprocessor")[1.0]
    assert got == pytest.approx(expected, rel=1e-5)
