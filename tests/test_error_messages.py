"""Public error messages say what is wrong with the right numbers, and name the fix."""

import keras
import numpy as np
import pytest

import keras_dp_lm as kdp


@pytest.mark.parametrize("make, missing", [
    (lambda: kdp.DPAdam(1e-3), "`l2_norm_clip` and `noise_multiplier`"),
    (lambda: kdp.DPSGD(0.1, l2_norm_clip=1.0), "`noise_multiplier`"),
    (lambda: kdp.DPAdamW(noise_multiplier=1.0), "`l2_norm_clip`"),
])
def test_a_convenience_without_privacy_arguments_names_them_and_how_to_choose(make, missing):
    with pytest.raises(TypeError) as info:
        make()
    message = str(info.value)
    assert f"needs {missing} (by keyword)" in message
    assert "suggest_recipe(dataset_size, target_epsilon=3.0" in message
    assert "calibrate_noise_multiplier(" in message
    assert "<locals>" not in message and "_convenience" not in message


N, B = 64, 16


def _trained_model(epochs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kdp.DPAdam(1e-3, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if epochs:
        model.fit(x, y, batch_size=B, epochs=epochs, verbose=0, shuffle=False)
    return model, x, y


def _accountant(target):
    return kdp.PrivacyAccountant(target_epsilon=target, delta=1e-5, dataset_size=N,
                                 batch_size=B, sampling="poisson", accountant="rdp",
                                 verbose=0)


def test_budget_exhausted_by_earlier_updates_says_none_is_allowed_and_the_fix():
    model, x, y = _trained_model(epochs=8)          # 32 noised updates, epsilon far above 0.5
    spent = kdp.compute_epsilon(0.5, B / N, 32, 1e-5, "rdp")
    assert spent > 10
    with pytest.raises(kdp.PrivacyBudgetExhaustedError) as info:
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[_accountant(0.5)])
    message = str(info.value)
    assert (f"the model has applied 32 noised updates, which already spend epsilon "
            f"{spent:.3g}, more than target_epsilon=0.5 (delta=1e-05): it allows no "
            "further update.") in message
    assert "allows 32" not in message
    assert f"give the accountant a target_epsilon above {spent:.3g}" in message
    assert "weights that have not seen the private data" in message
    assert kdp.ledger_of(model).updates == 32     # refused before any update


def test_budget_used_up_exactly_says_how_many_the_target_allows():
    model, x, y = _trained_model(epochs=0)
    target = kdp.compute_epsilon(0.5, B / N, 6, 1e-5, "rdp")   # exactly 6 updates fit
    accountant = _accountant(target)
    model.fit(x, y, batch_size=B, epochs=5, verbose=0, callbacks=[accountant])
    assert kdp.ledger_of(model).updates == accountant.max_steps == 6
    with pytest.raises(kdp.PrivacyBudgetExhaustedError) as info:
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[accountant])
    message = str(info.value)
    assert (f"the model has applied 6 noised updates (epsilon {target:.3g} so far) and "
            f"target_epsilon={target:g} (delta=1e-05) allows 6 in total: none remains.") \
        in message
    assert "give the accountant a target_epsilon larger than this one" in message


def test_a_target_below_the_first_update_says_what_one_update_costs():
    model, x, y = _trained_model(epochs=0)
    first = kdp.compute_epsilon(0.5, B / N, 1, 1e-5, "rdp")
    with pytest.raises(kdp.PrivacyBudgetExhaustedError) as info:
        model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                  callbacks=[_accountant(first * 0.9)])
    message = str(info.value)
    assert (f"1 update(s) at noise multiplier 0.5 and sampling rate {B / N:.4g} cost epsilon "
            f"{first:.3g}") in message, message
    assert "Raise the noise multiplier" in message and "nothing was applied" in message
    assert "empty ledger" not in message and "applied 0" not in message
    assert kdp.ledger_of(model).updates == 0


def test_token_id_batches_with_the_preprocessor_still_set_name_the_fix():
    import math

    from keras_dp_lm import testing
    from keras_dp_lm.recipes import suggest_recipe

    texts = [f"record number {i} says hello" for i in range(300)]
    lm = testing.tiny_gpt2_causal_lm(texts, sequence_length=16)
    recipe = suggest_recipe(len(texts), target_epsilon=3.0, delta=1e-6, batch_size=32,
                            steps=2, learning_rate=1e-3,
                            num_parameters=sum(math.prod(v.shape)
                                               for v in lm.trainable_variables))
    batches = recipe.poisson_batches(texts, preprocessor=lm.preprocessor)
    lm.compile(optimizer=recipe.optimizer(), weighted_metrics=[])   # preprocessor kept
    with pytest.raises(ValueError, match=r"set `model.preprocessor = None` before fit"):
        lm.fit(batches, verbose=0)
    assert kdp.ledger_of(lm).updates == 0
