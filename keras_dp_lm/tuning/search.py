"""A hyperparameter search on private data whose whole cost is accounted.

:func:`private_search` runs DP training trials of a Keras model and releases the
best one, with the privacy of the *whole* search (every trial's training, every
trial's noisy validation score, the selection) charged to one budget by
private selection (Papernot & Steinke 2022; :mod:`keras_dp_lm.accounting.selection`):

1. The private records are split at random into training and validation parts.
2. The number of trials ``K`` is drawn, independently of the data, from a
   truncated negative binomial distribution of mean ``mean_trials``.
3. Each trial draws a candidate (learning rate, what to train) uniformly at
   random, trains a fresh model with DP-Adam on Poisson batches, and scores it
   on the validation part: the number of correct predictions (or of a per-example
   score in [0, 1]) plus Gaussian noise of std ``score_noise_multiplier``
   (sensitivity 1).
4. The trial with the best noisy score is released: its model, candidate and
   noisy score. Nothing else (how many trials ran, the other scores) is, since
   the bound covers the best alone.

Every trial uses the same noise multiplier, sampling rate and steps, calibrated
so the whole search meets ``target_epsilon`` at ``delta``; after each trial the
model's ledger is checked against them, so what is reported is what was applied.

Example:
    >>> import keras, numpy as np
    >>> from keras_dp_lm import tuning
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(600, 4)).astype("float32")
    >>> y = (x[:, 0] > 0).astype("int32")
    >>> def build(candidate):
    ...     return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> result = tuning.private_search(
    ...     build, x, y, target_epsilon=8.0, delta=1e-5, epochs=10.0, min_steps=20,
    ...     candidates=[tuning.Candidate(0.03), tuning.Candidate(0.1)], mean_trials=2,
    ...     seed=0)
    >>> result.epsilon <= 8.0, result.score > 0.7
    (True, True)
"""

import dataclasses
import math
import random

import numpy as np

from keras_dp_lm.accounting import selection
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.overflow import suggest_max_batch_size
from keras_dp_lm.recipes import suggest_recipe

__all__ = ["Candidate", "SearchResult", "private_search"]

# Share of delta reserved for a Poisson draw above the padded cap in any trial.
_OVERFLOW_SHARE = 1e-3


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: an Adam learning rate and what to train.

    ``trainable`` is handed to your ``build_model`` as it is (e.g. ``"head"``,
    ``"top2"``, ``"lora"``, ``"all"``); the search does not interpret it.
    """

    learning_rate: float
    trainable: object = None


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What a private search releases: the best trial alone.

    Attributes:
        model: the best trial's trained model (its ledger holds that trial's
            updates; the search's total is :attr:`epsilon`).
        candidate: its :class:`Candidate`.
        score: its noisy validation score, as a fraction of the validation part.
        epsilon: the whole search's epsilon at :attr:`delta` (RDP accountant).
        delta: the delta it was computed at (the target delta minus the
            reserve for a Poisson overflow).
        dp_event: the search's ``RepeatAndSelectDpEvent``, to compose with
            later releases about the same data.
        noise_multiplier, sampling_rate, steps, l2_norm_clip: every trial's.
        mean_trials, shape: the distribution of the number of trials.
    """

    model: object
    candidate: Candidate
    score: float
    epsilon: float
    delta: float
    dp_event: object
    noise_multiplier: float
    sampling_rate: float
    steps: int
    l2_norm_clip: float
    mean_trials: float
    shape: float
    validation_size: int

    def explain(self):
        return (f"Private search: the best of a random number of DP trials (mean "
                f"{self.mean_trials:g}, shape {self.shape:g}), each {self.steps} DP-Adam "
                f"steps at q={self.sampling_rate:.4g}, noise multiplier "
                f"{self.noise_multiplier:.4f}, clip {self.l2_norm_clip:g}, scored on "
                f"{self.validation_size} held-out private examples with Gaussian noise. "
                f"Released: learning rate {self.candidate.learning_rate:g}, trainable "
                f"{self.candidate.trainable!r}, noisy validation score {self.score:.4f}. "
                f"The whole search spends epsilon {self.epsilon:.3f} at delta "
                f"{self.delta:.3g} (Papernot & Steinke 2022, dp_accounting RDP).")


def _accuracy(model, x, y):
    logits = model.predict(x, batch_size=512, verbose=0)
    return (np.argmax(logits, axis=-1) == np.asarray(y)).astype("float64")


def _rows(data, index):
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: np.asarray(a)[index], data)


def _num_rows(data):
    import tensorflow as tf

    sizes = {len(a) for a in tf.nest.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(f"Every array of `x` and `y` must have the same rows, got {sizes}.")
    return sizes.pop()


def private_search(build_model, x, y, *, target_epsilon, delta, candidates,
                   loss="sparse_categorical_crossentropy_from_logits", mean_trials=3.0,
                   shape=1.0, epochs=3.0, min_steps=100, max_batch_size=4096,
                   l2_norm_clip=0.1, validation_fraction=0.1, score_fn=None,
                   score_noise_multiplier=None, micro_batch_size=None, seed=None,
                   verbose=0):
    """Search ``candidates`` privately and return the best trial; see the module docstring.

    Args:
        build_model: ``build_model(candidate) -> keras.Model``, a fresh,
            uncompiled model each call, with the candidate's layers trainable.
        x, y: the private records (arrays, or nests of arrays, with N rows) and
            their labels.
        target_epsilon, delta: the budget of the whole search.
        candidates: :class:`Candidate` objects (at least one).
        loss: a Keras loss; by default sparse categorical cross-entropy on logits.
        mean_trials, shape: the distribution of the number of trials (shape 1:
            geometric, 0: logarithmic; see :class:`~keras_dp_lm.accounting.selection.TrialCount`).
        epochs, min_steps, max_batch_size: the compute budget of one trial; the
            batch and steps follow :func:`~keras_dp_lm.recipes.suggest_recipe`'s rules.
        l2_norm_clip: C.
        validation_fraction: the share of the records held out to score trials.
        score_fn: ``score_fn(model, x_val, y_val) -> per-example scores``,
            clipped to [0, 1] (higher is better); default: accuracy of the argmax.
        score_noise_multiplier: std of the noise on the summed score; default
            ``max(2, 0.01 * validation size)`` (about one point of accuracy).
        micro_batch_size: gradient accumulation's micro-batch (memory only).
        seed: for tests only: fixes the split, the trial count, the candidates
            and the Poisson draws. ``None`` draws them from OS entropy.

    Returns:
        A :class:`SearchResult`.

    Raises:
        ValueError: before any training, when no noise meets the budget.
    """
    import keras

    from keras_dp_lm.callbacks import PrivacyAccountant
    from keras_dp_lm.data import poisson_batches
    from keras_dp_lm.optimizers import DPAdam
    from keras_dp_lm.training.ledger import ledger_of

    candidates = list(candidates)
    if not candidates or not all(isinstance(c, Candidate) for c in candidates):
        raise ValueError("`candidates` must be a non-empty list of tuning.Candidate.")
    if not 0 < validation_fraction < 1:
        raise ValueError(f"`validation_fraction` must be in (0, 1), got {validation_fraction}.")
    n = _num_rows((x, y))
    rng = random.SystemRandom() if seed is None else random.Random(seed)
    order = np.array(rng.sample(range(n), n))
    n_val = max(1, int(round(validation_fraction * n)))
    val_index, train_index = np.sort(order[:n_val]), np.sort(order[n_val:])
    n_train = len(train_index)
    if score_noise_multiplier is None:
        score_noise_multiplier = max(2.0, 0.01 * n_val)

    # Plan: batch and steps by the recipe's rules, then the noise for the whole search.
    overflow_delta = _OVERFLOW_SHARE * delta
    search_delta = delta - overflow_delta
    plan = suggest_recipe(n_train, target_epsilon, delta, epochs=epochs, min_steps=min_steps,
                          max_batch_size=max_batch_size, num_parameters=1)
    q, steps = plan.sampling_rate, plan.steps
    count = selection.TrialCount(mean_trials, shape)
    sigma = selection.calibrate_search_noise(
        target_epsilon, search_delta, q, steps, mean_trials, shape,
        score_noise_multiplier=score_noise_multiplier)
    event = selection.selection_event(
        selection.trial_event(sigma, q, steps, score_noise_multiplier), mean_trials, shape)
    spent = selection.selection_epsilon(event.event, search_delta, mean_trials, shape)
    if spent > target_epsilon:  # never start a search over budget
        raise RuntimeError(f"calibration gave epsilon {spent} > {target_epsilon}")
    # A Poisson draw above the cap in any trial: at most E[K] * p over the search.
    overflow_p = overflow_delta / ((1.0 + math.exp(target_epsilon)) * count.mean())
    cap = suggest_max_batch_size(n_train, q, steps, max_overflow_probability=overflow_p)
    accumulation = 1 if micro_batch_size is None else max(1, math.ceil(cap / micro_batch_size))
    trial_epsilon = compute_epsilon(sigma, q, steps, search_delta)

    x_train, y_train = _rows(x, train_index), _rows(y, train_index)
    x_val, y_val = _rows(x, val_index), _rows(y, val_index)
    if loss == "sparse_categorical_crossentropy_from_logits":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    score_fn = score_fn or _accuracy

    best = None
    for _ in range(count.sample(seed=None if seed is None else rng.random())):
        candidate = candidates[rng.randrange(len(candidates))]
        model = build_model(candidate)
        if ledger_of(model).updates:
            raise ValueError(
                f"`build_model` returned a model whose weights already received "
                f"{ledger_of(model).updates} DP updates; a trial must start from weights "
                "no DP run trained (pretrained public weights are fine), else the search's "
                "epsilon misses them. Build a fresh model in `build_model`.")
        batches = poisson_batches((x_train, y_train), q, cap, num_steps=steps,
                                  seed=None if seed is None else rng.randrange(2**31))
        model.compile(optimizer=DPAdam(
            learning_rate=candidate.learning_rate, l2_norm_clip=l2_norm_clip,
            noise_multiplier=sigma, expected_batch_size=q * n_train,
            gradient_accumulation_steps=accumulation,
            seed=None if seed is None else rng.randrange(2**31)), loss=loss)
        accountant = PrivacyAccountant(target_epsilon=trial_epsilon * (1 + 1e-6),
                                       delta=search_delta, batches=batches, verbose=0)
        model.fit(batches, epochs=1, callbacks=[accountant], verbose=verbose, shuffle=False)
        _check_applied(ledger_of(model), sigma, q, steps)
        per_example = np.clip(np.asarray(score_fn(model, x_val, y_val), "float64"), 0.0, 1.0)
        if per_example.shape != (n_val,):
            raise ValueError(f"`score_fn` must return one score per validation example "
                             f"({n_val}), got shape {per_example.shape}.")
        noise = (rng.gauss(0.0, score_noise_multiplier) if seed is not None
                 else np.random.default_rng().normal(0.0, score_noise_multiplier))
        noisy = (per_example.sum() + noise) / n_val
        if best is None or noisy > best[0]:
            best = (noisy, candidate, model)
        else:
            del model
    if best is None:  # only a Poisson trial count draws K = 0
        raise RuntimeError("The search drew no trial (Poisson K = 0): nothing is released.")
    return SearchResult(
        model=best[2], candidate=best[1], score=float(best[0]), epsilon=spent,
        delta=search_delta, dp_event=event, noise_multiplier=sigma, sampling_rate=q,
        steps=steps, l2_norm_clip=l2_norm_clip, mean_trials=float(mean_trials),
        shape=float(shape), validation_size=n_val)


def _check_applied(ledger, sigma, q, steps):
    """The trial's ledger against the accounted trial: ``steps`` updates, each at
    noise >= sigma and rate <= q (else the search's epsilon would be wrong)."""
    rows = ledger.rows()
    ok = (sum(r[3] for r in rows) == steps
          and all(r[0] >= sigma * (1 - 1e-9) and 0 < r[1] <= q * (1 + 1e-9) for r in rows))
    if not ok:
        raise RuntimeError(
            f"A search trial applied updates the search did not account for (ledger rows "
            f"{rows}; accounted {steps} updates at sigma {sigma:.6g}, q {q:.6g}). Build a "
            "fresh model in `build_model` (no weights trained before with DP) and do not "
            "compile or fit it yourself.")
