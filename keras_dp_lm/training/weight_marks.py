"""Which weights DP training has touched, and which models to tell.

A DP step (or a load of a file with DP updates) marks the variables it
trained with the ledger that counts those updates (:func:`mark_dp_trained`);
any model holding a marked variable then refuses non-DP training, and a
ledger created later for a model built on them starts from those updates.
Once anything is marked, every compiled model carries the guards, which check
at each fit and train-function call which weights it holds then.
Models register when compiled or when their ledger is created
(:func:`register_model`), so that a DP step also records its updates in
the ledgers of the other models holding the weights it trains. This is the
lowest floor of ``training/``: the floors above act on marks through
:func:`on_marked` listeners, never by an import from here.

Example:
    >>> import keras
    >>> from keras_dp_lm.training.weight_marks import is_dp_trained
    >>> is_dp_trained(keras.Variable(1.0))
    False
"""

import weakref

import tensorflow as tf


def marking_ledgers(model):
    """The ledgers that marked any of ``model``'s variables (:func:`mark_dp_trained`)."""
    found = {}
    for variable in model.weights:
        for ledger in getattr(variable, _DP_TRAINED, ()):
            found[id(ledger)] = ledger
    return list(found.values())


# Process state survives importlib.reload (a notebook's autoreload re-runs this
# file in the same namespace): a fresh value would forget every registered model
# and every DP-trained weight, and so clear the refusals that depend on them.
if "_MODELS" not in globals():
    _MODELS = weakref.WeakSet()  # models compiled, or whose ledger was read (registered)
    _REGISTERED = [0]  # how many models have registered so far


def register_model(model):
    """Remember ``model`` (weakly), so that a DP step training its weights
    through another model records the update in its ledger
    (:func:`sharing_ledgers`), and so that it refuses non-DP training once
    they are DP-trained (:func:`mark_dp_trained`). A model registers when it
    is compiled (:mod:`keras_dp_lm.training.binding`) and when its ledger is
    created; a model that is neither has no ledger to update, and the one it
    gets later starts from what its weights received (:meth:`PrivacyLedger.inherit`)."""
    if model not in _MODELS:
        _MODELS.add(model)
        _REGISTERED[0] += 1


def registered_models():
    """The models alive that registered (:func:`register_model`)."""
    return list(_MODELS)


def models_registered():
    """How many models have registered so far (:func:`register_model`): a
    traced DP step whose value is older may miss a model sharing its weights."""
    return _REGISTERED[0]


_DP_TRAINED = "_keras_dp_lm_dp_trained"
if "_ANY_MARKED" not in globals():  # kept across a reload, as _MODELS is
    _ANY_MARKED = [False]  # set once any variable in this process is marked


if "_LISTENERS" not in globals():  # kept across a reload, as _MODELS is
    _LISTENERS = {}  # name -> listener(model or None), called after every mark


def on_marked(name, listener):
    """Call ``listener(model)`` after every :func:`mark_dp_trained`, with the
    model whose file brought the DP updates (``None`` for a DP step). The
    floors above this one act on marks through it, so nothing here imports
    them: the binding guards every registered model, the save guards a model
    loaded with DP updates. Registering a name again replaces its listener
    (a reloaded module registers anew)."""
    _LISTENERS[name] = listener


def mark_dp_trained(variables, ledger, model=None):
    """Mark ``variables`` as holding weights that DP training updated, with
    the ``ledger`` that counts those updates: a DP step traced them, or they
    were loaded with a ledger holding DP updates (into ``model``). Any model
    then refuses to train them with a non-DP optimizer
    (:func:`keras_dp_lm.training.fit_guards.check_training_is_private`).
    The variables hold the ledger itself, not a weak reference: a model built
    on them after the training model is gone still finds those updates.
    Then every listener (:func:`on_marked`) runs."""
    for variable in variables:
        ledgers = getattr(variable, _DP_TRAINED, None)
        if ledgers is None:
            ledgers = []
            setattr(variable, _DP_TRAINED, ledgers)
        if all(ledger is not held for held in ledgers):
            ledgers.append(ledger)
    _ANY_MARKED[0] = True
    with tf.init_scope():
        for listener in list(_LISTENERS.values()):
            listener(model)


def is_dp_trained(variable):
    """Whether :func:`mark_dp_trained` marked ``variable``."""
    return getattr(variable, _DP_TRAINED, None) is not None


def any_dp_trained():
    """Whether any variable of this process is marked. Every ledger row comes
    from a traced DP step or a load, and both mark, so until then no model
    holds DP updates (plain Keras training skips the guard's walk)."""
    return _ANY_MARKED[0]
