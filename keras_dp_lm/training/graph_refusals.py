"""The DP step's refusals that can only be decided when the batch runs.

Some refusals depend on the batch's values (its real size, the rate it was
sampled at), so the traced step checks them with ``tf.debugging.Assert`` and
TensorFlow raises ``tf.errors.InvalidArgumentError`` with the assertion's data.
:func:`as_privacy_refusal` turns such an error into a
:class:`~keras_dp_lm.errors.PrivacyRefusalError` whose message says, in words
and numbers, which limit the batch broke and how to fix it. Either way the
batch was refused before its update.
"""

import contextlib
import re

import numpy as np
import tensorflow as tf

from keras_dp_lm.errors import PrivacyRefusalError

# Every in-graph refusal message starts with this.
MARK = "keras_dp_lm"

LEDGER_REFUSAL = (
    "keras_dp_lm refused a batch beyond what the accountant assumes, or of another "
    "privacy unit than the earlier updates of the model")  # no quote: TF escapes it
# Labels of the values the step's ledger assertion prints after LEDGER_REFUSAL.
LIMITS, SIGMA, RATE, REAL, UNIT = ("limits:", "noise_multiplier:", "sampling_rate:",
                                   "real_batch:", "unit:")
# Enough entries that no value is cut with "..." (the limits have 5).
SUMMARIZE = 8


def _value(message, label):
    found = re.search(re.escape(f"[{label}]") + r"\s*\[([^\]]*)\]", message)
    if found is None:
        return None
    return np.array(found.group(1).split(), dtype=np.float64)


def _ledger_reasons(message, ledger):
    """Which of the ledger's limits the batch in ``message`` broke, in words."""
    limits = _value(message, LIMITS)
    sigma, rate, real = (_value(message, label) for label in (SIGMA, RATE, REAL))
    if limits is None or sigma is None or rate is None or real is None:
        return []
    sigma, rate, real = float(sigma[0]), float(rate[0]), float(real[0])
    reasons = []
    if limits[0] > 0 and sigma < limits[0] * (1 - 1e-12):
        reasons.append(
            f"the optimizer's noise multiplier is {sigma:g}, below the {limits[0]:g} the "
            "accountant counts: give PrivacyAccountant the optimizer you train with, or "
            "compile again with the noise multiplier it assumes")
    if rate > 0:
        cap = limits[3] if limits[3] > 0 else limits[2]
        if limits[1] > 0 and rate > limits[1] * (1 + 1e-9):
            reasons.append(
                f"the batch was Poisson-sampled at rate {rate:g}, above the accountant's "
                f"{limits[1]:g}: build the accountant from the same batches "
                "(PrivacyAccountant(batches=...))")
        if cap > 0 and real > cap * (1 + 1e-9):
            reasons.append(
                f"the Poisson batch holds {real:g} real examples, more than the {cap:g} "
                "the accountant allows: use the cap suggest_max_batch_size gives")
        if not reasons:
            reasons.append(
                "the Poisson batches so far hold more real examples than independent "
                "draws at the accountant's rate reach (probability 1e-12): the batches "
                "are not sampled at the rate the accountant counts; draw them with "
                "keras_dp_lm.data.poisson_batches at that rate")
    elif limits[2] > 0 and real > limits[2] * (1 + 1e-9):
        reasons.append(
            f"this batch has {real:g} real examples, but the accountant counts fixed-size "
            f"batches of at most {limits[2]:g}: pass the batch size you train with "
            f"(fit(batch_size={real:g}) needs PrivacyAccountant(batch_size={real:g}, ...)), "
            f"or train with batches of {limits[2]:g}")
    unit = re.search(re.escape(f"[{UNIT}]") + r"\s*\[([a-z]+)\]", message)
    held = int(np.asarray(ledger.unit.value)) if ledger is not None else 0
    if unit is not None and held and not reasons:
        reasons.append(
            f"this batch's privacy unit is the {unit.group(1)}, but the model's earlier "
            "updates counted another unit (example batches and user batches never mix "
            "in one ledger): train a fresh copy of the weights for the other unit")
    return reasons


def as_privacy_refusal(error, ledger=None):
    """The :class:`PrivacyRefusalError` for ``error`` (a TensorFlow error
    raised by one of the DP step's assertions), or ``None`` when ``error`` is
    not one of them. ``ledger``: the model's, to read which unit it holds."""
    message = str(getattr(error, "message", None) or error)
    # TensorFlow's text: a traceback, then "assertion failed: [message] [values]"
    start = message.rfind("assertion failed: [" + MARK)
    if start < 0:
        return None
    failed = message[start + len("assertion failed: "):].split("\n\t [[")[0].strip()
    if LEDGER_REFUSAL in failed:
        reasons = _ledger_reasons(failed, ledger)
        text = ("keras_dp_lm refused this batch before its update: "
                + ("; and ".join(reasons) if reasons else
                   "it is beyond what the accountant assumes")
                + ".\n(The step's check: " + failed.replace("\\'", "'") + ")")
        return PrivacyRefusalError(text)
    # the other in-graph refusals carry their whole explanation
    text = failed.replace("\\'", "'").replace("\\n", "\n")
    if text.startswith("[") and text.endswith("]") and text.count("] [") == 0:
        text = text[1:-1]
    return PrivacyRefusalError(text)


@contextlib.contextmanager
def raised_as_privacy_refusals(ledger=None):
    """Inside: the DP step's in-graph refusals raise :class:`PrivacyRefusalError`
    (:func:`as_privacy_refusal`); any other error passes unchanged."""
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        refusal = as_privacy_refusal(error, ledger)
        if refusal is None:
            raise
        raise refusal from None
