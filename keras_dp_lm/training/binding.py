"""The one binding point between keras_dp_lm and Keras: ``compile``.

:func:`install` changes two members of Keras's ``Trainer`` class and nothing
else: ``compile``, which binds the DP step to a model compiled with a DP
optimizer, and the ``dp_ledger`` property, which saves and loads the privacy
ledger with any model's weights. Everything else is bound to one model at a
time, as instance attributes:

* a model compiled with a DP optimizer gets the DP ``train_step``
  (:func:`~keras_dp_lm.training.step.dp_train_step`), its
  ``make_train_function`` and ``_maybe_symbolic_build``, and the guards;
* once the process holds DP-trained weights (a DP step traced, or a file with
  DP updates loaded), every compiled model gets only the guards, compiled
  before or after: ``fit``, ``train_on_batch``, its train functions and
  ``train_step`` refuse, before any update, training its ledger could not
  count (:mod:`keras_dp_lm.training.fit_guards`). They check the weights the
  model holds at each call, so a model that takes DP-trained weights after
  its compile (``Sequential.add``, a layer assigned as an attribute) is
  refused too; a model holding none trains as Keras would;
* until then, any model compiled without a DP optimizer runs Keras's own code.

Not covered: a model compiled before ``import keras_dp_lm`` (the patched
``compile`` never saw it) and calls of Keras's class methods on a model
(``keras.Model.fit(model, ...)``), which skip its instance attributes.

Every touch of Keras's private API is in
:mod:`keras_dp_lm._keras_internals`.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_dp_lm.training import fit_guards
from keras_dp_lm.training import graph_refusals
from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.training import refusals
from keras_dp_lm.training import save_guards
from keras_dp_lm.training.model_ledgers import ledger_of
from keras_dp_lm.training.weight_marks import any_dp_trained
from keras_dp_lm.training.weight_marks import on_marked
from keras_dp_lm.training.weight_marks import register_model
from keras_dp_lm.training.weight_marks import registered_models
from keras_dp_lm.training.model_ledgers import sharing_ledgers
from keras_dp_lm.training.model_ledgers import saved_ledger
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
        try:
            out = preprocess(x, y, sample_weight)
        except (TypeError, ValueError) as error:
            if isinstance(x, dict) and "token_ids" in x:
                raise ValueError(
                    "These batches hold token ids already (as "
                    "poisson_batches(..., preprocessor=model.preprocessor) makes them), "
                    "but the model still has its preprocessor, which expects raw text: "
                    "set `model.preprocessor = None` before fit.") from error
            raise
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


def _keras_compile():
    """Keras's own ``Trainer.compile``, also when this module is reloaded after
    :func:`install` patched it (a notebook's autoreload): the patched method is
    unwrapped, never wrapped again (which recursed without end)."""
    compile_ = internals.Trainer.compile
    while getattr(compile_, "_keras_dp_lm_binding", False):
        compile_ = compile_.__wrapped__
    return compile_


_original_compile = _keras_compile()


@functools.wraps(_original_compile)
def _compile_with_dp_binding(self, *args, **kwargs):
    """``compile``, then the binding: a model compiled with a DP optimizer gets
    the DP step and its guards (instance attributes); a model compiled with
    another optimizer runs Keras's own code until the process holds DP-trained
    weights (then only the guards, which refuse training its ledger could not
    count)."""
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
    register_model(self)
    if is_dp_optimizer(getattr(self, "optimizer", None)):
        _check_train_step_not_overridden(self)
        bind(self)
    else:
        if is_bound_to_dp_step(self):  # recompiled without DP: unbind the step
            for name in ("train_step", "make_train_function", "_maybe_symbolic_build"):
                own.pop(name, None)
        if any_dp_trained():  # it may hold DP-trained weights now or later
            guard(self)
    fit_guards.forget_permission(self)


_compile_with_dp_binding._keras_dp_lm_binding = True


def bind(model):
    """Bind the DP step and its guards to ``model``, compiled with a DP
    optimizer: the one binding function, used by ``compile`` and
    :func:`make_private` alike (so both get the same guards). Instance
    attributes only: ``train_step`` (the DP step), ``make_train_function``
    (probing first), ``_maybe_symbolic_build``, the guards of ``fit`` /
    ``train_on_batch`` / the train functions, the legacy-``.h5`` refusal of
    ``save``, and a KerasHub ``preprocess_samples`` that keeps the real-slot
    mask. A new loss or model is probed again."""
    register_model(model)
    for inner in internals.flatten_layers(model):
        if isinstance(inner, keras.Model):  # saved or reused alone later
            register_model(inner)
    refusals.check_model(model)
    guard(model)
    # Created in the strategy scope compile runs in. The models holding them
    # are guarded when the step marks the weights it trains (weight_marks).
    sharing_ledgers(model)
    save_guards.guard_model(model)
    own = model.__dict__
    model.train_step = types.MethodType(dp_train_step, model)
    own["_maybe_symbolic_build"] = types.MethodType(_symbolic_build_distributed_safe, model)
    # A new loss (or model) is probed again.
    refusals.probe_state(model).reset()
    own.pop(_XLA_CORE, None)
    if not getattr(own.get("make_train_function"), "_keras_dp_lm_binding", False):
        model.make_train_function = _dp_make_train_function(model)
    if hasattr(model, "preprocess_samples"):
        model.preprocess_samples = _keep_real_slots_through(model.preprocess_samples)


def _symbolic_build_distributed_safe(self, iterator=None, data_batch=None):
    """A DP model's ``_maybe_symbolic_build`` (an instance attribute).

    Keras 3.15 averages a distributed batch with ``strategy.reduce`` before
    building. That fails under MultiWorkerMirroredStrategy in eager mode
    ("Attempt to convert a value (PerReplica...)") and under any strategy
    when the replicas' shares differ in size (a Poisson batch of 21 rows on 2
    replicas). Build from the first local replica's batch instead, without
    its real-slot marks: only shapes matter.

    Without a strategy Keras builds a model lazily, in its train function's
    first trace; a DP model with layers not yet built (a subclassed model
    never called before ``fit``) is built here instead, before the
    independence probe (which would create the variables in a trace of its
    own), from the dataset's element spec: no batch is drawn."""
    keras_build = type(self)._maybe_symbolic_build
    strategy = self._distribute_strategy
    if strategy is None:
        if not _unbuilt_dp_model(self):
            return keras_build(self, iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            data_batch = internals.epoch_iterator_element_spec(iterator)
        if data_batch is None:
            return keras_build(self, iterator=iterator, data_batch=data_batch)
    elif iterator is None:
        return keras_build(self, iterator=iterator, data_batch=data_batch)
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


def is_bound_to_dp_step(model):
    """Whether ``model`` was compiled for DP (its ``train_step`` is the DP step)."""
    bound = model.__dict__.get("train_step")
    # By a marker, not identity: a model compiled before an importlib.reload of
    # keras_dp_lm.training.step holds the step of the module's earlier run.
    return isinstance(bound, types.MethodType) and getattr(
        bound.__func__, "_keras_dp_lm_dp_step", False) is True


# -- the guards: instance attributes of a DP model, or of a model holding
# -- DP-trained weights; Keras's classes are untouched ---------------------------

def _guarded_fit(self, *args, **kwargs):
    """``fit``, refused first if the ledger could not count it
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`); the
    limits a :class:`PrivacyAccountant` registered on the model's ledger are
    cleared after it, also when it raised (Keras then skips ``on_train_end``):
    stale limits would check, and record the rate of, later fits that have no
    accountant."""
    fit_guards.check_training_is_private(
        self, is_bound_to_dp_step(self),
        kwargs.get("callbacks", args[5] if len(args) > 5 else None),
        kwargs.get("validation_split", args[6] if len(args) > 6 else 0.0),
        kwargs.get("validation_data", args[7] if len(args) > 7 else None))
    x = kwargs.get("x", args[0] if args else None)
    if (isinstance(x, tf.data.Dataset) and len(args) <= 8 and "shuffle" not in kwargs
            and is_bound_to_dp_step(self)):
        # Keras ignores `shuffle` for a dataset but warns about its default; a DP
        # fit's Poisson batches must not be reshuffled, and are not. A model
        # without the DP step (guarded for the DP weights it holds) is left as is.
        kwargs["shuffle"] = False
    try:
        # a refusal the step decides on the batch's values raises in words
        with graph_refusals.raised_as_privacy_refusals():
            return type(self).fit(self, *args, **kwargs)
    finally:
        ledger = ledger_of(self, create=False)
        if ledger is not None:
            ledger.clear_limits()


def _guarded_train_on_batch(self, *args, **kwargs):
    """``train_on_batch``, refused first if the ledger could not count it."""
    fit_guards.check_training_is_private(self, is_bound_to_dp_step(self))
    with graph_refusals.raised_as_privacy_refusals():
        return type(self).train_on_batch(self, *args, **kwargs)


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
        dp = is_bound_to_dp_step(model)
        fit_guards.check_training_is_private(model, dp)
        if dp and _sharing_grew(model):
            model.make_train_function(force=True)
            return model.train_function(*args, **kwargs)
        return self._function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _guarded_make_train_function(self, force=False):
    """``make_train_function``, whose train function refuses, before each call,
    training the ledger could not count: ``fit`` and ``train_on_batch`` call
    it, and so may a user."""
    type(self).make_train_function(self, force)
    function = self.train_function
    if function is not None and not getattr(function, "_keras_dp_lm_checked", False):
        function = self.train_function = _CheckedTrainFunction(self, function)
    return function


def _guarded_train_step(self, data):
    """Keras's ``train_step`` (or the model's own), refused first if the ledger
    could not count it (a custom loop calling ``model.train_step`` on
    DP-trained weights with a non-DP optimizer); inside ``fit`` it
    runs when the step is traced (the ledger is read eagerly)."""
    with tf.init_scope():
        fit_guards.check_training_is_private(self, is_bound_to_dp_step(self))
    return type(self).train_step(self, data)


_GUARDS = {"fit": _guarded_fit, "train_on_batch": _guarded_train_on_batch,
           "make_train_function": _guarded_make_train_function,
           "train_step": _guarded_train_step}


def guard(model):
    """Bind the guards to ``model`` (idempotent): ``fit``, ``train_on_batch``,
    every train function and ``train_step`` refuse, before any update,
    training the ledger could not count
    (:func:`~keras_dp_lm.training.fit_guards.check_training_is_private`).
    Instance attributes only; a DP step or a DP ``make_train_function`` the
    model already has is kept (it wraps the guarded one)."""
    own = model.__dict__
    for name, function in _GUARDS.items():
        if name not in own:
            own[name] = types.MethodType(function, model)
    function = getattr(model, "train_function", None)  # made before the guards
    if function is not None and not getattr(function, "_keras_dp_lm_checked", False):
        model.train_function = _CheckedTrainFunction(model, function)


def guard_registered_models():
    """:func:`guard` every registered model (compiled, or with a ledger): the
    process holds DP-trained weights, and a model compiled before may take
    them later without a compile."""
    for model in registered_models():
        guard(model)


# Once weights are marked, every registered model gets the guards (idempotent),
# holding those weights or not: one compiled earlier may take them later
# without a compile (``Sequential.add``, a layer assigned as an attribute).
# Models compiled from then on are guarded at compile.
on_marked("binding", lambda model: guard_registered_models())


def install() -> None:
    """Patch ``keras.Model.compile`` (the binding point) and add the
    ``dp_ledger`` property (idempotent).

    These are the only class members keras_dp_lm changes. ``compile`` with a
    DP optimizer binds the DP step and its guards to that model, as instance
    attributes; a model compiled with another optimizer runs Keras's own code
    until the process holds DP-trained weights (then its guards refuse training
    the ledger could not count). ``dp_ledger`` lets every model's file carry its
    privacy ledger, and any model (even one never compiled) read it back: a
    model loading a DP file must count the updates its weights received.
    """
    trainer = internals.Trainer
    if trainer.compile is not _compile_with_dp_binding:
        trainer.compile = _compile_with_dp_binding
    if not isinstance(getattr(trainer, "dp_ledger", None), property):
        trainer.dp_ledger = property(
            saved_ledger, doc="The model's privacy ledger (keras_dp_lm.ledger_of).")


def make_private(model: keras.Model) -> Callable[[Any], dict[str, tf.Tensor]]:
    """Bind the DP train step to a model compiled with a DP optimizer.

    ``model.compile`` does this automatically once keras_dp_lm is imported.
    Returns a callable ``step(data) -> logs`` (a ``tf.function``) for custom
    training loops: it performs exactly the update ``fit`` would.

    Example:
        >>> import keras, numpy as np, keras_dp_lm as kdp
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=kdp.DPSGD(0.1, l2_norm_clip=1.0,
        ...                                   noise_multiplier=1.0), loss="mse")
        >>> step = kdp.make_private(model)
        >>> logs = step((np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")))
        >>> kdp.ledger_of(model).updates
        1
    """
    if not is_dp_optimizer(getattr(model, "optimizer", None)):
        raise ValueError(
            "make_private(model) needs a model compiled with a keras_dp_lm DP "
            "optimizer, e.g. model.compile(optimizer=keras_dp_lm.DPAdam(...), loss=...).")
    bind(model)  # the guards compile binds, and the DP step
    ledger_of(model)
    model.train_function = None

    def one_step(data):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            logs = strategy.run(model.train_step, args=(data,))
            return strategy.experimental_local_results(logs)[0]
        return model.train_step(data)

    traced = [tf.function(one_step, autograph=False)]

    def run(data):
        if not model.built:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            model(x)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if _sharing_grew(model):  # traced anew, so that model's ledger records it
            traced[0] = tf.function(one_step, autograph=False)
        with graph_refusals.raised_as_privacy_refusals():
            return traced[0](data)

    return run
