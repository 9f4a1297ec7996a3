"""Dtypes and configurations that crashed or trained wrongly: they now work
(exact clipping with oneDNN off, float32 noise on bfloat16 variables) or are
refused with the reason (mixed_float16 loss scaling).
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_dp_lm as kdp
from privacy_helpers import SCCE


# -- crashes that must be clear errors or work ---------------------------------
def test_exact_clipping_without_sample_weight_with_onednn_off(tmp_path):
    """Before: clipping='exact' with oneDNN off and no sample_weight crashed."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, keras, keras_dp_lm as kdp
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                          clipping="exact"),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(np.ones((8, 4), "float32"), np.zeros(8), batch_size=8, verbose=0)
        print("updates", kdp.ledger_of(model).updates)
    """))
    env = dict(__import__("os").environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "updates 1" in out.stdout


def test_mixed_float16_loss_scaling_is_refused_with_the_reason():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        with pytest.raises(ValueError, match="mixed_bfloat16"):
            model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                          loss=SCCE)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# -- low-precision variables ---------------------------------------------------
@pytest.mark.parametrize("clipping", ["fast", "exact"])
def test_bfloat16_variables_get_float32_noise_rounded_only_after_it_is_added(clipping):
    """Before: under the full 'bfloat16' policy (bfloat16 variables, as a
    KerasHub model loaded with dtype='bfloat16') the clipped sum was cast to
    bfloat16 and the noise drawn in bfloat16: bfloat16 noise has a grid as
    coarse as 2^-8 of its value, so a neighbouring sum shifted by 0.5 C gave
    outputs (11.6% of them) that the other sum never gives. The sum and the
    noise now stay float32 and the update is rounded to bfloat16 after the
    noise: here the inner optimizer must receive exactly bfloat16(float32 noise
    / B) for a batch whose clipped sum is 0."""
    keras.mixed_precision.set_global_policy("bfloat16")
    try:
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.trainable_variables[0].dtype == "bfloat16"
    optimizer = kdp.DPSGD(1.0, l2_norm_clip=0.7, noise_multiplier=1.3, seed=11,
                          clipping=clipping)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)  # the spy reads values
    # The noise the first update draws, in float32, from the same seed.
    expected = optimizer._noise_like(
        [tf.zeros(v.shape, tf.float32) for v in model.trainable_variables], 0, 1, 0)
    received = []
    apply = optimizer.inner_optimizer.apply

    def spy(grads, variables=None):
        received.append([tf.convert_to_tensor(g) for g in grads])
        return apply(grads, variables)

    optimizer.inner_optimizer.apply = spy
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 16)).astype("float32"), rng.normal(size=(8, 64))
    model.fit(x, y.astype("float32"), sample_weight=np.zeros(8, "float32"), batch_size=8,
              verbose=0, shuffle=False)
    assert kdp.ledger_of(model).updates == 1
    for got, noise in zip(received[0], expected):
        assert got.dtype == tf.bfloat16
        want = tf.cast(noise / 8.0, tf.bfloat16)
        np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy(),
                                      tf.cast(want, tf.float32).numpy())
