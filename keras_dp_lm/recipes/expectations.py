"""What the utility suite measured, as expectations for :meth:`DPRecipe.explain`.

Measurements, not rules: nothing here changes a recipe's hyperparameters. The
numbers come from ``benchmarks/results/class_means_head.md`` and
``benchmarks/results/head_rule.md`` (the README's path on the 21 labelled tasks of the
utility suite, frozen MiniLM features, in balanced accuracy; the head rule's held-out
rounds) and ``benchmarks/results/layer_features.md`` (the same path on the five small
tasks of the sixth held-out round); update them with those files.
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
    rare = ("; with unbalanced classes count the smallest. With two classes and one under "
            "20% by DPClassPriors' released counts, recipes.suggest_head(priors) says "
            "\"class_means\" (DPClassMeans: one release, no training): on 11 held-out "
            "binary tasks with a class of 5-25% the rule came within 3 points of "
            "non-private balanced accuracy at epsilon 8 on 9 (under 20%: 6 of 8), the "
            "trained head on 5 (2 of 8), and kept the rare class's recall at least 38% "
            "at epsilon 3 (benchmarks/results/head_rule.md); otherwise "
            "the trained head, with DPClassPriors and "
            "LogitAdjustedSparseCategoricalCrossentropy(priors, class_weighting=True)")
    if per_class >= SMALL_DATA_UNITS_PER_CLASS:
        return (f"data regime: {per_class:.0f} privacy units per class (N / num_classes), at "
                f"least {SMALL_DATA_UNITS_PER_CLASS}: on the utility suite's 11 such tasks "
                "(frozen MiniLM features) the README's trained head at epsilon 3 ended "
                "within 3 points of the best non-private head's balanced accuracy on 9, "
                "and at most 5.1 below (a class of 311 among five)" + rare)
    return (f"data regime: small, {per_class:.0f} privacy units per class (N / num_classes), "
            f"under {SMALL_DATA_UNITS_PER_CLASS}: on the utility suite's 18 such tasks "
            "(frozen MiniLM features) the README's trained head at epsilon 3 ended 0.2 "
            "above to 17.1 points below the best non-private head's balanced accuracy, "
            "more than 3 below on 13 (at epsilon 8 on 7: by 5.0-6.6 on three with a class "
            "of 50-61 examples among four or five, by 3.1-4.2 on four of the eight newest, "
            "held out, with 132-220 among four or five): on 13 of them the head at "
            "epsilon 8 was worth about half the training data to a non-private head, at "
            "epsilon 3 about a quarter, so it misses where the learning curve still climbs "
            "more than 3 points from half the data to all; more examples per class or a "
            "larger epsilon close it (benchmarks/results/head_rule.md, layer_features.md, "
            "smollm2_features.md, head_ceilings.md)" + rare)
