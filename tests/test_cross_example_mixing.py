"""Models and losses that mix examples are refused before any update under fast
clipping (the independence probe), and train under exact clipping, which
differentiates each example alone.

Each model here trained silently before its fix, and one example moved the
clipped sum by several clip norms C: the comments give the numbers.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp
from keras_dp_lm.training.refusals import probe_state
from privacy_helpers import UnseededNoise as _UnseededNoise
from privacy_helpers import trainable_weights as _weights


# -- layers and losses that mix examples, each in its own way ------------------
class _InBatchContrastive(keras.losses.Loss):
    """Per example [B], but each example's value depends on every other example."""

    def call(self, y_true, y_pred):
        logits = keras.ops.matmul(y_pred, keras.ops.transpose(y_pred))
        return -keras.ops.diagonal(keras.ops.log_softmax(logits, axis=-1))


def _batch_mean_model():
    inputs = keras.Input((4,))
    centred = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(centred))


class _TrainingBatchCentre(keras.layers.Layer):
    """Subtracts the batch mean in training only (batch norm without its state)."""

    def call(self, x, training=False):
        if training:
            return x - keras.ops.mean(x, axis=0, keepdims=True)
        return x



class _StraightThroughBatchMean(keras.layers.Layer):
    """Forward: the identity. Backward: every row also gets the batch's mean
    gradient (a straight-through estimator over a batch statistic)."""

    def call(self, x):
        m = keras.ops.mean(x, axis=0, keepdims=True)
        return x + (m - keras.ops.stop_gradient(m))


class _StraightThroughBatchMeanInTraining(_StraightThroughBatchMean):
    def call(self, x, training=False):
        return super().call(x) if training else x


class _BatchRmsGradient(keras.layers.Layer):
    """Forward: the identity. Backward: the upstream gradient divided by its RMS
    over the whole batch (a custom gradient normalised over the batch)."""

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            def grad(upstream):
                return upstream / (tf.sqrt(tf.reduce_mean(tf.square(upstream))) + 1e-12)
            return tf.identity(t), grad
        return identity(x)


class _BatchRmsGradientWithoutEpsilon(keras.layers.Layer):
    """Training only: the upstream gradient over its batch RMS, NaN when it is zero."""

    def call(self, x, training=False):
        if not training:
            return x

        @tf.custom_gradient
        def identity(t):
            def grad(upstream):
                return upstream / tf.sqrt(tf.reduce_mean(tf.square(upstream)))
            return tf.identity(t), grad
        return identity(x)


class _SharedRowStraightThrough(keras.layers.Layer):
    """A learned vector added to every row through a straight-through batch
    mean: each example's total gradient is its own, but the row it reaches
    is the batch's mean (fast clipping reads rows)."""

    def build(self, input_shape):
        self.shared = keras.layers.Embedding(1, input_shape[-1])
        self.shared.build((None,))

    def call(self, x):
        shared = self.shared(keras.ops.zeros(keras.ops.shape(x)[:1], "int32"))
        mean = keras.ops.mean(shared, axis=0, keepdims=True)
        return x + shared + (mean - keras.ops.stop_gradient(mean))


class _RotateRowsByOthers(keras.layers.Layer):
    """Forward: the identity on 2 features. Backward: rows >= 1 get their
    upstream gradient rotated by an angle set by rows >= 2 (norms kept, row 0
    untouched: only example 1's gradient vector shows it)."""

    def call(self, z):
        @tf.custom_gradient
        def identity(t):
            def grad(upstream):
                rows = tf.range(tf.shape(upstream)[0])
                s = tf.where(rows >= 2, upstream[:, 0], 0.0)
                theta = tf.where(rows >= 1, 50.0 * (tf.reduce_sum(s) - s), 0.0)
                c, n = tf.cos(theta), tf.sin(theta)
                return tf.stack([c * upstream[:, 0] - n * upstream[:, 1],
                                 n * upstream[:, 0] + c * upstream[:, 1]], axis=1)
            return tf.identity(t), grad
        return identity(z)


class _PairReflection(keras.layers.Layer):
    """Forward: the identity on 2 features. Backward: in each pair of rows
    (0, 1), (2, 3), ... the upstream gradients are reflected about their sum's
    direction: each pair's sum and each row's norm are kept."""

    def call(self, z):
        @tf.custom_gradient
        def identity(t):
            def grad(upstream):
                n = tf.shape(upstream)[0]
                pairs = tf.reshape(tf.pad(upstream, [[0, n % 2], [0, 0]]), [-1, 2, 2])
                total = tf.reduce_sum(pairs, axis=1, keepdims=True)
                unit = total / (tf.norm(total, axis=-1, keepdims=True) + 1e-30)
                along = tf.reduce_sum(pairs * unit, axis=-1, keepdims=True) * unit
                return tf.reshape(2.0 * along - pairs, [-1, 2])[:n]
            return tf.identity(t), grad
        return identity(z)


class _SharedRow(keras.layers.Layer):
    """A learned 2-vector, the same for every row (an Embedding at index 0)."""

    def build(self, input_shape):
        self.shared = keras.layers.Embedding(1, 2)
        self.shared.build((None,))

    def call(self, x):
        return self.shared(keras.ops.zeros(keras.ops.shape(x)[:1], "int32"))


class _BatchMaxScale(keras.layers.Layer):
    """Scales by the batch's largest activation (max-abs / fake-quantisation range)."""

    def call(self, x):
        return x / keras.ops.max(keras.ops.abs(x))


class _TrainingMeanIntoRowZero(keras.layers.Layer):
    """Training only: adds the batch mean to row 0 (a summary slot)."""

    def call(self, x, training=False):
        if not training:
            return x
        first = keras.ops.cast(keras.ops.arange(keras.ops.shape(x)[0]) == 0, x.dtype)
        return x + 5.0 * first[:, None] * keras.ops.mean(x, axis=0, keepdims=True)


def _between_dense(layer):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), layer,
                             keras.layers.Dense(3)])


def _training_mixing_model(dropout=0.0, unseeded_noise=False):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                             keras.layers.Dropout(dropout), _TrainingBatchCentre(),
                             *([_UnseededNoise()] if unseeded_noise else []),
                             keras.layers.Dense(3)])


def _assert_mixing_refused_before_any_update(model, x, y):
    """``fit`` (probe before the step) and a custom-loop step (probe inside it)."""
    before = _weights(model)
    with pytest.raises(ValueError, match="mixes examples"):
        model.fit(x, y, batch_size=len(x), verbose=0)
    with pytest.raises(kdp.PrivacyRefusalError, match="mixes examples"):
        kdp.make_private(model)((x, y))
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))



@pytest.mark.parametrize("case,jit", [("batch_mean_layer", False),
                                      ("in_batch_contrastive_loss", False),
                                      ("batch_mean_layer", True),
                                      ("training_only_mixing_with_dropout", False),
                                      ("training_only_mixing_with_unseeded_noise", False),
                                      ("straight_through_batch_mean", False),
                                      ("straight_through_batch_mean_in_training", False),
                                      ("custom_gradient_over_the_batch", False),
                                      ("custom_gradient_nan_on_the_probe", False),
                                      ("straight_through_on_a_shared_row", False),
                                      ("row_1_gradient_rotated_by_other_rows", False),
                                      ("pair_reflection_on_a_shared_row", False),
                                      ("batch_maximum_in_a_row_not_swapped", False),
                                      ("training_only_mixing_into_row_0", False)])
def test_mixing_examples_is_refused_before_any_update_with_fast_clipping(case, jit):
    """Before: trained silently; one example moved the clipped sum by up to 5.3 C.

    ``fit`` probes in a call of its own before the first step (ValueError).
    A custom-loop step probes inside the step; under ``jit_compile=True``
    only the clipping core is one XLA program, so the probe's assertion runs
    outside it and raises there too (XLA drops assertions)."""
    from keras_dp_lm.training import step

    keras.utils.set_random_seed(0)
    if case == "batch_mean_layer":
        model, loss = _batch_mean_model(), "mse"
    elif case == "training_only_mixing_with_dropout":
        # Before: the probe ran in inference mode only, so a layer that
        # mixes examples only when training trained (one user moved the sum by
        # 5.86 C). Its training passes replay dropout's masks.
        model, loss = _training_mixing_model(dropout=0.3), "mse"
    elif case == "training_only_mixing_with_unseeded_noise":
        # Before: tf.random noise made the probe's two identical
        # training passes differ, and it then passed untold (trained).
        model, loss = _training_mixing_model(unseeded_noise=True), "mse"
    elif case == "straight_through_batch_mean":
        # Before: mixing only in the backward pass left every loss as it
        # was, the probe passed and one example moved the sum by 9.6 C.
        model, loss = _between_dense(_StraightThroughBatchMean()), "mse"
    elif case == "straight_through_batch_mean_in_training":
        # ... and with the gradient checks in inference mode only, 9.1 C.
        model, loss = _between_dense(_StraightThroughBatchMeanInTraining()), "mse"
    elif case == "custom_gradient_over_the_batch":
        model, loss = _between_dense(_BatchRmsGradient()), "mse"  # 6.7 C
    elif case == "custom_gradient_nan_on_the_probe":
        # Before: NaN in one probe pass switched off the gradient checks;
        # the probe then told nothing on every batch and the model trained (6.6 C).
        model, loss = _between_dense(_BatchRmsGradientWithoutEpsilon()), "mse"
    elif case == "straight_through_on_a_shared_row":
        # Before: every gradient check passed (each example's total
        # gradient is its own) and one example moved the sum by 9.0 C. The
        # probe now compares fast clipping's own reading of examples 0 and 1
        # with their true gradients.
        model, loss = _between_dense(_SharedRowStraightThrough()), "mse"
    elif case == "row_1_gradient_rotated_by_other_rows":
        # Before: the engine check compared example 1 by its norm only
        # (3.4 C); it now compares the engine's sum of examples 0 and 1.
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2),
                                  _RotateRowsByOthers(), keras.layers.Activation("tanh"),
                                  keras.layers.Dense(3)])
        loss = "mse"
    elif case == "pair_reflection_on_a_shared_row":
        # Before: the sum of examples 0 and 1 and their norms are kept, so the
        # engine check's unclipped sum saw nothing (1.49 C); the check now
        # clips them with different factors, as the step does.
        inputs = keras.Input((4,))
        mixed = keras.layers.Add()([keras.layers.Dense(2)(inputs),
                                    _PairReflection()(_SharedRow()(inputs))])
        model = keras.Model(inputs, keras.layers.Dense(3)(
            keras.layers.Activation("tanh")(mixed)))
        loss = "mse"
    elif case == "batch_maximum_in_a_row_not_swapped":
        # The probe replaced row 0 only: a batch maximum held by another row
        # passed 7 times in 8 (3.8 C).
        model, loss = _between_dense(_BatchMaxScale()), "mse"
    elif case == "training_only_mixing_into_row_0":
        # The training half compared rows 1.. only (5.8 C).
        model, loss = _between_dense(_TrainingMeanIntoRowZero()), "mse"
    else:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        loss = _InBatchContrastive()
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.1, noise_multiplier=1.0), loss=loss,
                  jit_compile=jit)
    x = np.random.default_rng(1).normal(size=(6, 4)).astype("float32")
    x[3] *= 10.0  # the batch maximum is in row 3, neither of the rows the probe swaps
    y = np.zeros((6, 3), "float32")
    _assert_mixing_refused_before_any_update(model, x, y)
    assert kdp.ledger_of(model).updates == 0
    assert model.jit_compile is jit and step.has_xla_core(model) is jit
    # the exact engine differentiates each example alone: trainable, and bounded
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.1, noise_multiplier=1.0,
                                      clipping="exact"), loss=loss)
    model.fit(x, y, batch_size=6, verbose=0)
    assert kdp.ledger_of(model).updates == 1



# -- batches the probe must not pass: first batches, recompiles, batch sizes ---
def test_a_first_batch_of_one_example_leaves_the_probe_to_the_next_batch():
    """One example cannot show mixing: the step keeps its in-graph probe and the
    next batch is probed (and refused) before its update."""
    keras.utils.set_random_seed(0)
    model = _batch_mean_model()
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.1, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(1).normal(size=(7, 4)).astype("float32")
    y = np.zeros((7, 3), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.take(1).batch(1).concatenate(ds.skip(1).batch(6))
    with pytest.raises(ValueError, match="mixes examples"):
        model.fit(ds, verbose=0)
    ledger = kdp.ledger_of(model)
    assert ledger.updates == 1 and not probe_state(model).probed_before_step


@pytest.mark.parametrize("first_batch", ["distinct", "identical"])
def test_a_recompile_with_a_loss_that_mixes_examples_is_probed_again(first_batch):
    """Before: the probe's pass survived ``compile``, so a model that had
    trained with MSE and was recompiled with an in-batch contrastive loss
    trained on it unprobed (fast clipping cannot bound that loss). And a
    probe that passed without telling (identical examples) stayed
    traced with the old loss, and passed the contrastive loss after a recompile."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.1, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(1).normal(size=(6, 4)).astype("float32")
    y = np.zeros((6, 3), "float32")
    first = x if first_batch == "distinct" else np.repeat(x[:1], 6, axis=0)
    model.fit(first, y, batch_size=6, verbose=0)
    # identical examples cannot show mixing: the probe passed without telling
    assert probe_state(model).probed_before_step is (first_batch == "distinct")
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=0.1, noise_multiplier=1.0),
                  loss=_InBatchContrastive())
    _assert_mixing_refused_before_any_update(model, x, y)
    assert kdp.ledger_of(model).updates == 1



class _PairsRowsEightApart(keras.layers.Layer):
    """Adds row i + 8 (mod the batch) to row i: the identity pairing on 8 rows."""

    def call(self, x):
        return x + keras.ops.roll(x, 8, axis=0)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_probe_runs_the_model_at_the_batch_size_it_trains_at(accumulation):
    """Before: the probe ran the model on the first 8 rows, where this
    pairing is invisible, and a batch of 16 trained (2.6 C). It now runs at the
    micro-batch size the step uses (16 rows, or 8 with two accumulation steps,
    where the pairing is per example and trains)."""
    keras.utils.set_random_seed(0)
    model = _between_dense(_PairsRowsEightApart())
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                      gradient_accumulation_steps=accumulation),
                  loss="mse")
    x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    y = np.zeros((16, 3), "float32")
    if accumulation == 1:
        with pytest.raises(ValueError, match="mixes examples"):
            model.fit(x, y, batch_size=16, verbose=0)
        assert kdp.ledger_of(model).updates == 0
    else:  # rolling 8 rows by 8 is the identity: each example alone, bounded
        model.fit(x, y, batch_size=16, verbose=0)
        assert kdp.ledger_of(model).updates == 1


class _TrainingBatchCentreOverflowing(keras.layers.Layer):
    """Training only: subtracts the batch mean, non-finite when one row overflows."""

    def call(self, x, training=False):
        if training:
            return x - keras.ops.mean(x * 1e37, axis=0, keepdims=True) / 1e37
        return x


def test_a_training_pass_with_no_finite_row_does_not_count_as_probed():
    """Before: when every training-mode loss of the probe's batch was
    non-finite, the training half compared nothing and the probe counted as
    done; the next (finite) batches trained with training-only mixing (4.4 C).
    Examples 0 and 1, finite in inference, must now stay finite in training:
    the probe refuses the first batch, before any update."""
    keras.utils.set_random_seed(0)
    model = _between_dense(_TrainingBatchCentreOverflowing())
    model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(1).normal(size=(12, 4)).astype("float32")
    x[3] *= 1e3  # its activations overflow the training mean of the first batch
    y = np.zeros((12, 3), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    with pytest.raises(ValueError, match="mixes examples"):
        model.fit(ds, verbose=0)
    ledger = kdp.ledger_of(model)
    assert not probe_state(model).probed_before_step and ledger.updates == 0
