"""recipes.suggest_head: the head chosen from released priors only."""

import numpy as np
import pytest

from keras_dp_lm.data import DPClassPriors
from keras_dp_lm.recipes import suggest_head
from keras_dp_lm.recipes.heads import RARE_PRIOR


def _released(labels, num_classes=2, seed=0):
    priors = DPClassPriors(num_classes=num_classes, seed=seed)
    priors.release(np.asarray(labels))
    return priors


def test_two_classes_with_a_rare_one_get_class_means():
    assert suggest_head(_released([0] * 900 + [1] * 100)) == "class_means"
    assert suggest_head(_released([1] * 950 + [0] * 50)) == "class_means"


def test_balanced_two_classes_get_the_trained_head():
    assert suggest_head(_released([0, 1] * 500)) == "trained"


def test_several_classes_get_the_trained_head_even_with_a_rare_one():
    labels = [0] * 400 + [1] * 300 + [2] * 250 + [3] * 50
    assert suggest_head(_released(labels, num_classes=4)) == "trained"


def test_the_threshold_applies_to_the_released_priors(monkeypatch):
    priors = _released([0, 1] * 500)
    monkeypatch.setattr(priors, "released_priors",
                        lambda: np.array([1 - RARE_PRIOR + 1e-9, RARE_PRIOR - 1e-9]))
    assert suggest_head(priors) == "class_means"
    monkeypatch.setattr(priors, "released_priors",   # the threshold itself: not under it
                        lambda: np.array([1 - RARE_PRIOR, RARE_PRIOR]))
    assert suggest_head(priors) == "trained"


def test_choosing_makes_no_release():
    priors = _released([0] * 900 + [1] * 100)
    before = (priors.num_releases, repr(priors.dp_event()), priors.priors.copy())
    suggest_head(priors)
    assert (priors.num_releases, repr(priors.dp_event())) == before[:2]
    np.testing.assert_array_equal(priors.priors, before[2])


def test_raw_counts_unreleased_and_hand_set_priors_are_refused():
    with pytest.raises(TypeError, match="raw label counts would be a release"):
        suggest_head(np.array([0.9, 0.1]))
    with pytest.raises(ValueError, match=r"call `release\(labels\)`"):
        suggest_head(DPClassPriors(num_classes=2))
    hand_set = DPClassPriors(num_classes=2)
    hand_set.priors = np.array([0.9, 0.1])   # the true shares, never released
    with pytest.raises(ValueError, match="set by hand"):
        suggest_head(hand_set)
    released = _released([0, 1] * 500)
    released.priors = np.array([0.9, 0.1])   # overwritten after a release
    with pytest.raises(ValueError, match="set by hand"):
        suggest_head(released)
