"""The private and the public hyperparameter search of :mod:`keras_dp_lm.tuning`
(described, with an example, there)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_dp_lm.accounting import selection
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.overflow import suggest_max_batch_size
from keras_dp_lm.recipes import suggest_recipe

if TYPE_CHECKING:
    import dp_accounting
    import keras

    from keras_dp_lm.recipes import DPRecipe

__all__ = ["Candidate", "PublicSearchResult", "SearchResult", "private_search",
           "public_search"]

# Share of delta reserved for a Poisson draw above the padded cap in any trial.
_OVERFLOW_SHARE = 1e-3
# The most of the budget the noisy scores alone may cost by default.
_SCORE_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: an Adam learning rate and what to train.

    ``learning_rate`` is the DP-Adam rate of the trial. ``trainable`` is handed
    to your ``build_model`` as it is (e.g. ``"head"``, ``"top2"``, ``"lora"``,
    ``"all"``); the search does not interpret it.
    """

    learning_rate: float
    trainable: object = None


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What a private search releases: the best trial alone.

    Attributes:
        model: the best trial's trained model. Its ledger counts the whole
            search (:attr:`epsilon` at :attr:`delta`, covering the trial's
            updates), so a ``PrivacyAccountant`` on it, or on later DP training
            of it, reports at least the search's epsilon; the number of trials
            is not recorded.
        candidate: its :class:`Candidate`.
        score: its noisy validation score, as a fraction of the validation part.
        epsilon: the whole search's epsilon at :attr:`delta` (RDP accountant).
        delta: the search's total delta (its epsilon is computed at this delta
            minus a thousandth reserved for a Poisson draw above a trial's cap).
        dp_event: the search's ``RepeatAndSelectDpEvent``, to compose with
            later releases about the same data.
        noise_multiplier, sampling_rate, steps, l2_norm_clip: every trial's.
        mean_trials, shape: the distribution of the number of trials.
        validation_size: ``validation_fraction * N``, the expected (public)
            number of held-out examples; the split's real size is not released.
        score_noise_multiplier: the std of the noise on each trial's summed score.
    """

    model: keras.Model
    candidate: Candidate
    score: float
    epsilon: float
    delta: float
    dp_event: dp_accounting.DpEvent
    noise_multiplier: float
    sampling_rate: float
    steps: int
    l2_norm_clip: float
    mean_trials: float
    shape: float
    validation_size: float
    score_noise_multiplier: float

    def explain(self) -> str:
        return (f"Private search: the best of a random number of DP trials (mean "
                f"{self.mean_trials:g}, shape {self.shape:g}), each {self.steps} DP-Adam "
                f"steps at q={self.sampling_rate:.4g}, noise multiplier "
                f"{self.noise_multiplier:.4f}, clip {self.l2_norm_clip:g}, scored on "
                f"about {self.validation_size:.0f} held-out private examples with noise. "
                f"Released: learning rate {self.candidate.learning_rate:g}, trainable "
                f"{self.candidate.trainable!r}, noisy validation score {self.score:.4f}. "
                f"The whole search spends epsilon {self.epsilon:.3f} at delta "
                f"{self.delta:.3g} (Papernot & Steinke 2022, dp_accounting RDP; a "
                "thousandth of delta covers a Poisson draw above a trial's cap).")


def _accuracy(model, x, y):
    import tensorflow as tf

    # Every trial is a new model with its own predict function: TensorFlow's
    # "triggered tf.function retracing" note counts them as retraces of one.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        logits = model.predict(x, batch_size=512, verbose=0)
    finally:
        logger.setLevel(level)
    return (np.argmax(logits, axis=-1) == np.asarray(y)).astype("float64")


def _check_candidates(candidates):
    candidates = list(candidates)
    if not candidates or not all(isinstance(c, Candidate) for c in candidates):
        raise ValueError("`candidates` must be a non-empty list of tuning.Candidate.")
    return candidates


def _keras_loss(loss):
    """The default name stands for sparse categorical cross-entropy on logits."""
    import keras
    if loss == "sparse_categorical_crossentropy_from_logits":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss


def _rows(data, index):
    import tensorflow as tf
    return tf.nest.map_structure(lambda a: np.asarray(a)[index], data)


def _num_rows(data):
    import tensorflow as tf
    sizes = {len(a) for a in tf.nest.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(f"Every array of `x` and `y` must have the same rows, got {sizes}.")
    return sizes.pop()


def private_search(build_model: Callable[[Candidate], keras.Model],
                   x: np.ndarray | Mapping[str, np.ndarray], y: np.ndarray, *,
                   target_epsilon: float, delta: float, candidates: Sequence[Candidate],
                   loss: str | keras.losses.Loss = "sparse_categorical_crossentropy_from_logits",
                   mean_trials: float = 3.0, shape: float = 1.0, epochs: float = 3.0,
                   min_steps: int = 100, max_batch_size: int = 4096, l2_norm_clip: float = 0.1,
                   validation_fraction: float = 0.1,
                   score_fn: Callable[[keras.Model, Any, np.ndarray], np.ndarray] | None = None,
                   score_noise_multiplier: float | None = None, micro_batch_size: int | None = None,
                   seed: int | None = None, verbose: int = 0) -> SearchResult:
    """Search ``candidates`` privately and return the best trial (the steps: :mod:`keras_dp_lm.tuning`).

    Args:
        build_model: ``build_model(candidate) -> keras.Model``, a fresh,
            uncompiled model each call, with the candidate's layers trainable,
            built from public information only: no private data (no
            ``Normalization.adapt`` on it), nothing from an earlier trial (no
            weights copied from it). Weights that already received DP updates
            are refused; other links between trials are yours to avoid.
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
            clipped to [0, 1] (higher is better; NaN counts 0); default: accuracy
            of the argmax. Each example's score must depend on that example
            alone (and the model): the noise is calibrated to sensitivity 1.
        score_noise_multiplier: std of the noise on the summed score; default
            :func:`default_score_noise` (about one point of accuracy, more on a
            small validation part or a small budget).
        micro_batch_size: gradient accumulation's micro-batch (memory only).
        seed: for tests only: fixes the split, the trial count, the candidates,
            the Poisson draws and the noise, so the result is NOT private (the
            trials' noise seeds are written into saved files). ``None`` draws
            them all from OS entropy.
        verbose: passed to each trial's ``fit`` (0, the default: silent).

    Returns:
        A :class:`SearchResult`.

    Raises:
        ValueError: before any training, when no noise meets the budget.
    """
    from keras_dp_lm.callbacks import PrivacyAccountant
    from keras_dp_lm.data import poisson_batches
    from keras_dp_lm.optimizers import DPAdam
    from keras_dp_lm import _keras_internals as keras_internals
    from keras_dp_lm.training.model_ledgers import ledger_of
    from keras_dp_lm.training.model_ledgers import sharing_ledgers

    candidates = _check_candidates(candidates)
    if not 0 < validation_fraction < 1:
        raise ValueError(f"`validation_fraction` must be in (0, 1), got {validation_fraction}.")
    n = _num_rows((x, y))
    rng = random.SystemRandom() if seed is None else random.Random(seed)
    # Each record joins the validation part on its own coin (not a fixed-size
    # subset): a record added to the data then lands in exactly one part and
    # leaves every other record where it was, so each trial is the composition
    # of DP-SGD on one part and the noisy score on the other (add/remove-one).
    held_out = held_out_coins(n, validation_fraction, rng)
    val_index, train_index = np.flatnonzero(held_out), np.flatnonzero(~held_out)
    n_val = len(val_index)
    if not n_val or not len(train_index):
        raise ValueError("The random split left an empty validation or training part: use "
                         "more records or another `validation_fraction`.")
    # Batch, rate, noise and the score's divisor come from the public N and
    # fraction, never from the split's real sizes (counts of private coins).
    planned_val = validation_fraction * n
    planned_train = max(1, int(round(n - planned_val)))
    if score_noise_multiplier is None:
        score_noise_multiplier = default_score_noise(target_epsilon, delta, mean_trials,
                                                     shape, planned_val)

    # Plan: batch and steps by the recipe's rules, then the noise for the whole search.
    overflow_delta = _OVERFLOW_SHARE * delta
    search_delta = delta - overflow_delta
    # the recipe's batch and steps rules only (its noise is for one run, not a search)
    plan = suggest_recipe(planned_train, target_epsilon, delta, epochs=epochs, min_steps=min_steps,
                          max_batch_size=max_batch_size, trainable="head")
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
    cap = suggest_max_batch_size(planned_train, q, steps, max_overflow_probability=overflow_p)
    accumulation = 1 if micro_batch_size is None else max(1, math.ceil(cap / micro_batch_size))
    trial_epsilon = compute_epsilon(sigma, q, steps, search_delta)

    x_train, y_train = _rows(x, train_index), _rows(y, train_index)
    x_val, y_val = _rows(x, val_index), _rows(y, val_index)
    loss = _keras_loss(loss)
    score_fn = score_fn or _accuracy

    best = None
    # Every trial's objects get the auto-names the first trial's got (Keras numbers
    # them: `dense_3`), so the released model's names say nothing of which trial
    # won or how many ran; afterwards the counters stand as after one trial.
    names_before, names_after = keras_internals.name_counters(), None
    trained = set()  # digests of every trial's trained weights
    for _ in range(count.sample(seed=None if seed is None else rng.random())):
        candidate = candidates[rng.randrange(len(candidates))]
        keras_internals.restore_name_counters(names_before)
        model = build_model(candidate)
        if _digests(model) & trained:
            raise ValueError(
                "`build_model` returned a model that starts from weights an earlier trial "
                "trained: the trials must be independent runs (Papernot & Steinke), each "
                "from public or fresh weights. Build every trial from scratch.")
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
            noise_multiplier=sigma, expected_batch_size=q * planned_train,
            gradient_accumulation_steps=accumulation,
            seed=None if seed is None else rng.randrange(2**31)), loss=loss)
        accountant = PrivacyAccountant(target_epsilon=trial_epsilon * (1 + 1e-6),
                                       delta=search_delta, batches=batches, verbose=0)
        model.fit(batches, epochs=1, callbacks=[accountant], verbose=verbose, shuffle=False)
        names_after = names_after or keras_internals.name_counters()
        trained |= _digests(model)
        _check_applied(ledger_of(model), sigma, q, steps)
        # NaN counts 0 and infinities clip: each example moves the sum by at most 1
        per_example = np.clip(np.nan_to_num(np.asarray(score_fn(model, x_val, y_val), "float64"),
                                            nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
        if per_example.shape != (n_val,):
            raise ValueError(f"`score_fn` must return one score per validation example "
                             f"({n_val}), got shape {per_example.shape}.")
        noise = (rng.gauss(0.0, score_noise_multiplier) if seed is not None
                 else np.random.default_rng().normal(0.0, score_noise_multiplier))
        noisy = (per_example.sum() + noise) / planned_val
        if best is None or noisy > best[0]:
            best = (noisy, candidate, model)
        else:
            del model
    if names_after is not None:
        keras_internals.restore_name_counters(names_after)
    if best is None:  # only a Poisson trial count draws K = 0
        raise RuntimeError("The search drew no trial (Poisson K = 0): nothing is released.")
    released = best[2]
    _forget_training_traces(released)
    # Its ledger now counts the whole search, which covers the trial's updates:
    # an accountant on it (and any later DP training) starts from the search. So
    # does the ledger of every model inside it that recorded those updates (a
    # base saved or reused alone later). The search covers the trial's updates
    # only where they are all a ledger holds; elsewhere every row counts too.
    for ledger in [ledger_of(released), *sharing_ledgers(released)]:
        if ledger.updates:
            ledger.record_selection(spent, delta,
                                    covers=steps if ledger.updates == steps else 0)
    return SearchResult(
        model=released, candidate=best[1], score=float(best[0]), epsilon=spent,
        delta=float(delta), dp_event=event, noise_multiplier=sigma, sampling_rate=q,
        steps=steps, l2_norm_clip=l2_norm_clip, mean_trials=float(mean_trials),
        shape=float(shape), validation_size=planned_val,
        score_noise_multiplier=float(score_noise_multiplier))


def _digests(model):
    """Digests of the model's trainable weights (bytes), to tell a trial that starts
    from an earlier trial's trained weights (copied with ``set_weights``)."""
    import hashlib

    return {hashlib.sha256(np.ascontiguousarray(v.numpy()).tobytes()).hexdigest()
            for v in model.trainable_variables if np.any(v.numpy())}


def _forget_training_traces(model):
    """What the released object would leak beyond its weights: the optimizer's
    noise seed (the noise could be regenerated and subtracted; the traced train
    function holds it too), the trial's
    un-noised training loss (``model.history``, the metrics' running means)."""
    model.optimizer.drop_noise_seed()
    model.train_function = None  # its traced graph holds the seed as a constant
    model.history = None
    for metric in model.metrics:
        metric.reset_state()


def held_out_coins(n, fraction, rng):
    """``[n]`` bools: record ``i`` is held out with probability ``fraction``, on its
    own coin (the ``i``-th draw of ``rng``).

    Example:
        >>> import random
        >>> a = held_out_coins(5, 0.5, random.Random(0))
        >>> b = held_out_coins(6, 0.5, random.Random(0))
        >>> bool((a == b[:5]).all())   # one more record moves no other record
        True
    """
    return np.array([rng.random() < fraction for _ in range(n)], bool)


def default_score_noise(target_epsilon, delta, mean_trials, shape, validation_size):
    """The score's noise std by default: about one point of accuracy
    (``0.01 * validation_size``, at least 2), or more when needed for the scores
    alone to cost at most a quarter of ``target_epsilon`` in the search.

    Example:
        >>> default_score_noise(3.0, 1e-6, 3.0, 1.0, 5000)
        50.0
    """
    return selection.calibrate_score_noise(
        _SCORE_SHARE * target_epsilon, delta, mean_trials, shape,
        at_least=max(2.0, 0.01 * validation_size))


def _check_applied(ledger, sigma, q, steps):
    """The trial's ledger against the accounted trial: ``steps`` updates, each at
    noise >= sigma and rate <= q (else the search's epsilon would be wrong)."""
    rows = ledger.rows()
    ok = sum(row.updates for row in rows) == steps and all(
        row.noise_multiplier >= sigma * (1 - 1e-9) and 0 < row.sampling_rate <= q * (1 + 1e-9)
        for row in rows)
    if not ok:
        raise RuntimeError(
            f"A search trial applied updates the search did not account for (ledger rows "
            f"{rows}; accounted {steps} updates at sigma {sigma:.6g}, q {q:.6g}). Build a "
            "fresh model in `build_model` (no weights trained before with DP) and do not "
            "compile or fit it yourself.")


@dataclasses.dataclass(frozen=True)
class PublicSearchResult:
    """What a search on public proxy data found (no privacy spent).

    Attributes:
        best: the :class:`Candidate` with the best validation score.
        scores: ``{candidate: mean validation score}`` for every candidate.
        noise_multiplier, batch_size, steps, l2_norm_clip: the private run simulated.
    """

    best: Candidate
    scores: dict[Candidate, float]
    noise_multiplier: float
    batch_size: int
    steps: int
    l2_norm_clip: float


def public_search(build_model: Callable[[Candidate], keras.Model],
                  x: np.ndarray | Mapping[str, np.ndarray], y: np.ndarray, *, recipe: DPRecipe,
                  candidates: Sequence[Candidate],
                  loss: str | keras.losses.Loss = "sparse_categorical_crossentropy_from_logits",
                  validation_fraction: float = 0.2, repeats: int = 1,
                  score_fn: Callable[[keras.Model, Any, np.ndarray], np.ndarray] | None = None,
                  seed: int | None = None, verbose: int = 0) -> PublicSearchResult:
    """Try every candidate on PUBLIC data under the private run's noise: free.

    Each candidate trains a fresh model with DP-Adam at the recipe's noise
    multiplier, clip and steps, on Poisson batches of the recipe's expected
    size drawn from the public records, so every update carries the private
    run's noise-to-signal ratio; it is scored exactly on a public validation
    split. Nothing private is touched, so the choice costs no privacy; then
    train privately with ``recipe.optimizer(learning_rate=result.best.learning_rate)``.

    It transfers when the public task resembles the private one: the same model
    and features, similar labels, and a public set at least as large as the
    private batch (``recipe.batch_size``). When they differ, prefer
    :func:`private_search`, which tunes on the private data at an accounted cost.

    Args:
        build_model, candidates, loss, score_fn, verbose: as :func:`private_search`.
        x, y: public records and labels.
        recipe: the private run's :class:`~keras_dp_lm.recipes.DPRecipe`.
        validation_fraction: public records held out to score candidates.
        repeats: runs per candidate (fresh noise), averaged.
        seed: for tests only.

    Returns:
        A :class:`PublicSearchResult`.

    Example:
        >>> import keras, numpy as np
        >>> from keras_dp_lm import tuning
        >>> from keras_dp_lm.recipes import suggest_recipe
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(800, 4)).astype("float32")
        >>> y = (x[:, 0] > 0).astype("int32")
        >>> recipe = suggest_recipe(2000, 3.0, 1e-6, epochs=5.0, min_steps=20,
        ...                         num_parameters=10)
        >>> found = tuning.public_search(
        ...     lambda c: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        ...     x, y, recipe=recipe, seed=0,
        ...     candidates=[tuning.Candidate(1e-5), tuning.Candidate(0.1)])
        >>> found.best.learning_rate
        0.1
    """
    from keras_dp_lm.data import poisson_batches
    from keras_dp_lm.optimizers import DPAdam

    candidates = _check_candidates(candidates)
    n = _num_rows((x, y))
    rng = random.Random(seed)
    order = np.array(rng.sample(range(n), n))
    n_val = max(1, int(round(validation_fraction * n)))
    val_index, train_index = np.sort(order[:n_val]), np.sort(order[n_val:])
    if len(train_index) < recipe.batch_size:
        raise ValueError(
            f"The public training part ({len(train_index)} records) is smaller than the "
            f"private batch ({recipe.batch_size}): the simulated updates would not carry the "
            "private run's noise-to-signal ratio. Use more public data or private_search.")
    x_train, y_train = _rows(x, train_index), _rows(y, train_index)
    x_val, y_val = _rows(x, val_index), _rows(y, val_index)
    q = recipe.batch_size / len(train_index)
    cap = suggest_max_batch_size(len(train_index), q, recipe.steps,
                                 max_overflow_probability=1e-9)
    loss = _keras_loss(loss)
    score_fn = score_fn or _accuracy
    scores = {}
    for candidate in candidates:
        runs = []
        for _ in range(repeats):
            model = build_model(candidate)
            model.compile(optimizer=DPAdam(
                learning_rate=candidate.learning_rate, l2_norm_clip=recipe.l2_norm_clip,
                noise_multiplier=recipe.noise_multiplier, expected_batch_size=q * len(train_index),
                seed=None if seed is None else rng.randrange(2**31)), loss=loss)
            batches = poisson_batches((x_train, y_train), q, cap, num_steps=recipe.steps,
                                      seed=None if seed is None else rng.randrange(2**31))
            model.fit(batches, epochs=1, verbose=verbose, shuffle=False)
            runs.append(float(np.mean(np.clip(score_fn(model, x_val, y_val), 0.0, 1.0))))
        scores[candidate] = float(np.mean(runs))
    best = max(candidates, key=lambda c: scores[c])
    return PublicSearchResult(best=best, scores=scores, noise_multiplier=recipe.noise_multiplier,
                              batch_size=recipe.batch_size, steps=recipe.steps,
                              l2_norm_clip=recipe.l2_norm_clip)
