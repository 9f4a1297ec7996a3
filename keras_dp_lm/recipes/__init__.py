"""Hyperparameters for DP fine-tuning from a target epsilon and a compute budget
(no TensorFlow until you build objects).

DP-SGD does not reward the hyperparameters of a non-private run. The rules
here follow the DP fine-tuning literature and are fixed in advance, so using
them spends no privacy (tuning them on the private data would):

* **Large logical batches, few hundred updates** (Li et al. 2022, "Large
  language models can be strong differentially private learners"; De et al.
  2022; Sander et al. 2023, "TAN without a burn"). At a fixed epsilon the noise
  of the averaged gradient is ``sigma * C / B``; growing ``B`` grows ``sigma``
  much more slowly, so large batches raise the signal-to-noise ratio. Given
  the compute budget (``epochs`` passes over the data) the recipe makes
  ``min_steps`` updates, the fewest that Adam fine-tuning needs, with the
  largest batch that budget pays for (capped at ``max_batch_size``).
* **A small clipping norm with Adam** (Li et al.: ``C = 0.1``, so every
  per-example gradient is clipped and the update is an average of directions).
  Adam normalises the update, so ``C`` sets the noise-to-signal ratio, not the
  step size.
* **A learning rate scaled for the batch and for the noise.** The
  non-private Adam rate you would use at ``reference_batch_size``, times
  ``sqrt(B / reference_batch_size)`` (the square-root rule for Adam, Malladi et
  al. 2022; at most ``max_learning_rate_scale``), times a noise factor. Adam
  divides each coordinate's step by the root of its second moment, and the DP
  noise raises that from ``s^2`` (the signal) to ``s^2 + (sigma C / B)^2``
  (Tang et al. 2024, "DP-AdamBC"), so without a correction the step along the
  signal shrinks by ``sqrt(1 + r^2)``, where ``r = sigma sqrt(d) / (kappa B)``
  is the noise-to-signal ratio per coordinate of the averaged clipped gradient
  (``d = num_parameters`` trainable parameters; ``kappa`` = ``gradient_alignment``,
  the assumed norm of the averaged clipped gradient in units of C). The rate is
  raised by that factor (at most ``max_noise_learning_rate_scale``). It matters
  when ``r`` is large: a few thousand examples and millions of trainable
  parameters (r ~ 23 on the Rotten Tomatoes example, where the uncorrected rate
  leaves the model at the majority class), much less for a small model on a
  large dataset (r ~ 1 in the demo: factor 1.46). The signal of a large
  pre-trained model is concentrated on fewer coordinates than ``d``, which the
  cap (16) stands for: with it the rule gives within ~2x of the rates Li et al.
  tuned for GPT-2 (2e-3 from 5e-5) and RoBERTa (5e-4 from 1e-5) at batch ~1000,
  and on the Rotten Tomatoes example the rate (4.9e-3) that learns where the
  batch rule alone (3.1e-4) does not. A sweep on public data refines it.
* **What is trained decides the rate** (``trainable``). ``"pretrained"``
  (default): the rule above, for fine-tuning pretrained weights (whole model,
  top layers, LoRA). ``"head"``: a new output layer trained from zero on frozen
  features (a linear probe). Under DP-Adam the noise dominates the second
  moment, so every coordinate moves about the rate per step whatever the
  signal (Tang et al. 2024); a head must travel from zero to weights of order
  one, so the rate is ``head_displacement / steps`` (2 / 100 = 0.02), and the
  non-private rate plays no part. Measured on four tuning tasks (frozen MiniLM
  features; ``benchmarks/utility_suite.py``), the best rates at 100 steps were
  0.01-0.03. The rate assumes features of norm about 4 (MiniLM's mean-pooled
  features): :class:`keras_dp_lm.data.DPFeatureNormalization` in front of the head
  centres them on a DP mean and rescales them to that norm (features of norm 1
  cost the bare rule 13-16 points on two of those tasks).
  :meth:`DPRecipe.explain` says which regime the noise puts the run
  in (``r`` below): above ``r = 10`` the noise swamps most coordinates, and
  training fewer parameters usually wins (Tramer & Boneh 2021).
* **Noise calibrated last**, with ``dp_accounting``'s PLD accountant, for the
  whole budget including other releases about the same data
  (``extra_events``, e.g. a DP vocabulary).

Example:
    >>> from keras_dp_lm.recipes import suggest_recipe
    >>> recipe = suggest_recipe(dataset_size=50_000, target_epsilon=8.0, delta=1e-6,
    ...                         epochs=2.0, learning_rate=1e-3, micro_batch_size=256,
    ...                         num_parameters=200_000)
    >>> recipe.steps, recipe.batch_size, recipe.gradient_accumulation_steps
    (100, 1000, 5)
    >>> recipe.epsilon <= 8.0, recipe.l2_norm_clip
    (True, 0.1)
    >>> round(recipe.noise_learning_rate_factor, 2)
    1.43
    >>> recipe = suggest_recipe(dataset_size=20_000, target_epsilon=3.0, epochs=5.0)
    >>> recipe.batch_size, recipe.steps, recipe.epsilon <= 3.0
    (1000, 100, True)
"""

from keras_dp_lm.recipes.fine_tuning import DPRecipe
from keras_dp_lm.recipes.fine_tuning import NoiseDominatedWarning
from keras_dp_lm.recipes.fine_tuning import suggest_recipe
from keras_dp_lm.recipes.heads import suggest_head

__all__ = ["DPRecipe", "NoiseDominatedWarning", "suggest_head", "suggest_recipe"]
