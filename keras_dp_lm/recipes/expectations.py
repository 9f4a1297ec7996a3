"""What the utility suite measured, as expectations for :meth:`DPRecipe.explain`.

Measurements, not rules: nothing here changes a recipe's hyperparameters. The
numbers come from ``benchmarks/results/feature_normalization.md`` (21 labelled tasks,
a DP head on frozen MiniLM features, the README's path) and
``benchmarks/results/imbalanced.md`` (11 binary tasks with a rare class) and
``benchmarks/results/class_means_head.md`` (DPClassMeans); update them with those files.
"""

from __future__ import annotations

__all__ = ["SMALL_DATA_UNITS_PER_CLASS", "data_regime"]

# Below this many privacy units per class a DP head's gap to non-private grew on the
# utility suite.
SMALL_DATA_UNITS_PER_CLASS = 400


def data_regime(n: int, num_classes: int) -> str:
    """The :meth:`DPRecipe.explain` line on what a DP head's data per class leads
    one to expect, from the utility suite's measurements.

    Example:
        >>> from keras_dp_lm.recipes.expectations import data_regime
        >>> data_regime(1_000, 4).startswith("data regime: small, 250 privacy units")
        True
    """
    per_class = n / num_classes
    rare = ("; with unbalanced classes count the smallest: with the plain cross-entropy a "
            "class of 50-100 training examples was almost never predicted at epsilon 3 (4 "
            "of 11 tasks), with DPClassPriors and LogitAdjustedSparseCategoricalCrossentropy"
            "(priors, class_weighting=True) it was on 11 of 11 "
            "(benchmarks/results/imbalanced.md); with such a class DPClassMeans (DP class "
            "means, no training) came within 3 points of non-private balanced accuracy at "
            "epsilon 8 on 6 of 7 held-out tasks, the trained head on 4, but on balanced "
            "small data the trained head was better (benchmarks/results/class_means_head.md)")
    if per_class >= SMALL_DATA_UNITS_PER_CLASS:
        return (f"data regime: {per_class:.0f} privacy units per class (N / num_classes), at "
                f"least {SMALL_DATA_UNITS_PER_CLASS}: on the utility suite's 11 such tasks "
                "(frozen MiniLM features) a DP head at epsilon 3 ended within 3 points of "
                "the best non-private head on 9, and at most 3.5 below" + rare)
    return (f"data regime: small, {per_class:.0f} privacy units per class (N / num_classes), "
            f"under {SMALL_DATA_UNITS_PER_CLASS}: on the utility suite's 10 such tasks "
            "(frozen MiniLM features) a DP head at epsilon 3 ended 0.8-8.8 points below the "
            "best non-private head, more than 3 on 7 (at epsilon 8: more than 3 on 1), "
            "about what a non-private head loses on a quarter to half of the data. The "
            "rate, the steps, a projection of the features and a DP class-mean head did "
            "not close it; more examples per class or a larger epsilon do "
            "(benchmarks/results/feature_normalization.md)" + rare)
