"""Which DP head to put on frozen features, read off released label counts.

Two heads are measured on the utility benchmarks (balanced accuracy against the best
non-private probe on the same frozen features):

* a **trained** linear head: ``DPFeatureNormalization``, a Dense layer trained with a
  DP optimizer (``suggest_recipe(trainable="head")``) and
  ``LogitAdjustedSparseCategoricalCrossentropy(priors, class_weighting=True)``;
* **class means**: :class:`keras_dp_lm.data.DPClassMeans`, one release of the class
  sums and counts, no training.

With two classes and a rare one the class means were better; with several classes,
or classes of about equal size, the trained head was (it learns the features'
covariance, which a nearest mean ignores). :func:`suggest_head` says which, from the
priors a :class:`keras_dp_lm.data.DPClassPriors` released: post-processing of a DP
release, so the choice spends no privacy beyond that release, which the budget must
count either way (pass ``priors.dp_event()`` in ``extra_events`` of whichever head).
The measurements: ``benchmarks/results/class_means_head.md`` and
``benchmarks/results/head_rule.md``.
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
            Only its released priors are read (post-processing); raw label counts
            are refused, since choosing from them would be a release nobody counts.

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
    if priors.priors is None:
        raise ValueError("DPClassPriors has no priors yet: call `release(labels)` on the "
                         "training labels first (one Gaussian release, counted in "
                         "`priors.dp_event()`).")
    released = np.asarray(priors.priors, dtype="float64")
    if len(released) == 2 and float(released.min()) < RARE_PRIOR:
        return "class_means"
    return "trained"
