"""The package's own surface: no deprecated module paths (issue 39)."""

import importlib

import pytest

import keras_dp_lm


@pytest.mark.parametrize("old", ["vocab", "sampling", "generation", "fast_clipping", "losses"])
def test_removed_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"keras_dp_lm.{old}")
    assert old not in keras_dp_lm.__all__
    with pytest.raises(AttributeError):
        getattr(keras_dp_lm, old)
