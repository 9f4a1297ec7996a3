"""The binding of the DP train step to Keras's trainer: ``install()``.

:func:`install` patches Keras's trainer classes (idempotently): ``compile``
with a DP optimizer binds :func:`~keras_dp_lm.training.step.dp_train_step`
to the model; ``fit``, ``train_on_batch``, every train function and Keras's
own ``train_step`` refuse training the ledger could not count
(:mod:`keras_dp_lm.training.fit_guards`); every model is registered for
:func:`~keras_dp_lm.training.ledger.sharing_ledgers` and gets a ``dp_ledger``
property. Every touch of Keras's private API is in
:mod:`keras_dp_lm.training.keras_internals`.
"""

import contextlib
import functools
import types

import keras
import tensorflow as tf

from keras_dp_lm.training import fit_guards
from keras_dp_lm.training import keras_internals as internals
from keras_dp_lm.training import refusals
from keras_dp_lm.training import save_guards
from keras_dp_lm.training.ledger import ledger_of
from keras_dp_lm.training.ledger import register_model
from keras_dp_lm.training.ledger import sharing_ledgers
from keras_dp_lm.training.ledger import saved_ledger
from keras_dp_lm.training.probing import _PROBE
from keras_dp_lm.training.probing import _train_function_probing_first
from keras_dp_lm.training.step import _XLA_CORE
from keras_dp_lm.training.step import _sharing_grew
from keras_dp_lm.training.step import dp_train_step
from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.data import attach_real_slots
from keras_dp_lm.data import split_real_slots
from keras_dp_lm.errors import PrivacyRefusalError

tree = internals.tree


def _check_train_step_not_overridden(model):
    step = type(model).train_step
    if step is not internals.TensorFlowTrainer.train_step:
        raise PrivacyRefusalError(
            f"{type(model).__name__} overrides train_step(), so model.fit would "
            "bypass per-example clipping and noise. Remove the override (put "
            "custom losses in `compute_per_example_loss(x, y, y_pred, "
            "sample_weight)`), or train with the step returned by "
            "`keras_dp_lm.make_private(model)` in a custom loop.")


def _keep_real_slots_through(preprocess):
    """Wrap a KerasHub ``preprocess_samples`` so the real-slot mask survives it.

    KerasHub preprocessors build their own ``sample_weight`` (the padding
    mask) and drop the one they are given: without this, padding slots of a
    Poisson batch of raw strings would train with full weight.
    """
    if getattr(preprocess, "_keras_dp_lm_keeps_slots", False):
        return preprocess

    def wrapped(x, y=None, sample_weight=None):
        mask, rate, sample_weight = split_real_slots(sample_weight)
        out = preprocess(x, y, sample_weight)
        if mask is None:
            return out
        px, py, psw = keras.utils.unpack_x_y_sample_weight(out)
        return px, py, attach_real_slots(psw, mask, rate)

    wrapped._keras_dp_lm_keeps_slots = True
    return wrapped


def _dp_make_train_function(model):
    """``model.make_train_function`` for a DP model.

    * With ``jit_compile=True`` Keras's step is built without XLA and the DP
      step compiles its own core instead (:func:`_clipping_core`);
      ``model.jit_compile`` stays what the user set.
    * The train function it returns runs fast clipping's independence probe
      before the first step, as a call of its own
      (:func:`_train_function_probing_first`).
    """
    make = model.make_train_function

    def build(force):
        if not model.jit_compile:
            return make(force)
        model.jit_compile = False
        try:
            return make(force)
        finally:
            model.jit_compile = True

    def make_train_function(force=False):
        build(force)  # sets model.train_function, which fit and train_on_batch call
        function = model.train_function
        if not getattr(function, "_keras_dp_lm_probes_first", False):
            function = model.train_function = _train_function_probing_first(model, function)
        return function

    make_train_function._keras_dp_lm_binding = True
    return make_train_function


_original_compile = internals.Trainer.compile


@functools.wraps(_original_compile)
def _compile_with_dp_binding(self, *args, **kwargs):
    _original_compile(self, *args, **kwargs)
    own = self.__dict__
    if is_dp_optimizer(getattr(getattr(self, "optimizer", None), "inner_optimizer", None)):
        raise PrivacyRefusalError(
            "Keras wrapped the DP optimizer in a LossScaleOptimizer (the "
            "'mixed_float16' policy). Dynamic loss scaling multiplies the loss before "
            "per-example clipping and skips or rescales updates, so the clipping bound "
            "and the noise no longer match what is accounted. Use the "
            "'mixed_bfloat16' policy (supported: clipping arithmetic runs in float32) "
            "or float32.")
    if is_dp_optimizer(getattr(self, "optimizer", None)):
        _check_train_step_not_overridden(self)
        refusals.check_model(self)
        sharing_ledgers(self)  # created in the strategy scope compile runs in
        save_guards.guard_model(self)
        self.train_step = types.MethodType(dp_train_step, self)
        # A new loss (or model) is probed again, by a probe traced anew.
        refusals.probe_state(self).reset()
        self.__dict__.pop(_PROBE, None)
        self.__dict__.pop(_XLA_CORE, None)
        if not getattr(own.get("make_train_function"), "_keras_dp_lm_binding", False):
            self.make_train_function = _dp_make_train_function(self)
        if hasattr(self, "preprocess_samples"):
            self.preprocess_samples = _keep_real_slots_through(self.preprocess_samples)
    elif _bound_to_dp_step(self):
        del own["train_step"]  # recompiled without DP: unbind
        own.pop("make_train_function", None)
    fit_guards.forget_permission(self)


_original_symbolic_build = internals.TensorFlowTrainer._maybe_symbolic_build


def _symbolic_build_distributed_safe(self, iterator=None, data_batch=None):
    """Keras 3.15 averages a distributed batch with ``strategy.reduce`` before
    building. That fails under MultiWorkerMirroredStrategy in eager mode
    ("Attempt to convert a value (PerReplica...)"), even for plain Adam, and
    under any strategy when the replicas' shares differ in size (a Poisson
    batch of 21 rows on 2 replicas). Build from the first local replica's
    batch instead, without its real-slot marks: only shapes matter.

    Without a strategy Keras builds a model lazily, in its train function's
    first trace; a DP model with layers not yet built (a subclassed model
    never called before ``fit``) is built here instead, before the
    independence probe (which would create the variables in a trace of its
    own), from the dataset's element spec: no batch is drawn."""
    strategy = self._distribute_strategy
    if strategy is None:
        if not _unbuilt_dp_model(self):
            return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            data_batch = internals.epoch_iterator_element_spec(iterator)
        if data_batch is None:
            return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    elif iterator is None:
        return _original_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    else:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v, batch)
            break
    # Keras computes the loss on it: hand it the loss's own sample_weight,
    # not the real-slot marks.
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
    data_batch = keras.utils.pack_x_y_sample_weight(x, y, split_real_slots(sample_weight)[2])
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        self._symbolic_build(data_batch=data_batch)


def _unbuilt_dp_model(model):
    """A model with a DP optimizer and layers not built yet."""
    return is_dp_optimizer(getattr(model, "optimizer", None)) and not all(
        layer.built for layer in internals.flatten_layers(model, include_self=True))


_original_fit = internals.TensorFlowTrainer.fit


@functools.wraps(_original_fit)
def _fit_releasing_limits(self, *args, **kwargs):
    """``fit``, after which the limits a :class:`PrivacyAccountant` registered
    on the model's ledger are cleared also when the fit raised (Keras then
    skips ``on_train_end``): stale limits would check, and record the rate
    of, later fits that have no accountant. Training the ledger could not
    count is refused first
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`)."""
    fit_guards.check_training_is_private(
        self, _bound_to_dp_step(self),
        kwargs.get("callbacks", args[5] if len(args) > 5 else None),
        kwargs.get("validation_split", args[6] if len(args) > 6 else 0.0),
        kwargs.get("validation_data", args[7] if len(args) > 7 else None))
    try:
        return _original_fit(self, *args, **kwargs)
    finally:
        ledger = ledger_of(self, create=False)
        if ledger is not None:
            ledger.clear_limits()


def _bound_to_dp_step(model):
    """Whether ``model`` was compiled for DP (its ``train_step`` is the DP step)."""
    bound = model.__dict__.get("train_step")
    return isinstance(bound, types.MethodType) and bound.__func__ is dp_train_step


_original_train_on_batch = internals.TensorFlowTrainer.train_on_batch


@functools.wraps(_original_train_on_batch)
def _train_on_batch_checked(self, *args, **kwargs):
    """``train_on_batch``, refused first if the ledger could not count it
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`)."""
    fit_guards.check_training_is_private(self, _bound_to_dp_step(self))
    return _original_train_on_batch(self, *args, **kwargs)


_original_make_train_function = internals.TensorFlowTrainer.make_train_function


class _CheckedTrainFunction:
    """A model's train function that refuses, before each call, training the
    ledger could not count; its other attributes are the wrapped function's
    (TensorBoard reads a ``tf.function``'s graph)."""

    _keras_dp_lm_checked = True

    def __init__(self, model, function):
        self._model = model
        self._function = function

    def __call__(self, *args, **kwargs):
        model = self._model
        dp = _bound_to_dp_step(model)
        fit_guards.check_training_is_private(model, dp)
        if dp and _sharing_grew(model):
            model.make_train_function(force=True)
            return model.train_function(*args, **kwargs)
        return self._function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._function, name)


@functools.wraps(_original_make_train_function)
def _make_checked_train_function(self, force=False):
    """``make_train_function``, whose train function refuses, before each call,
    training the ledger could not count
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`): ``fit``
    and ``train_on_batch`` call it, and so may a user (r34c C5)."""
    _original_make_train_function(self, force)
    function = self.train_function
    if function is not None and not getattr(function, "_keras_dp_lm_checked", False):
        function = self.train_function = _CheckedTrainFunction(self, function)
    return function


_original_trainer_init = internals.TensorFlowTrainer.__init__


@functools.wraps(_original_trainer_init)
def _trainer_init_registering(self, *args, **kwargs):
    """Keras's trainer ``__init__``; the model is then registered (weakly) so
    that DP steps training its weights through another model record them in
    its ledger (:func:`~keras_dp_lm.training.ledger.sharing_ledgers`)."""
    _original_trainer_init(self, *args, **kwargs)
    register_model(self)


_original_train_step = internals.TensorFlowTrainer.train_step


@functools.wraps(_original_train_step)
def _checked_train_step(self, data):
    """Keras's ``train_step``, refused first if the ledger could not count it
    (a custom loop calling ``model.train_step`` on DP-trained weights with a
    non-DP optimizer, r34c C5); inside ``fit`` it runs when the step is traced
    (the ledger is read eagerly)."""
    with tf.init_scope():
        fit_guards.check_training_is_private(self, _bound_to_dp_step(self))
    return _original_train_step(self, data)


def install():
    """Patch ``keras.Model.compile`` so DP optimizers bind the DP step (idempotent).

    Also gives every model a ``dp_ledger`` property, so the privacy ledger is
    saved and loaded with the model's weights (``.keras``, ``.weights.h5``),
    clears an accountant's limits after every ``fit`` (also one that raised),
    refuses training the ledger could not count in ``fit``, ``train_on_batch``,
    every train function (also one made and called by hand) and Keras's own
    ``train_step`` (:mod:`keras_dp_lm.training.fit_guards`), registers every
    model (weakly) so that a DP step records its updates in the ledger of every
    model whose weights it trains, and works around Keras's distributed build failure (uneven replica
    shares, MultiWorkerMirroredStrategy).
    """
    trainer = internals.Trainer
    if trainer.compile is not _compile_with_dp_binding:
        trainer.compile = _compile_with_dp_binding
    if not isinstance(getattr(trainer, "dp_ledger", None), property):
        trainer.dp_ledger = property(
            saved_ledger, doc="The model's privacy ledger (keras_dp_lm.ledger_of).")
    tf_trainer = internals.TensorFlowTrainer
    if tf_trainer.fit is not _fit_releasing_limits:
        tf_trainer.fit = _fit_releasing_limits
    if tf_trainer.train_on_batch is not _train_on_batch_checked:
        tf_trainer.train_on_batch = _train_on_batch_checked
    if tf_trainer.__init__ is not _trainer_init_registering:
        tf_trainer.__init__ = _trainer_init_registering
    if tf_trainer.make_train_function is not _make_checked_train_function:
        tf_trainer.make_train_function = _make_checked_train_function
    if tf_trainer.train_step is not _checked_train_step:
        tf_trainer.train_step = _checked_train_step
    if tf_trainer._maybe_symbolic_build is not _symbolic_build_distributed_safe:
        tf_trainer._maybe_symbolic_build = _symbolic_build_distributed_safe
