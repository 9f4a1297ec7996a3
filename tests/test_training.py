"""The DP step: per-example losses, exact clipping against a naive loop, accumulation."""

import numpy as np
import pytest
import tensorflow as tf
import keras
import keras_hub

import keras_dp_lm as kdp
from keras_dp_lm.training.losses import per_example_losses
from keras_dp_lm.training import dp_clipped_gradient
from reference import max_relative_error, naive_clipped_sum

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model, loss, clip=1.0, accumulation=1):
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=clip, noise_multiplier=0.0,
                                      gradient_accumulation_steps=accumulation,
                                      clipping="exact"),
                  loss=loss)
    return model


def _clipped(model, x, y, sw):
    @tf.function
    def run():
        return dp_clipped_gradient(model, (x, y, sw))
    result = run()
    grads, losses, norms = result.grads, result.losses, result.norms
    return [g.numpy() for g in grads], losses.numpy(), norms.numpy()


def _dense_model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def _embedding_model():
    return keras.Sequential([keras.Input((7,), dtype="int32"),
                             keras.layers.Embedding(20, 8),
                             keras.layers.GlobalAveragePooling1D(),
                             keras.layers.Dense(3)])


class _AttentionModel(keras.Model):  # subclassed model
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(30, 16)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.norm = keras.layers.LayerNormalization()
        self.out = keras.layers.EinsumDense("btd,dc->btc", output_shape=(None, 30))

    def call(self, tokens):
        h = self.embed(tokens)
        h = self.norm(h + self.attention(h, h))
        return self.out(h)


def _tiny_gpt2(num_layers=2):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=num_layers, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=12, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _padded_tokens(batch, length, vocab, rng):
    tokens = rng.integers(1, vocab, (batch, length)).astype("int32")
    lengths = rng.integers(3, length + 1, batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    return tokens * mask, mask


CASES = ["dense", "embedding", "attention", "gpt2"]


def _case(name, rng):
    if name == "dense":
        model = _dense_model()
        x = rng.normal(size=(6, 6)).astype("float32")
        y = rng.integers(0, 3, 6)
        sw = rng.uniform(0.5, 2.0, 6).astype("float32")
        return model, SCCE, x, y, sw, 0.5
    if name == "embedding":
        model = _embedding_model()
        x = rng.integers(0, 20, (6, 7)).astype("int32")
        return model, SCCE, x, rng.integers(0, 3, 6), None, 0.05
    if name == "attention":
        model = _AttentionModel()
        x = rng.integers(0, 30, (5, 6)).astype("int32")
        y = rng.integers(0, 30, (5, 6))
        sw = (rng.uniform(size=(5, 6)) > 0.3).astype("float32")
        return model, SCCE, x, y, sw, 0.3
    model = _tiny_gpt2()
    tokens, mask = _padded_tokens(5, 12, 50, rng)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return model, SCCE, x, tokens[:, 1:], mask[:, 1:].astype("float32"), 0.5


@pytest.mark.parametrize("name", CASES)
def test_exact_clipping_matches_naive_loop(name):
    rng = np.random.default_rng(0)
    model, loss, x, y, sw, clip = _case(name, rng)
    _compile(model, loss, clip=clip)
    model(x)
    expected, expected_norms, expected_losses = naive_clipped_sum(model, x, y, sw, clip)
    grads, losses, norms = _clipped(model, x, y, sw)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    assert (expected_norms > clip).any(), "the case must exercise clipping"
    assert max_relative_error(grads, expected) < 1e-5


def test_per_example_losses_are_batch_of_one_losses_with_mask_normalisation():
    """A batch-wide valid-token count would make one example's loss depend on others."""
    rng = np.random.default_rng(1)
    model = _AttentionModel()
    x = rng.integers(0, 30, (4, 6)).astype("int32")
    y = rng.integers(0, 30, (4, 6))
    sw = (rng.uniform(size=(4, 6)) > 0.5).astype("float32")
    for reduction in ["sum_over_batch_size", "sum", "mean_with_sample_weight"]:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        model.compile(loss=loss)
        pred = model(x)
        batched = per_example_losses(model, x, y, pred, sw).numpy()
        singles = [float(model.compute_loss(x=x[i:i + 1], y=y[i:i + 1], y_pred=pred[i:i + 1],
                                            sample_weight=sw[i:i + 1])) for i in range(4)]
        np.testing.assert_allclose(batched, singles, rtol=1e-6, err_msg=reduction)
        # Changing example 0's weights leaves example 1's loss untouched.
        sw2 = sw.copy()
        sw2[0] = 1.0
        other = per_example_losses(model, x, y, pred, sw2).numpy()
        np.testing.assert_allclose(other[1:], batched[1:], rtol=1e-7)


def test_weight_regularization_is_added_once_outside_clipping():
    """Regularisation depends on no example: update = noised mean + grad(R), as in Keras."""
    def model_with(reg):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
            2, kernel_regularizer=reg)])
        model.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=0.01, noise_multiplier=0.0),
                      loss="mse")
        return model

    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    y = np.zeros((4, 2), "float32")
    plain, regularised = model_with(None), model_with(keras.regularizers.L2(0.5))
    kernel = regularised.layers[0].kernel.numpy().copy()
    losses = per_example_losses(regularised, x, y, regularised(x)).numpy()
    np.testing.assert_allclose(losses, per_example_losses(plain, x, y, plain(x)).numpy())
    for model in (plain, regularised):
        model.fit(x, y, batch_size=4, verbose=0)
    difference = regularised.layers[0].kernel.numpy() - plain.layers[0].kernel.numpy()
    np.testing.assert_allclose(difference, -2 * 0.5 * kernel, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [4, 3])  # 3 does not divide 8: padded with inert slots
def test_accumulation_equals_one_big_batch_at_zero_noise(k):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.integers(0, 3, 8)
    results = []
    for k in (1, k):
        keras.utils.set_random_seed(7)
        model = _compile(_dense_model(), SCCE, clip=0.5, accumulation=k)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        results.append([w.numpy() for w in model.trainable_variables])
        assert int(model.optimizer.dp_updates.numpy()) == 1
        assert float(model.optimizer.dp_last_batch_size.numpy()) == 8.0
        assert kdp.ledger_of(model).rows() == [(0.0, 0.0, 8.0, 1)]
    assert max_relative_error(results[1], results[0]) < 1e-5


def test_last_batch_smaller_than_the_others_trains_with_accumulation():
    """10 examples in batches of 4 with k=2: the last batch (2) is processed,
    not refused after earlier updates were applied."""
    model = _compile(_dense_model(), SCCE, accumulation=2)
    model.fit(np.ones((10, 6), "float32"), np.zeros(10), batch_size=4, verbose=0)
    assert kdp.ledger_of(model).rows() == [(0.0, 0.0, 4.0, 3)]


def test_vectorized_exact_path_matches_loop_with_onednn_off(tmp_path):
    """The vectorized reference is used when oneDNN is off; it must agree exactly."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "vectorized.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, tensorflow as tf, keras, keras_hub
        from keras_dp_lm.clipping import exact_clipped_sum
        from keras_dp_lm.training.losses import per_example_losses
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=50, num_layers=1,
            num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=8, dropout=0.0)
        lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        tok = rng.integers(1, 50, (4, 8)).astype("int32")
        x = {"token_ids": tok[:, :-1], "padding_mask": np.ones((4, 7), bool)}
        data = (x, tok[:, 1:], np.ones((4, 7), "float32"))
        def loss_fn(part):
            px, py, psw = part
            return per_example_losses(lm, px, py, lm(px, training=True), psw)
        out = []
        for vectorize in (True, False):
            r = tf.function(lambda: exact_clipped_sum(loss_fn, data, lm.trainable_variables, 0.5,
                                                      vectorize=vectorize))()
            out.append([g.numpy() for g in r.grads])
        diff = sum(float(np.sum((a - b) ** 2)) for a, b in zip(*out))
        err = np.sqrt(diff / sum(float(np.sum(b ** 2)) for b in out[1]))
        print("ERR", err)
    """))
    env = dict(__import__("os").environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = float(proc.stdout.split("ERR")[1])
    assert err < 1e-5


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fast_and_exact_clipping_give_the_same_fit_update(accumulation):
    """The DP step with the default fast clipping equals the exact reference at sigma=0."""
    rng = np.random.default_rng(5)
    tokens, mask = _padded_tokens(4, 12, 50, rng)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    y, sw = tokens[:, 1:], mask[:, 1:].astype("float32")
    weights, accuracies = [], []
    for method in ("exact", "auto"):
        keras.utils.set_random_seed(11)
        # One transformer block holds every layer kind of two (embeddings, layer
        # norms, attention's EinsumDense, the MLP's Dense, the tied head); each
        # block a DP fit traces costs its first fit ~2.5 s (fast) / 1.5 s (exact).
        lm = _tiny_gpt2(num_layers=1)
        lm.compile(optimizer=kdp.DPSGD(1.0, l2_norm_clip=0.3, noise_multiplier=0.0,
                                       gradient_accumulation_steps=accumulation,
                                       clipping=method),
                   loss=SCCE, weighted_metrics=["sparse_categorical_accuracy"])
        history = lm.fit(x, y, sample_weight=sw, batch_size=4, verbose=0, shuffle=False)
        accuracies.append(history.history["sparse_categorical_accuracy"][0])
        weights.append([w.numpy() for w in lm.trainable_variables])
    assert max_relative_error(weights[1], weights[0]) < 1e-5
    # the fast path's reused forward pass gives the metrics the exact path gives
    assert accuracies[1] == pytest.approx(accuracies[0], abs=1e-6)


class HeadBuiltOnFirstCall(keras.Model):
    """A subclassed model whose head has no variables until it is first called."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("clipping,feed", [("fast", "arrays"), ("exact", "arrays"),
                                           ("fast", "poisson"), ("fast", "train_on_batch")])
def test_a_model_first_built_by_fit_trains(clipping, feed):
    """Review side finding: a subclassed model never called before ``fit`` (Keras
    builds it in the train function's first trace) crashed: the independence
    probe created the head's variables in its own trace (IndexError), and exact
    clipping met variables its optimizer did not know. The DP model is now built
    from the dataset's element spec before the probe and the step, drawing no
    batch: the Poisson batches trained are those drawn without the build."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 2, 32)

    def compiled(model):
        model.compile(optimizer=kdp.DPSGD(0.05, l2_norm_clip=1.0, noise_multiplier=0.0,
                                          clipping=clipping, expected_batch_size=8),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def poisson():
        return kdp.data.poisson_batches((x, y), 0.25, 32, seed=3, num_steps=3)

    keras.utils.set_random_seed(0)
    model = compiled(HeadBuiltOnFirstCall())
    if feed == "arrays":
        model.fit(x, y, batch_size=16, verbose=0)
        updates = 2
    elif feed == "train_on_batch":
        model.train_on_batch(x[:16], y[:16])
        updates = 1
    else:
        model.fit(poisson(), verbose=0)
        updates = 3
        # it trained on the draws a model built before fit trains on: none consumed
        keras.utils.set_random_seed(0)
        built = HeadBuiltOnFirstCall()
        built(x[:1])
        compiled(built).fit(poisson(), verbose=0)
        for a, b in zip(model.get_weights(), built.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(model.trainable_variables) == 4
    assert kdp.ledger_of(model).updates == updates


def test_the_dp_step_is_not_converted_by_autograph(monkeypatch):
    """Keras traces its train function with autograph on, which converts every
    function a converted one calls outside Keras and TensorFlow: converting
    keras_dp_lm's own source (ghost norms, refusals, rounding) took a third of a
    1-layer GPT-2's first DP fit (38.5 s, 24.9 s without). The step (fast and exact clipping, the
    independence probe, accumulation, make_private) runs unconverted, as
    Keras's own train_step does."""
    from tensorflow.python.autograph.impl import api as autograph_api  # test only

    converted = []
    convert = autograph_api._convert_actual

    def recording(entity, program_ctx):
        converted.append(f"{getattr(entity, '__module__', '?')}:"
                         f"{getattr(entity, '__qualname__', '?')}")
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", recording)
    rng = np.random.default_rng(0)
    tokens, mask = _padded_tokens(8, 12, 50, rng)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    y, sw = tokens[:, 1:], mask[:, 1:].astype("float32")
    for clipping in ("fast", "exact"):
        lm = _tiny_gpt2(num_layers=1)  # the functions a DP step calls, not their count
        lm.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                       gradient_accumulation_steps=2, clipping=clipping),
                   loss=SCCE)
        lm.fit(x, y, sample_weight=sw, batch_size=4, verbose=0)  # 2 micro-batches of 2
        assert kdp.ledger_of(lm).updates == 2
    step = kdp.make_private(_compile(_dense_model(), SCCE))
    step((rng.normal(size=(4, 6)).astype("float32"), np.array([0, 1, 2, 0])))
    # The preprocessing wrapper runs in tf.data's map, where autograph converts
    # KerasHub's preprocessing as it would without keras_dp_lm: left as it is.
    ours = [name for name in converted
            if name.startswith(("keras_dp_lm.training", "keras_dp_lm.clipping"))
            and "_keep_real_slots_through" not in name]
    assert not ours, ours


def test_a_dp_model_no_longer_used_is_garbage_collected():
    """Before: the step cached the probe and the XLA core in module-level weak-key
    dictionaries whose values (traced functions) referenced the model, so a model
    whose probe could not tell (an all-padding first batch) or that compiled with
    XLA stayed alive for the whole process, with every graph it traced (in the
    test suite, ~70 models and millions of Python objects by the end of one file)."""
    import gc
    import weakref

    from keras_dp_lm import data as sampling

    def trained():
        model = _dense_model()
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                          expected_batch_size=4.0),
                      loss=SCCE, jit_compile=True)
        x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
        y = np.array([0, 1, 2, 0])
        padding = sampling.attach_real_slots(None, np.zeros(4, "float32"))
        model.fit(tf.data.Dataset.from_tensors((x, y, padding)), verbose=0)  # untold
        assert kdp.ledger_of(model).updates == 1
        return weakref.ref(model)

    ref = trained()
    keras.backend.clear_session(free_memory=True)
    gc.collect()
    assert ref() is None
