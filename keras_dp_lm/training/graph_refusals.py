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
from keras_dp_lm.training.ledger import CHECKS

# Every in-graph refusal message starts with this.
MARK = "keras_dp_lm"

LEDGER_REFUSAL = (
    "keras_dp_lm refused a batch beyond what the accountant assumes, or of another "
    "privacy unit than the earlier updates of the model")  # no quote: TF escapes it
# Labels of the values the step's ledger assertion prints after LEDGER_REFUSAL:
# PASSED is PrivacyLedger.check_parts (1 / 0, in the order of ledger.CHECKS).
PASSED, LIMITS, SIGMA, RATE, REAL, UNIT = (
    "passed:", "limits:", "noise_multiplier:", "sampling_rate:", "real_batch:", "unit:")
# Enough entries that no value is cut with "..." (the limits have 5, CHECKS 6).
SUMMARIZE = 8


def _value(message, label):
    found = re.search(re.escape(f"[{label}]") + r"\s*\[([^\]]*)\]", message)
    if found is None:
        return None
    return np.array(found.group(1).split(), dtype=np.float64)


def _ledger_reasons(message):
    """The ledger's conditions the batch in ``message`` failed (as the step's
    ``PrivacyLedger.check_parts`` decided them), in words with their numbers."""
    values = [_value(message, label) for label in (PASSED, LIMITS, SIGMA, RATE, REAL)]
    unit = re.search(re.escape(f"[{UNIT}]") + r"\s*\[([a-z]+)\]", message)
    if any(v is None for v in values) or unit is None or len(values[0]) != len(CHECKS):
        return []
    passed, limits = values[0], values[1]
    sigma, rate, real = (float(v[0]) for v in values[2:])
    cap = limits[3] if limits[3] > 0 else limits[2]
    words = {
        "noise_multiplier": (
            f"the optimizer's noise multiplier is {sigma:g}, below the {limits[0]:g} the "
            "accountant counts: give PrivacyAccountant the optimizer you train with, or "
            "compile again with the noise multiplier it assumes"),
        "sampling_rate": (
            f"the batch was Poisson-sampled at rate {rate:g}, above the accountant's "
            f"{limits[1]:g}: build the accountant from the same batches "
            "(PrivacyAccountant(batches=...))"),
        "poisson_cap": (
            f"the Poisson batch holds {real:g} real examples, more than the {cap:g} "
            "the accountant allows: use the cap suggest_max_batch_size gives"),
        "running_total": (
            "the Poisson batches so far hold more real examples than independent "
            "draws at the accountant's rate reach (probability 1e-12): the batches "
            "are not sampled at the rate the accountant counts; draw them with "
            "keras_dp_lm.data.poisson_batches at that rate"),
        "fixed_batch": (
            f"this batch has {real:g} real examples, but the accountant counts fixed-size "
            f"batches of at most {limits[2]:g}: pass the batch size you train with "
            f"(fit(batch_size={real:g}) needs PrivacyAccountant(batch_size={real:g}, ...)), "
            f"or train with batches of {limits[2]:g}"),
        "unit": (
            f"this batch's privacy unit is the {unit.group(1)}, but the model's earlier "
            "updates counted another unit (example batches and user batches never mix "
            "in one ledger): train a fresh copy of the weights for the other unit"),
    }
    return [words[name] for name, ok in zip(CHECKS, passed) if not ok]


def as_privacy_refusal(error):
    """The :class:`PrivacyRefusalError` for ``error`` (a TensorFlow error
    raised by one of the DP step's assertions), or ``None`` when ``error`` is
    not one of them."""
    message = str(getattr(error, "message", None) or error)
    # TensorFlow's text: a traceback, then "assertion failed: [message] [values]"
    start = message.rfind("assertion failed: [" + MARK)
    if start < 0:
        return None
    failed = message[start + len("assertion failed: "):].split("\n\t [[")[0].strip()
    if LEDGER_REFUSAL in failed:
        reasons = _ledger_reasons(failed)
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
def raised_as_privacy_refusals():
    """Inside: the DP step's in-graph refusals raise :class:`PrivacyRefusalError`
    (:func:`as_privacy_refusal`); any other error passes unchanged."""
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        refusal = as_privacy_refusal(error)
        if refusal is None:
            raise
        raise refusal from None
