"""DP optimizers: any Keras optimizer plus per-example clipping and Gaussian noise.

A DP optimizer owns the privacy parameters (``l2_norm_clip``,
``noise_multiplier``), gradient accumulation (``gradient_accumulation_steps``
micro-batches per logical batch), noise generation and the division by the
logical batch size. The per-example work (losses, gradients, clipping) happens
in the DP train step (:mod:`keras_dp_lm.training`), which hands the clipped sum
to :meth:`DPOptimizerMixin._apply_clipped_sum` (private: it trusts its input to be clipped). Any other route to
``apply_gradients`` raises: a DP optimizer never applies a gradient that was not
clipped per example and noised.

Semantics of one update, on ``R`` replicas with logical batch ``B``::

    update = base_optimizer((sum_i clip(g_i) + N(0, (noise_multiplier * l2_norm_clip)^2 I)) / B)

Each replica adds independent noise of std ``noise_multiplier * l2_norm_clip /
sqrt(R)``; Keras sums gradients across replicas, so the total noise has exactly
the std above whatever ``R`` is.

Example:
    >>> import keras, numpy as np, keras_dp_lm as kdp
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer=kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=1.0,
    ...                                    noise_multiplier=1.1, seed=0),
    ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> history = model.fit(np.ones((8, 4)), np.zeros((8,)), batch_size=4, verbose=0)
    >>> int(model.optimizer.dp_updates.numpy())
    2
"""

import contextlib
import math
import os
import threading

import keras
import tensorflow as tf

CLIPPING_METHODS = ("auto", "fast", "exact")


def _check_positive(name, value, allow_zero=False):
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number, got {value!r}.") from None
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"`{name}` must be finite, got {value!r}.")
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"`{name}` must be {bound}, got {value!r}.")
    return number


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int,)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


class DPOptimizerMixin:
    """Adds differential privacy to a Keras optimizer class.

    Do not use directly: use :class:`DPSGD`, :class:`DPAdam`, :class:`DPAdamW` or
    :func:`make_dp_optimizer`.

    Args:
        l2_norm_clip: bound C on each example's gradient L2 norm.
        noise_multiplier: sigma; the summed clipped gradient gets Gaussian noise
            of std ``sigma * C`` once per logical batch.
        gradient_accumulation_steps: k. Each batch that ``fit`` feeds is one
            logical batch, processed inside one train step as k micro-batches of
            ``B / k`` examples (so peak memory is that of a micro-batch) and
            noised once. ``B`` must be divisible by k. Unlike Keras's own
            argument of that name, k calls do not make one update: every train
            step is exactly one noised update, which keeps the privacy ledger,
            ``steps_per_execution`` and multi-replica training simple.
        expected_batch_size: divisor of the noised sum. ``None`` (default) uses
            the size of the batch fed to ``fit`` (summed over replicas). Set it
            to ``q * N`` with Poisson-sampled, padded batches.
        seed: integer seed for the noise. ``None`` (default) draws the seed from
            OS entropy, so two runs never share noise.
        clipping: ``"auto"`` (fast per-layer rules where available, exact
            elsewhere), ``"fast"`` (refuse uncovered layers) or ``"exact"``.
    """

    is_dp_optimizer = True

    def __init__(self, *args, l2_norm_clip, noise_multiplier,
                 gradient_accumulation_steps=1, expected_batch_size=None,
                 seed=None, clipping="auto", **kwargs):
        l2_norm_clip = _check_positive("l2_norm_clip", l2_norm_clip)
        noise_multiplier = _check_positive(
            "noise_multiplier", noise_multiplier, allow_zero=True)
        accumulation = _check_positive_int(
            "gradient_accumulation_steps",
            1 if gradient_accumulation_steps is None else gradient_accumulation_steps)
        if expected_batch_size is not None:
            expected_batch_size = _check_positive(
                "expected_batch_size", expected_batch_size)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be an integer or None, got {seed!r}.")
        if clipping not in CLIPPING_METHODS:
            raise ValueError(
                f"`clipping` must be one of {CLIPPING_METHODS}, got {clipping!r}.")
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"`{name}` cannot be combined with a DP optimizer: clipping the "
                    "summed gradient does not bound any one example's influence. "
                    "DP optimizers clip each example's gradient to `l2_norm_clip`; "
                    f"remove `{name}`.")
        if kwargs.get("loss_scale_factor") is not None:
            raise ValueError(
                "`loss_scale_factor` is not supported by DP optimizers: loss "
                "scaling would change the clipping bound. Train in float32.")
        super().__init__(*args, **kwargs)
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.dp_accumulation_steps = accumulation
        self.expected_batch_size = expected_batch_size
        self.seed = seed
        self.clipping = clipping
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

    # ``gradient_accumulation_steps`` belongs to the DP step, never to Keras's
    # own accumulation (which breaks under MirroredStrategy, keras#20582).
    # Inside Keras's own build/apply the property reads None, so the base class
    # never runs its accumulation branch.
    @property
    def gradient_accumulation_steps(self):
        guard = self.__dict__.get("_apply_guard")
        if guard is None or getattr(guard, "hide", False):
            return None
        return getattr(self, "dp_accumulation_steps", 1)

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        if value not in (None, 1, getattr(self, "dp_accumulation_steps", 1)):
            raise ValueError(
                "Set `gradient_accumulation_steps` when constructing the DP "
                "optimizer; it cannot be changed afterwards.")

    @property
    def iterations(self):
        return self._iterations

    # -- fail closed -------------------------------------------------------
    @contextlib.contextmanager
    def _dp_apply_scope(self):
        depth = getattr(self._apply_guard, "depth", 0)
        self._apply_guard.depth = depth + 1
        try:
            yield
        finally:
            self._apply_guard.depth = depth

    def apply(self, grads, trainable_variables=None):
        if not getattr(self._apply_guard, "depth", 0):
            raise RuntimeError(
                f"{type(self).__name__} refuses gradients that did not come "
                "through the DP train step: they are neither clipped per example "
                "nor noised. Train with `model.fit` on a model compiled with this "
                "optimizer, or in a custom loop call the step returned by "
                "`keras_dp_lm.make_private(model)` instead of `apply_gradients`.")
        with self._keras_accumulation_hidden():
            return super().apply(grads, trainable_variables)

    def build(self, variables):
        with self._keras_accumulation_hidden():
            return super().build(variables)

    @contextlib.contextmanager
    def _keras_accumulation_hidden(self):
        previous = getattr(self._apply_guard, "hide", False)
        self._apply_guard.hide = True
        try:
            yield
        finally:
            self._apply_guard.hide = previous

    # -- noise -------------------------------------------------------------
    def _replica_index_and_count(self):
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise RuntimeError(
                "DP gradients must be applied in a replica context (inside "
                "strategy.run or fit), not in cross-replica context.")
        return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync

    def noise_stddev_per_replica(self, num_replicas):
        """Std of the noise each replica adds so that the sum has ``sigma * C``."""
        return self.noise_multiplier * self.l2_norm_clip / math.sqrt(num_replicas)

    def _noise_like(self, variables_and_grads, replica_id, num_replicas):
        seed = tf.constant([self._noise_seed >> 31, self._noise_seed & 0x7FFFFFFF],
                           dtype=tf.int64)
        seed = tf.random.experimental.stateless_fold_in(
            seed, tf.cast(self.dp_updates.value, tf.int64))
        seed = tf.random.experimental.stateless_fold_in(
            seed, tf.cast(replica_id, tf.int64))
        stddev = self.noise_stddev_per_replica(num_replicas)
        noises = []
        for index, grad in enumerate(variables_and_grads):
            var_seed = tf.random.experimental.stateless_fold_in(seed, index)
            noises.append(tf.random.stateless_normal(
                tf.shape(grad), seed=var_seed, stddev=stddev, dtype=grad.dtype))
        return noises

    def _apply_clipped_sum(self, clipped_sum, trainable_variables, local_batch_size,
                           public_gradients=None):
        """Noise, normalise and apply a clipped per-example gradient sum.

        Called only by the DP train step (:mod:`keras_dp_lm.training`), in
        replica context, once per logical batch. It cannot check that its input
        was clipped per example, so it is not public API: custom loops use
        ``keras_dp_lm.make_private(model)``.

        Args:
            clipped_sum: list of tensors, the sum over this replica's examples of
                their clipped gradients (no noise, not divided).
            trainable_variables: the variables the sum belongs to.
            local_batch_size: number of examples (real or padded) this replica
                processed for this logical batch.
            public_gradients: optional gradients of a data-independent term
                (weight regularisation), added after the noised average.
        """
        replica_id, num_replicas = self._replica_index_and_count()
        grads = [tf.convert_to_tensor(g) for g in clipped_sum]
        if self.noise_multiplier > 0:
            noises = self._noise_like(grads, replica_id, num_replicas)
            grads = [g + n for g, n in zip(grads, noises)]
        if self.expected_batch_size is not None:
            divisor = tf.constant(self.expected_batch_size, tf.float32)
        else:
            divisor = tf.cast(local_batch_size, tf.float32)
            if num_replicas > 1:
                ctx = tf.distribute.get_replica_context()
                divisor = ctx.all_reduce(tf.distribute.ReduceOp.SUM, divisor)
        grads = [g / tf.cast(divisor, g.dtype) for g in grads]
        if public_gradients is not None:
            # Keras sums across replicas: each contributes 1/R of the term.
            grads = [g if p is None else g + p / num_replicas
                     for g, p in zip(grads, public_gradients)]
        with self._dp_apply_scope():
            self.apply_gradients(zip(grads, trainable_variables))
        self.dp_updates.assign_add(1)
        self.dp_last_batch_size.assign(divisor)
        return grads

    # -- serialization -----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config["gradient_accumulation_steps"] = self.dp_accumulation_steps
        config.update({
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
            "seed": self.seed,
            "clipping": self.clipping,
        })
        return config


_DP_CLASSES = {}


def dp_optimizer_class(base_class):
    """Return (and cache) the DP subclass of a Keras optimizer class."""
    if issubclass(base_class, DPOptimizerMixin):
        return base_class
    if base_class not in _DP_CLASSES:
        name = "DP" + base_class.__name__
        cls = type(name, (DPOptimizerMixin, base_class), {
            "__doc__": f"Differentially private {base_class.__name__}.\n\n"
                       + DPOptimizerMixin.__doc__.split("\n\n", 2)[2],
            "__module__": __name__,
        })
        cls = keras.saving.register_keras_serializable(package="keras_dp_lm")(cls)
        _DP_CLASSES[base_class] = cls
    return _DP_CLASSES[base_class]


def make_dp_optimizer(optimizer, l2_norm_clip, noise_multiplier,
                      gradient_accumulation_steps=1, expected_batch_size=None,
                      seed=None, clipping="auto"):
    """Turn any Keras optimizer (instance or class) into a DP optimizer.

    The optimizer's own settings (learning rate, schedules, weight decay, ...)
    are kept. Keras ``clipnorm``/``clipvalue``/``global_clipnorm`` are refused.

    Example:
        >>> import keras, keras_dp_lm as kdp
        >>> opt = kdp.make_dp_optimizer(keras.optimizers.Lion(1e-4),
        ...                             l2_norm_clip=1.0, noise_multiplier=1.0)
        >>> type(opt).__name__, opt.noise_multiplier
        ('DPLion', 1.0)
    """
    if isinstance(optimizer, type):
        base_class, config = optimizer, {}
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        if getattr(optimizer, "built", False):
            raise ValueError("make_dp_optimizer needs an optimizer that has not "
                             "been used yet (its state would be lost).")
        base_class = type(optimizer)
        config = optimizer.get_config()
        config.pop("name", None)
        if config.get("gradient_accumulation_steps"):
            raise ValueError(
                "Pass gradient_accumulation_steps to make_dp_optimizer, not to "
                "the base optimizer: Keras's own accumulation is not DP-aware.")
        config.pop("gradient_accumulation_steps", None)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):  # a serialized schedule: keep the live object
            config["learning_rate"] = optimizer._learning_rate
    else:
        raise TypeError(
            f"make_dp_optimizer expects a keras.optimizers.Optimizer, got {optimizer!r}.")
    if isinstance(base_class, type) and issubclass(base_class, DPOptimizerMixin):
        raise ValueError("The optimizer is already a DP optimizer.")
    cls = dp_optimizer_class(base_class)
    return cls(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
               gradient_accumulation_steps=gradient_accumulation_steps,
               expected_batch_size=expected_batch_size, seed=seed,
               clipping=clipping, **config)


DPSGD = dp_optimizer_class(keras.optimizers.SGD)
DPAdam = dp_optimizer_class(keras.optimizers.Adam)
DPAdamW = dp_optimizer_class(keras.optimizers.AdamW)


def is_dp_optimizer(optimizer):
    """True when ``optimizer`` is a keras_dp_lm DP optimizer."""
    return isinstance(optimizer, DPOptimizerMixin)
