"""``DPOptimizer``: any Keras optimizer, made differentially private.

A DP optimizer wraps an inner Keras optimizer (as Keras's
``LossScaleOptimizer`` does) and owns the privacy parameters
(``l2_norm_clip``, ``noise_multiplier``), gradient accumulation, the noise and
the division by the logical batch size. The per-example work (losses,
gradients, clipping) happens in the DP train step (:mod:`keras_dp_lm.training`),
which hands the clipped sum to :meth:`DPOptimizer._apply_clipped_sum`; any
other route to ``apply_gradients`` raises. The privacy parameters are one
frozen :class:`~keras_dp_lm.optimizers.PrivacyParameters`, read from that one
object by the clipping, the noise and the ledger. It serializes by its registered name
with the inner optimizer's config, so a model compiled with any Keras optimizer
(``Lion``, ``Adafactor``, ...) reloads in a fresh process.

Semantics of one update, on ``R`` replicas with logical batch ``B``::

    update = inner((sum_i clip(g_i) + N(0, (noise_multiplier * l2_norm_clip)^2 I)) / B)

Each replica adds independent noise of std ``noise_multiplier * l2_norm_clip /
sqrt(R)``; Keras sums gradients across replicas, so the total noise has exactly
the std above whatever ``R`` is.

An inner optimizer with a ``set_dp_noise_variance(phi)`` method is told the
per-coordinate variance ``phi = (noise_multiplier * l2_norm_clip / B)^2`` of the
noise in the gradients it is about to apply (:class:`NoiseCorrectedAdam` uses
it to take the noise out of Adam's second moment).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_dp_lm.clipping.interface import sum_dtype
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.optimizers.privacy_parameters import CLIPPING_METHODS  # noqa: F401 (public here)
from keras_dp_lm.optimizers.privacy_parameters import PrivacyParameters
_KERAS_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")
# Base-optimizer arguments a wrapper does not take (set them on the inner one).
_BASE_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                  "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
                  "ema_overwrite_frequency": None, "loss_scale_factor": None,
                  "gradient_accumulation_steps": None, "learning_rate": None}


def _check_inner(optimizer):
    if is_dp_optimizer(optimizer):
        raise ValueError("The optimizer is already a DP optimizer.")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"A DP optimizer wraps a keras.optimizers.Optimizer, got {optimizer!r}.")
    if getattr(optimizer, "built", False):
        raise ValueError("Wrap an optimizer that has not been used yet (its state "
                         "would be lost).")
    for name in _KERAS_CLIPPING:
        if getattr(optimizer, name, None) is not None:
            raise ValueError(
                f"`{name}` cannot be combined with a DP optimizer: clipping the "
                "summed gradient does not bound any one example's influence. "
                "DP optimizers clip each example's gradient to `l2_norm_clip`; "
                f"remove `{name}`.")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "A LossScaleOptimizer cannot be wrapped by a DP optimizer: the DP step does "
            "not scale the loss, so the updates would be divided by the loss scale, and "
            "loss scaling would change the clipping bound. Wrap its inner optimizer and "
            "train in float32 or mixed_bfloat16.")
    if getattr(optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            "`loss_scale_factor` is not supported by DP optimizers: loss scaling "
            "would change the clipping bound. Train in float32 or mixed_bfloat16.")
    if getattr(optimizer, "gradient_accumulation_steps", None) not in (None, 1):
        raise ValueError(
            "Set `gradient_accumulation_steps` on the DP optimizer, not on the inner "
            "one: a DP step accumulates micro-batches of one logical batch.")


def _privacy_parameter(name, doc, annotation, field=None):
    """A property reading ``field`` (default ``name``) of the optimizer's
    :class:`PrivacyParameters`; settable (validated) until the step freezes them.
    ``doc`` says what the value is; the docstring adds when it can change;
    ``annotation`` is the value's type (the getter's and setter's annotations)."""
    field = field or name

    def get(self):
        return getattr(self._privacy, field)

    def set_(self, value):
        if self.__dict__.get("_privacy_frozen"):
            raise AttributeError(
                f"`{name}` is frozen: the DP train step was traced with "
                f"{name}={getattr(self._privacy, field)!r}, and what the accountant counts "
                "must be what the step applies. To train on with other privacy parameters, "
                "build a new DP optimizer and compile again; the model's privacy "
                "ledger (keras_dp_lm.ledger_of(model)) keeps counting every update.")
        self._privacy = self._privacy.with_values(**{field: value})
    get.__annotations__.update({"return": annotation})
    set_.__annotations__.update({"value": annotation, "return": "None"})
    return property(get, set_, doc=f"{doc}; settable (validated) until the DP step is "
                    "traced, then read-only.")


@keras.saving.register_keras_serializable(package="keras_dp_lm")
class DPOptimizer(keras.optimizers.Optimizer):
    """Makes any Keras optimizer differentially private.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the
            noised average gradient (learning rate, schedule, weight decay and
            EMA are its own). Keras ``clipnorm``/``clipvalue``/``global_clipnorm``
            and ``loss_scale_factor`` are refused.
        l2_norm_clip: bound C on each example's gradient L2 norm.
        noise_multiplier: sigma; the summed clipped gradient gets Gaussian noise
            of std ``sigma * C`` once per logical batch.
        gradient_accumulation_steps: k. Each batch ``fit`` feeds is one logical
            batch, processed inside one train step as k micro-batches (peak
            memory is a micro-batch's) and noised once; a batch that does not
            divide by k is padded with inert slots. Unlike Keras's argument of
            that name, k calls do not make one update: every train step is
            exactly one noised update.
        expected_batch_size: divisor of the noised sum. ``None`` (default) uses
            the number of examples of the batch (summed over replicas). Required
            with padded (Poisson) batches: ``q * N``.
        seed: integer seed for the noise. ``None`` (default) draws it from OS
            entropy, so two runs never share noise. A given seed is for
            reproducible tests: the noise of update ``i`` is the same in every
            run with that seed, so two released models trained with it (or a
            model whose ledger restarts at zero, e.g. after ``clone_model``)
            share noise that the accountant counts as independent.
        clipping: ``"auto"`` (fast per-layer rules where available, exact
            elsewhere), ``"fast"`` (refuse uncovered layers) or ``"exact"``.
        name: the optimizer's name; default ``"dp_"`` + the inner optimizer's.

    The privacy parameters are frozen once the DP step has been traced.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> opt = kdp.DPOptimizer(keras.optimizers.Lion(1e-4), l2_norm_clip=1.0,
        ...                       noise_multiplier=1.1, seed=0)
        >>> model.compile(optimizer=opt,
        ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        >>> history = model.fit(np.ones((8, 4)), np.zeros((8,)), batch_size=4, verbose=0)
        >>> int(model.optimizer.dp_updates.numpy()), type(opt.inner_optimizer).__name__
        (2, 'Lion')
    """

    _keras_dp_lm_dp_optimizer = True  # what is_dp_optimizer reads (reload-proof)

    is_dp_optimizer = True

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, l2_norm_clip: float,
                 noise_multiplier: float, gradient_accumulation_steps: int = 1,
                 expected_batch_size: float | None = None, seed: int | None = None,
                 clipping: str = "auto", name: str | None = None, **kwargs: Any) -> None:
        for key, default in _BASE_DEFAULTS.items():  # tolerated from old configs only
            if key in kwargs and kwargs.pop(key) not in (default, None):
                raise ValueError(
                    f"DPOptimizer does not take `{key}`: set it on the inner optimizer.")
        if kwargs:
            raise ValueError(f"DPOptimizer does not take {sorted(kwargs)}.")
        _check_inner(inner_optimizer)
        privacy = PrivacyParameters(
            l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
            accumulation_steps=gradient_accumulation_steps,
            expected_batch_size=expected_batch_size, clipping=clipping)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be an integer or None, got {seed!r}.")
        super().__init__(learning_rate=0.0, name=name or f"dp_{inner_optimizer.name}")
        self.inner_optimizer = inner_optimizer
        self._privacy = privacy
        self._privacy_frozen = False
        self.seed = seed
        self._noise_seed = seed if seed is not None else int.from_bytes(
            os.urandom(8), "little") >> 1
        self._apply_guard = threading.local()
        with keras.name_scope(self.name, caller=self):
            self.dp_updates = keras.Variable(
                0, name="dp_updates", dtype="int64", trainable=False,
                aggregation="only_first_replica")
            self.dp_last_batch_size = keras.Variable(
                0.0, name="dp_last_batch_size", dtype="float32",
                trainable=False, aggregation="only_first_replica")
        self._track_variable(self.dp_updates)
        self._track_variable(self.dp_last_batch_size)

    l2_norm_clip = _privacy_parameter(
        "l2_norm_clip", "C, the bound on each example's (or user's) gradient L2 norm",
        "float")
    noise_multiplier = _privacy_parameter(
        "noise_multiplier", "sigma: the summed clipped gradient gets Gaussian noise of "
        "std ``sigma * l2_norm_clip``", "float")
    dp_accumulation_steps = _privacy_parameter(
        "dp_accumulation_steps", "k, the micro-batches of one logical batch (the "
        "``gradient_accumulation_steps`` argument)", "int", "accumulation_steps")
    expected_batch_size = _privacy_parameter(
        "expected_batch_size", "The divisor of the noised sum (``q * N`` for Poisson "
        "batches), or None to divide by the batch's example count", "float | None")
    clipping = _privacy_parameter(
        "clipping", 'The per-example clipping method: ``"auto"``, ``"fast"`` or '
        '``"exact"``', "str")

    @property
    def privacy_parameters(self) -> PrivacyParameters:
        """The :class:`~keras_dp_lm.optimizers.PrivacyParameters` of the next update."""
        return self._privacy

    def freeze_privacy_parameters(self) -> PrivacyParameters:
        """Make the privacy parameters read-only and return them (the DP step calls
        this once per trace and reads every privacy value from what it returns)."""
        self._privacy_frozen = True
        return self._privacy

    # -- delegation to the inner optimizer -----------------------------------
    def build(self, var_list: list[keras.Variable]) -> None:
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self) -> list[keras.Variable]:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> keras.Variable | tf.Tensor:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(
            self, learning_rate: float | keras.optimizers.schedules.LearningRateSchedule) -> None:
        if "inner_optimizer" in self.__dict__:  # the base __init__ sets 0.0 first
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list: list[keras.Variable]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- fail closed -----------------------------------------------------------
    @contextlib.contextmanager
    def _dp_apply_scope(self):
        depth = getattr(self._apply_guard, "depth", 0)
        self._apply_guard.depth = depth + 1
        try:
            yield
        finally:
            self._apply_guard.depth = depth

    def apply(self, grads: Sequence[tf.Tensor],
              trainable_variables: Sequence[keras.Variable] | None = None) -> None:
        if not getattr(self._apply_guard, "depth", 0):
            raise RuntimeError(
                f"{type(self).__name__} refuses gradients that did not come through "
                "the DP train step: they are neither clipped per example nor noised. "
                "Train with `model.fit` on a model compiled with this optimizer, or "
                "in a custom loop call the step returned by "
                "`keras_dp_lm.make_private(model)` instead of `apply_gradients`.")
        return self.inner_optimizer.apply(grads, trainable_variables)

    # -- noise -----------------------------------------------------------------
    def drop_noise_seed(self) -> None:
        """Forget the noise seed. Whoever holds this optimizer object can otherwise
        regenerate every noise draw it added and subtract it from the model's
        weights and Adam's moments: drop it before the object (not a saved file,
        which never holds a seed drawn from OS entropy) leaves your hands. The
        optimizer then refuses further updates; compile with a new one."""
        self._noise_seed = None

    def _noise_like(self, grads, replica_id, num_replicas, update_index, params=None):
        """Gaussian noise of std ``params.noise_std_per_replica(num_replicas)``
        (``params`` default: this optimizer's) for each of ``grads``, from the
        seed folded with ``update_index`` (the model's ledger count: a recompiled
        optimizer with the same ``seed`` continues the sequence, it never replays
        it) and the replica."""
        if self._noise_seed is None:
            raise PrivacyRefusalError(
                "This DP optimizer's noise seed was dropped (drop_noise_seed): it cannot "
                "noise another update. Compile the model with a new DP optimizer.")
        seed = tf.constant([self._noise_seed >> 31, self._noise_seed & 0x7FFFFFFF],
                           dtype=tf.int64)
        seed = tf.random.experimental.stateless_fold_in(
            seed, tf.cast(update_index, tf.int64))
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(replica_id, tf.int64))
        stddev = (params or self._privacy).noise_std_per_replica(num_replicas)
        return [tf.random.stateless_normal(
            tf.shape(grad), seed=tf.random.experimental.stateless_fold_in(seed, index),
            stddev=stddev, dtype=grad.dtype) for index, grad in enumerate(grads)]

    def _apply_clipped_sum(self, params, clipped_sum, trainable_variables, local_batch_size,
                           update_index, public_gradients=None):
        """Noise, normalise and apply a clipped per-example gradient sum.

        Only the DP train step calls this, in replica context, once per logical
        batch. It is private on purpose: it cannot check that its input was
        clipped per example, and it records nothing in the model's ledger (the
        step does), so a caller outside the step would apply an update the
        accountant never counts. Custom loops use the step
        ``keras_dp_lm.make_private(model)`` returns.

        Args:
            params: the :class:`~keras_dp_lm.optimizers.PrivacyParameters` that
                :meth:`freeze_privacy_parameters` returned to the caller (who
                clipped at ``params.l2_norm_clip`` and records
                ``params.noise_multiplier``); anything else is refused.
            clipped_sum: list of tensors, the sum over this replica's examples of
                their clipped gradients (no noise, not divided).
            trainable_variables: the variables the sum belongs to.
            local_batch_size: number of real examples this replica processed.
            update_index: which update of the model this is (its ledger
                count), folded into the noise seed.
            public_gradients: optional gradients of a data-independent term
                (weight regularisation), added after the noised average.
        """
        if params is not self._privacy or not self._privacy_frozen:
            raise PrivacyRefusalError(
                "_apply_clipped_sum takes the PrivacyParameters that this optimizer's "
                "freeze_privacy_parameters() returned, so that the noise drawn here is "
                "the noise the caller clipped for and records in the ledger.")
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise RuntimeError(
                "DP gradients must be applied in a replica context (inside "
                "strategy.run or fit), not in cross-replica context.")
        replica_id, num_replicas = ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
        trainable_variables = list(trainable_variables)
        low = [v.path for v in trainable_variables if sum_dtype(v) != tf.as_dtype(v.dtype)]
        if low and num_replicas > 1:
            raise ValueError(
                "keras_dp_lm does not train 16-bit variables under a multi-replica "
                "strategy: each replica's noised sum would be rounded to the variables' "
                f"dtype before the cross-replica sum (e.g. {low[0]}). Use the "
                "'mixed_bfloat16' policy (float32 variables, bfloat16 compute).")
        # Noise is added to a float32 sum and drawn in float32: a sum rounded to
        # bfloat16 before the noise moves with one example by more than C, and
        # bfloat16 noise takes a few thousand values. The update is rounded to
        # the variables' dtype only after the noise (post-processing).
        grads = [tf.cast(g, sum_dtype(v)) for g, v in zip(clipped_sum, trainable_variables)]
        if params.noise_multiplier > 0:
            grads = [g + n for g, n in zip(grads, self._noise_like(
                grads, replica_id, num_replicas, update_index, params))]
        if params.expected_batch_size is not None:
            divisor = tf.constant(params.expected_batch_size, tf.float32)
        else:
            divisor = tf.cast(local_batch_size, tf.float32)
            if num_replicas > 1:
                divisor = ctx.all_reduce(tf.distribute.ReduceOp.SUM, divisor)
        grads = [g / tf.cast(divisor, g.dtype) for g in grads]
        set_noise_variance = getattr(self.inner_optimizer, "set_dp_noise_variance", None)
        if set_noise_variance is not None:  # e.g. NoiseCorrectedAdam (DP-AdamBC)
            set_noise_variance(tf.square(params.noise_std / divisor))
        if public_gradients is not None:
            # Keras sums across replicas: each contributes 1/R of the term.
            grads = [g if p is None else g + tf.cast(p, g.dtype) / num_replicas
                     for g, p in zip(grads, public_gradients)]
        grads = [tf.cast(g, v.dtype) for g, v in zip(grads, trainable_variables)]
        with self._dp_apply_scope():
            self.apply_gradients(zip(grads, trainable_variables))
        self.dp_updates.assign_add(1)
        self.dp_last_batch_size.assign(divisor)
        return grads

    # -- serialization ---------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "gradient_accumulation_steps": self.dp_accumulation_steps,
            "expected_batch_size": self.expected_batch_size,
            "seed": self.seed,
            "clipping": self.clipping,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any],
                    custom_objects: dict[str, Any] | None = None) -> DPOptimizer:
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects)
        return cls(**config)


def is_dp_optimizer(optimizer: object) -> bool:
    """True when ``optimizer`` is a keras_dp_lm DP optimizer.

    Example:
        >>> import keras
        >>> is_dp_optimizer(keras.optimizers.Adam())
        False
    """
    # By a class marker, not isinstance: after importlib.reload of this module
    # (a notebook's autoreload) DPOptimizer is a new class, and an optimizer
    # made before must still be bound to the DP step, never to Keras's own.
    return getattr(type(optimizer), "_keras_dp_lm_dp_optimizer", False) is True


def make_dp_optimizer(optimizer: keras.optimizers.Optimizer | type[keras.optimizers.Optimizer],
                      l2_norm_clip: float, noise_multiplier: float,
                      gradient_accumulation_steps: int = 1,
                      expected_batch_size: float | None = None, seed: int | None = None,
                      clipping: str = "auto") -> DPOptimizer:
    """Turn any Keras optimizer (instance or class) into a :class:`DPOptimizer`.

    A class is instantiated with its defaults. The other arguments are
    :class:`DPOptimizer`'s: ``l2_norm_clip`` (C), ``noise_multiplier`` (sigma),
    ``gradient_accumulation_steps`` (micro-batches per logical batch, default
    1), ``expected_batch_size`` (divisor of the noised sum; None divides by the
    batch's example count, ``q * N`` is required for Poisson batches), ``seed``
    (noise seed for tests; None draws it from OS entropy) and ``clipping``
    (``"auto"``, ``"fast"`` or ``"exact"``).

    Example:
        >>> import keras
        >>> opt = make_dp_optimizer(keras.optimizers.Lion(1e-4), l2_norm_clip=1.0,
        ...                         noise_multiplier=1.0)
        >>> type(opt).__name__, type(opt.inner_optimizer).__name__, opt.noise_multiplier
        ('DPOptimizer', 'Lion', 1.0)
    """
    if isinstance(optimizer, type):
        if issubclass(optimizer, DPOptimizer):
            raise ValueError("The optimizer is already a DP optimizer.")
        optimizer = optimizer()
    return DPOptimizer(optimizer, l2_norm_clip=l2_norm_clip,
                       noise_multiplier=noise_multiplier,
                       gradient_accumulation_steps=gradient_accumulation_steps,
                       expected_batch_size=expected_batch_size, seed=seed,
                       clipping=clipping)
