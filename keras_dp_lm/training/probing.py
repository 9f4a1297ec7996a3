"""When, and on which batch, the DP step runs fast clipping's independence probe.

The probe itself (:func:`keras_dp_lm.training.refusals.examples_independent`)
is in :mod:`keras_dp_lm.training.refusals`. Here: the clipping engine it
checks, and the train function that runs it on the first batch in a call of
its own, before the first DP step (:func:`_train_function_probing_first`).
"""

import itertools

import tensorflow as tf

from keras_dp_lm import clipping as clipping_module
from keras_dp_lm import _keras_internals as internals
from keras_dp_lm.training import refusals
from keras_dp_lm.training.batches import _micro_batch_rows
from keras_dp_lm.training.batches import _unpack
from keras_dp_lm.training.losses import _probe_losses
from keras_dp_lm.training.losses import _step_losses
from keras_dp_lm.errors import PrivacyRefusalError

_MIXING_REFUSED = (
    "keras_dp_lm refused the batch before any update: the independence check found "
    "that one example's clipped gradient is not a function of that example alone, so "
    "fast clipping cannot bound what one example changes.\n"
    "Causes it detects:\n"
    "  - a layer or loss mixes examples: batch statistics, a batch maximum, weights "
    "normalised over the batch, attention or similarity across the batch axis, a "
    "straight-through estimator or custom gradient over the batch;\n"
    "  - the training pass or its gradients are not finite on the examples compared "
    "(e.g. a division by a batch statistic without an epsilon);\n"
    "  - randomness drawn outside Keras's seed generators (tf.random.* in a layer's "
    "call), which the check cannot replay;\n"
    "  - a rule registered with register_clipping_rule for a layer whose call it does "
    "not describe (fast clipping's gradient of an example is then not its gradient).\n"
    "Fixes: make each example's loss depend on that example alone; draw randomness "
    "with keras.random and a keras.random.SeedGenerator (as keras.layers.Dropout "
    "does); register rules only for layers computing what the rule's layer computes; "
    "or compile the DP optimizer with clipping='exact' (each example differentiated "
    "alone, slower).")


def _probe_engine(model):
    """The DP step's clipping engine as the independence probe checks it:
    ``(batch, mask, slot_mask, l2_norm_clip) -> ClippedSum``: the step's losses
    on the real rows of ``mask``, clipped at ``l2_norm_clip`` and summed over the
    rows of ``slot_mask`` only."""
    loss_fn = _step_losses(model)

    def engine(batch, mask, slot_mask, l2_norm_clip):
        return clipping_module.clipped_sum(
            model, loss_fn, (batch, mask), l2_norm_clip, method=model.optimizer.clipping,
            slot_mask=slot_mask)
    return engine


def _probe_batch(model, data):
    """Run the independence probe on ``data`` (a batch as the step gets it);
    raise before any update if the model mixes examples or its forward pass
    writes model variables (compared, and restored, eagerly).

    It runs eagerly, not traced: the probe runs once per compiled model, and
    tracing its passes cost more than running them (a 2-layer BERT classifier's
    first ``fit``: 21 s traced, 6 s eager, on 2 CPU cores). The DP step it
    precedes is traced, and refuses variable writes on its graph."""
    x, y, sample_weight, mask, _, per_user = _unpack(data)
    ok, meaningful = refusals.without_state_updates(model, lambda: refusals.model_probe(
        model, _probe_losses(model), (x, y, sample_weight), mask,
        rows=_micro_batch_rows(model, mask, per_user), engine=_probe_engine(model)))
    if not bool(ok):
        raise PrivacyRefusalError(_MIXING_REFUSED)
    if bool(meaningful):
        state = refusals.probe_state(model)
        state.independence_checked.assign(1)
        state.probed_before_step = True


def _train_function_probing_first(model, train_function):
    """``train_function`` that runs the independence probe on the first batch
    as its own call, before the step.

    The probe (:func:`keras_dp_lm.training.refusals.examples_independent`)
    is two inference passes; inside the step's graph it costs its whole
    program on every step even when it is skipped: on SmolLM2-135M with LoRA,
    415 MB of peak RSS and 27 s of the first step's compile time. Once a probe
    has passed, the step is traced without it
    (``probe_state(model).probed_before_step``). The batch the probe ran on is then
    trained on as usual. Under a ``tf.distribute`` strategy, with
    ``run_eagerly=True`` and in custom loops (:func:`make_private`) the step
    probes inside itself instead.
    """
    def run(iterator):
        if (refusals.probe_state(model).probed_before_step
                or model.optimizer.clipping == "exact"
                or model.run_eagerly
                or isinstance(iterator, tf.distribute.DistributedIterator)
                or tf.distribute.has_strategy()
                or internals.distribute_strategy_of(model) is not None):
            return train_function(iterator)
        steps = max(1, int(model.steps_per_execution))
        if isinstance(iterator, tf.data.Iterator):
            batches = []
            for _ in range(steps):
                element = iterator.get_next_as_optional()
                if not element.has_value():
                    break
                batches.append(element.get_value())
            if not batches:
                raise StopIteration
            _probe_batch(model, batches[0])
            # The same element spec as the dataset's, so Keras's traced loop
            # over the iterator is reused (not traced again for this call).
            replay = tf.data.Dataset.from_generator(
                lambda: iter(batches), output_signature=iterator.element_spec)
            return train_function(iter(replay))
        iterator = iter(iterator)
        first = next(iterator)
        _probe_batch(model, first)
        return train_function(itertools.chain([first], iterator))

    run._keras_dp_lm_probes_first = True
    return run
