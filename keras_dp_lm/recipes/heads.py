"""Which DP head to put on frozen features, read off released label counts.

Two heads for a frozen encoder's features:

* a **trained** linear head: ``DPFeatureNormalization``, a Dense layer trained with a
  DP optimizer (``suggest_recipe(trainable="head")``) and
  ``LogitAdjustedSparseCategoricalCrossentropy(priors, class_weighting=True)``;
* **class means**: :class:`keras_dp_lm.data.DPClassMeans`, one release of the class
  sums and counts, no training.

The rule, measured in balanced accuracy against the best non-private probe on the
same features (MiniLM, 3 repeats, totals including every release): with **two classes
and a rare one** (under 20% by the released priors) use the class means; otherwise the
trained head. On its own held-out round (11 binary tasks with a class of 5-25%, fixed
before they ran, ``benchmarks/results/head_rule.md``) the rule came within 3 points of
the probe at epsilon 8 on 9 of 11 tasks (6 of the 8 under 20%), the trained head alone
on 5 (2 of 8), with mean balanced accuracy
79.9% against 78.3% (75.2% against 71.1% at epsilon 3), and within 1 point of the
trained head where a class is 20-25%. With several classes the class means were not
reliably better (a first round: they missed by 3.8-6.4 points on three of eight tasks
with one class of 4-15% where the trained head, which learns the features' covariance,
came within 1.2), nor where classes are about equal
(``benchmarks/results/class_means_head.md``).

:func:`suggest_head` reads only the priors a :class:`keras_dp_lm.data.DPClassPriors`
released (post-processing), and that release is counted in either head's budget (pass
``priors.dp_event()`` in its ``extra_events``). The choice is adaptive, though: which
third release follows depends on a released value. Each head's total is what its
accountant reports; the two heads together, one picked by the priors, are
``(epsilon, 2 delta)``-DP by a union over the two (each is ``(epsilon, delta)``). To
state ``delta`` for the whole decision, budget either head at ``delta / 2`` (as the
README's quick start and the parameters guide do). A run that stops instead of taking
the other head adds at most the delta of the two earlier releases at that epsilon,
which is negligible: their own epsilon is far below the target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from keras_dp_lm.data import DPClassPriors

__all__ = ["RARE_PRIOR", "suggest_head"]

# Below this released prior of the smaller of two classes, class means.
RARE_PRIOR = 0.2


def suggest_head(priors: DPClassPriors) -> str:
    """``"class_means"`` or ``"trained"``: the head the benchmarks favour for these
    labels, from the released priors only.

    ``"class_means"`` (:class:`keras_dp_lm.data.DPClassMeans`) when there are two
    classes and the smaller one's released prior is under ``RARE_PRIOR`` (0.2: it
    holds less than 40% of an equal share); ``"trained"`` (the README's head: a
    Dense layer trained with ``LogitAdjustedSparseCategoricalCrossentropy``)
    otherwise.

    Args:
        priors: a :class:`keras_dp_lm.data.DPClassPriors` after ``release(labels)``.
            Only its released priors are read (post-processing); raw counts and
            priors set by hand are refused, since choosing from them would be a
            release nobody counts.

    Returns:
        ``"class_means"`` or ``"trained"``.

    Example:
        >>> import numpy as np
        >>> from keras_dp_lm.data import DPClassPriors
        >>> from keras_dp_lm.recipes import suggest_head
        >>> labels = np.array([0] * 900 + [1] * 100)          # a 10% class
        >>> priors = DPClassPriors(num_classes=2, seed=0)
        >>> _ = priors.release(labels)
        >>> suggest_head(priors)
        'class_means'
        >>> balanced = DPClassPriors(num_classes=2, seed=0)
        >>> _ = balanced.release(np.array([0, 1] * 500))
        >>> suggest_head(balanced)
        'trained'
    """
    from keras_dp_lm.data import DPClassPriors

    if not isinstance(priors, DPClassPriors):
        raise TypeError(
            "`priors` must be a keras_dp_lm.data.DPClassPriors after `release(labels)`: "
            f"got {type(priors).__name__}. Choosing a head from raw label counts would be "
            "a release of them that no budget counts; release the counts with "
            "DPClassPriors and pass its dp_event() to the budget.")
    released = priors.released_priors()
    if len(released) == 2 and float(released.min()) < RARE_PRIOR:
        return "class_means"
    return "trained"
