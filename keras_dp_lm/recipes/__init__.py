"""Hyperparameter recipes for DP training (no TensorFlow until you build objects).

Example:
    >>> from keras_dp_lm.recipes import suggest_recipe
    >>> recipe = suggest_recipe(dataset_size=20_000, target_epsilon=3.0, epochs=5.0)
    >>> recipe.batch_size, recipe.steps, recipe.epsilon <= 3.0
    (1000, 100, True)
"""

from keras_dp_lm.recipes.fine_tuning import DPRecipe
from keras_dp_lm.recipes.fine_tuning import NoiseDominatedWarning
from keras_dp_lm.recipes.fine_tuning import suggest_recipe

__all__ = ["DPRecipe", "NoiseDominatedWarning", "suggest_recipe"]
