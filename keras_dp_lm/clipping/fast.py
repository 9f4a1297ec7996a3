"""``fast_clipped_sum``: ghost clipping and book-keeping over a whole model.

Ghost clipping (Li et al., 2022, "Large language models can be strong
differentially private learners") and book-keeping (Bu et al., 2023,
"Differentially private optimization on large model at small cost").

How it works
------------
One batched forward pass runs ``loss_fn(data)`` while every *covered* layer's
``call`` is temporarily replaced by a recording version that computes the same
output, records the layer input ``a`` and the pre-activation output ``z`` and
lets the gradient tape watch ``z``.  One backward pass,
``tape.gradient(sum(losses), [z...])``, gives every output gradient ``g``; it
never forms a weight gradient.  From ``a`` and ``g``:

* per-example gradient norms, per variable, by whichever is cheaper
  (a FLOP model with memory caps, decided at trace time from static shapes):

  - ghost norm: ``||a_i^T g_i||^2 = sum_{t,s} (a_t.a_s)(g_t.g_s)``
    (cost ~ T^2 (m + n) per example), or
  - instantiating the per-example gradient ``a_i^T g_i`` (cost ~ T m n) just
    long enough to take its norm;

  embedding lookups use ``sum_{t,s} [id_t == id_s] (g_t.g_s)``; a tied
  ``ReversibleEmbedding`` (lookup + ``reverse=True`` projection on one
  variable) adds the cross term ``2 sum_{t,s} dlogits_s[id_t] (g_t.h_s)``, so
  the norm is that of the *summed* per-example gradient;  LayerNorm / RMS norm
  scales and all biases instantiate their (tiny) per-example gradients;

* the clipped sum by book-keeping: ``sum_i c_i a_i^T g_i`` as one matmul over
  all ``B*T`` rows with ``c_i = min(1, C / ||grad_i||)`` folded into the
  smaller factor.  That matmul is the weight-gradient matmul a normal
  backward pass does anyway, so no second backward pass is needed.  (A second
  backward pass of ``sum_i c_i loss_i`` would recompute every activation
  gradient as well: about twice the work of book-keeping on CPU.)

Variables with no rule ("uncovered": e.g. a ``Conv1DTranspose`` kernel,
quantized layers, layers whose ``call`` is overridden) get exact per-example
gradients from a ``tf.map_fn`` over one-example slices of ``data`` (exact but
slow) with ``method="auto"``; ``method="fast"`` raises
:class:`UncoveredLayersError` instead.  A covered variable that is also read
outside its layer's ``call`` is detected at trace time (a second tape watches
variable reads outside covered calls) and treated as uncovered.

Nothing here uses ``tf.vectorized_map`` / pfor, so it runs with oneDNN on
(see DESIGN.md), in eager mode, inside ``tf.function`` and with
``jit_compile=True``.

Notes:

* The model must be built (its variables must exist) before the call.
* A weight regularizer reads its variable outside the layer's ``call``, so
  that variable is treated as uncovered (exact in "auto", refused in "fast").
* With dropout and uncovered variables, the exact fallback's one-example
  forward passes draw their own dropout masks; the clipping bound still holds
  because the norm is that of exactly the vector that is clipped and summed.
* Thread-safe for ``tf.distribute`` replica threads: the wrappers are
  installed once and look up the recording of the calling thread.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from keras_dp_lm.clipping._common import _as_float
from keras_dp_lm.clipping._common import static_dim
from keras_dp_lm.clipping._common import _var_path
from keras_dp_lm.clipping._common import _weighted_sum
from keras_dp_lm.clipping.exact import tf_variable
from keras_dp_lm.clipping.exact import per_example_gradients
from keras_dp_lm.clipping.ghost import _Grams
from keras_dp_lm.clipping.ghost import _choose
from keras_dp_lm.clipping.ghost import _merge_lookups
from keras_dp_lm.clipping.ghost import _rounding_allowance
from keras_dp_lm.clipping.ghost import _sq_norm
from keras_dp_lm.clipping.interface import ClippedSum
from keras_dp_lm.clipping.interface import UncoveredLayersError
from keras_dp_lm.clipping.interface import check_examples_per_user
from keras_dp_lm.clipping.interface import clip_factors
from keras_dp_lm.clipping.interface import losses_and_outputs
from keras_dp_lm.clipping.interface import scale_examples
from keras_dp_lm.clipping.interface import sum_dtype
from keras_dp_lm.clipping.interface import sum_user_rows
from keras_dp_lm.clipping.interface import user_slot_mask
from keras_dp_lm.clipping.recording import _Plan
from keras_dp_lm.clipping.recording import _Recorder
from keras_dp_lm.clipping.recording import _recording
from keras_dp_lm.clipping.rounding import accumulation_dtype
from keras_dp_lm.clipping.rounding import squares_allowance
from keras_dp_lm.clipping.rounding import sum_squares
from keras_dp_lm.clipping.rounding import summed_terms_allowance
from keras_dp_lm.errors import PrivacyRefusalError

if TYPE_CHECKING:
    import keras

_LAST_DECISIONS = weakref.WeakKeyDictionary()
_LAST_REASONS = weakref.WeakKeyDictionary()


def _mark_unbatched_calls(rec, rows):
    """Mark the variables of each covered layer call whose output's leading axis
    is not the batch's (``rows``: the static number of rows, ``None`` when
    unknown) for exact per-example gradients.

    DeBERTa's attention calls its query and key projections on the relative
    position embeddings too, a ``[1, ...]`` tensor that every example shares:
    the gradient of that output is the sum over all examples, which no rule
    can split per example. A rule reads axis 0 as the examples, so a call
    whose static leading size differs from the batch's (or is static while the
    batch's is not) is left to the exact engine. With a batch of one row every
    gradient is that row's, and nothing is marked."""
    for call in rec.calls:
        lead = static_dim(call.z.shape[0]) if call.z.shape.rank else None
        if lead is None or lead == rows:
            continue
        reason = (f"{type(call.layer).__name__} '{call.layer.name}' is called on a tensor "
                  f"whose leading axis ({lead}) is not the batch's ({rows or 'unknown'}): "
                  "an input shared by every example")
        for c in rec.contribs:
            if c.call is call:
                rec.mark_bad(c.var, reason)


def fast_clipped_sum(model: keras.Model,
                     loss_fn: Callable[[Any], tf.Tensor | tuple[tf.Tensor, Any]], data: Any,
                     l2_norm_clip: float, method: str = "auto", slot_mask: tf.Tensor | None = None,
                     examples_per_user: int = 1) -> ClippedSum:
    """Per-example gradient norms and the sum of clipped per-example gradients.

    Args:
        model: a built Keras 3 model (TensorFlow backend).
        loss_fn: ``loss_fn(data) -> [B]`` per-example losses, running the model
            forward (``training=True``) on the batch; each example's loss must
            depend on that example only.  It may also return
            ``(losses, model_outputs)``: the outputs of the batched forward
            pass are then returned as ``ClippedSum.outputs`` (e.g. for metrics,
            saving the DP step a second forward pass).
        data: nested structure of tensors with leading batch dimension ``B``.
        l2_norm_clip: clip norm ``C``; ``c_i = min(1, C / ||grad_i||)``.
        method: ``"auto"`` (fast rules for covered variables, exact per-example
            gradients for the rest) or ``"fast"`` (raise
            :class:`UncoveredLayersError` if any trainable variable is uncovered).
        slot_mask: optional ``[B]``, 0 on padding slots: their clip factor is 0,
            so they add exactly nothing to the clipped sum.
        examples_per_user: ``k``; rows ``u*k .. u*k+k-1`` belong to user ``u``
            and the unit that is clipped is the user: the norm and the clip
            factor are those of the sum of the user's ``k`` per-example
            gradients (every recorded contribution is regrouped from ``[B, T]``
            to ``[B/k, k*T]`` rows, so ghost norms and book-keeping run
            unchanged on users). ``B`` must be a multiple of ``k``.

    Returns:
        :class:`ClippedSum` ``(grads, norms, losses, outputs, fast_norms,
        exact, rounding)``: ``grads``
        aligned with ``model.trainable_variables`` (clipped sum, no noise, not
        divided; zeros for variables the loss does not touch), ``norms``
        ``[B/k]`` per-user (per-example when ``k == 1``) global norms before
        clipping, ``losses`` ``[B]`` per example,
        ``outputs`` as described under ``loss_fn`` (else ``None``),
        ``fast_norms`` the engine's float32 reading of the part of ``norms``
        over the variables read by fast rules, ``exact`` which variables fell
        back to exact gradients, ``rounding`` ``[B/k]`` the allowance for
        float32 rounding added to the squared norms of the variables fast
        rules read (``norms**2 = fast_norms**2 + rounding + exact part``, the
        exact part with its own allowance): a norm read from Gram
        matrices is made an upper bound of the norm of the vector that
        book-keeping sums (see ``ghost._rounding_allowance``).

    Raises:
        UncoveredLayersError: with ``method="fast"``, listing the layers and
            variables that have no fast rule (or that are read outside their
            layer's ``call``).
    """
    if method not in ("auto", "fast"):
        raise ValueError(f"method must be 'auto' or 'fast', got {method!r}")
    k = check_examples_per_user(examples_per_user)
    plan = _Plan(model)
    if method == "fast" and plan.uncovered:
        raise UncoveredLayersError(plan.describe(plan.uncovered))

    with tf.GradientTape(watch_accessed_variables=False) as tape:
        with tf.GradientTape(watch_accessed_variables=True) as detect:
            rec = _Recorder(plan, tape, detect)
            with _recording(rec):
                losses, outputs = losses_and_outputs(loss_fn(data))
        losses = _as_float(losses)
        total = tf.reduce_sum(losses)

    outside = {v.ref() for v in detect.watched_variables()}
    _mark_unbatched_calls(rec, static_dim(losses.shape[0]) if losses.shape.rank else None)

    def read_outside(v):
        tv = tf_variable(v)
        try:
            return tv.ref() in outside
        except (AttributeError, TypeError):
            return False

    exact, reasons = [], {}
    for v in plan.trainable:
        if id(v) not in plan.covered:
            exact.append(v)
        elif id(v) in rec.bad:
            exact.append(v)
            reasons[id(v)] = rec.bad[id(v)]
        elif read_outside(v):
            exact.append(v)
            reasons[id(v)] = "read outside its layer's call"
    if method == "fast" and exact:
        raise UncoveredLayersError(
            plan.describe(exact),
            reason="; ".join(sorted(set(reasons.values()))) or None)
    exact_ids = {id(v) for v in exact}

    by_var = collections.OrderedDict()
    for c in rec.contribs:
        if id(c.var) not in exact_ids:
            by_var.setdefault(id(c.var), []).append(c)
    calls = [call for call in rec.calls
             if any(c.call is call for cs in by_var.values() for c in cs)]
    if calls:
        gz = tape.gradient(total, [call.z for call in calls],
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
        for call, g in zip(calls, gz):
            call.g = tf.convert_to_tensor(g)

    rows = static_dim(losses.shape[0]) if losses.shape.rank else None
    B = rows if rows is not None else tf.shape(losses)[0]
    if k > 1 and rows is not None and rows % k:
        raise PrivacyRefusalError(f"The batch has {rows} rows, not a multiple of "
                                  f"examples_per_user={k}.")
    units = B // k   # users (examples when k == 1): the rows of norms and factors
    batch = None if rows is None else units
    sq = tf.zeros([units], accumulation_dtype())
    rounding = tf.zeros([units], accumulation_dtype())
    grams = _Grams()
    decisions = {}
    per_example = {}   # id(var) -> [U, *var.shape]: clipped sum is sum_u c_u grad_u
    for key, contribs in list(by_var.items()):
        for c in contribs:
            c.prepare()
            if k > 1:
                c.regroup(k)
        contribs = by_var[key] = _merge_lookups(contribs)
        choice, keep = _choose(contribs, batch)
        decisions[_var_path(contribs[0].var)] = choice
        term, per = _sq_norm(contribs, choice, grams)
        sq = sq + term
        if keep:
            per_example[key] = per
            rounding = rounding + squares_allowance(per, term)
        else:
            # book-keeping sums a vector the norm was not read from
            allowance = _rounding_allowance(contribs, grams, term)
            if allowance is not None:
                rounding = rounding + allowance

    fast_sq = sq
    if exact:
        pe = per_example_gradients(loss_fn, data, exact, B)
        for v, g in zip(exact, pe):
            g = sum_user_rows(g, k)
            per_example[id(v)] = g
            term = sum_squares(g)
            # its own allowance, not in ``rounding`` (which covers the
            # variables ``fast_norms`` reads, as the probe compares them)
            sq = sq + term + squares_allowance(g, term)
            decisions[_var_path(v)] = "exact"
    sq = sq + rounding
    sq = sq + summed_terms_allowance(len(plan.trainable), sq)

    norms = tf.cast(tf.sqrt(sq), tf.float32)
    if slot_mask is not None:
        slot_mask = user_slot_mask(slot_mask, k)
    factors = clip_factors(norms, l2_norm_clip, slot_mask)

    def clipped_sums(safe):
        grads = []
        for v in plan.trainable:
            if id(v) in per_example:
                per = per_example[id(v)]
                if safe:
                    g = tf.reduce_sum(scale_examples(per, factors), axis=0)
                else:
                    g = _weighted_sum(factors, per)
                grads.append(tf.cast(g, sum_dtype(v)))
            elif id(v) in by_var:
                g = None
                for c in by_var[id(v)]:
                    part = c.clipped(factors, safe)
                    g = part if g is None else g + part
                grads.append(tf.cast(g, sum_dtype(v)))
            else:
                grads.append(tf.zeros(v.shape, sum_dtype(v)))
        return grads

    # Every norm finite (the usual case) means every recorded factor is finite
    # (a non-finite entry makes its example's norm non-finite), so the clip
    # factors are applied by one multiply of the smaller factor. Otherwise
    # the rows of dropped examples are replaced by zeros (0 * nan is nan).
    finite = tf.reduce_all(tf.math.is_finite(sq))
    grads = tf.cond(finite, lambda: clipped_sums(False), lambda: clipped_sums(True))
    try:
        _LAST_DECISIONS[model] = decisions
        _LAST_REASONS[model] = {_var_path(v): r for v in plan.trainable
                                for r in [reasons.get(id(v))] if r}
    except TypeError:  # pragma: no cover
        pass
    return ClippedSum(grads=grads, norms=norms, losses=losses, outputs=outputs,
                      fast_norms=tf.cast(tf.sqrt(fast_sq), tf.float32),
                      exact=tuple(id(v) in exact_ids for v in plan.trainable),
                      rounding=tf.cast(rounding, tf.float32))
