"""Constants and argument checks shared by the accounting modules."""

import logging
import math
import numbers

import dp_accounting


ACCOUNTANTS = ("pld", "rdp")
SAMPLING_MODES = ("auto", "poisson", "shuffle")
# PLDAccountant's default discretization; kept explicit so the cached curves
# below compute exactly what the accountant computes.
PLD_DISCRETIZATION = 1e-4
# Guides searches only (~10x faster, a pessimistic estimate slightly above).
COARSE_PLD_DISCRETIZATION = 1e-3
MAX_STEPS_CAP = 10**15
MAX_NOISE = 1e6
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

SHUFFLE_NOTE = (
    "shuffled fixed-size batches accounted as if Poisson sampled at the same "
    "rate (common practice; the guarantee is proven for Poisson sampling and "
    "shuffling can be less private than the number suggests)")
POISSON_NOTE = ("Poisson sampling (each example included independently with "
                "probability q)")


class _DropRdpConvergenceNotes(logging.Filter):
    """dp_accounting's RDP accountant logs a warning for every fractional order
    whose series does not converge (at sampling rates near 0.5 that is a dozen
    per epsilon) and leaves that order out; the epsilon, a minimum over the
    other orders, stays a valid upper bound. keras_dp_lm computes RDP beside PLD
    for every report, so these notes flooded users' output (issue 50); they are
    dropped, every other absl message passes."""

    def filter(self, record):
        message = record.getMessage()
        return not ("failed to converge" in message and "Excluding this order" in message)


if not any(isinstance(f, _DropRdpConvergenceNotes) for f in logging.getLogger("absl").filters):
    logging.getLogger("absl").addFilter(_DropRdpConvergenceNotes())


class PrivacyBudgetExhaustedError(RuntimeError):
    """Training was refused because one more update would exceed the target epsilon."""


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------
def check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"`{name}` must not be NaN.")
    return value


def check_noise(value, name="noise_multiplier"):
    value = check_number(name, value)
    if value < 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be finite and >= 0, got {value!r}.")
    return value


def check_rate(value, name="sampling_rate"):
    value = check_number(name, value)
    if not 0 < value <= 1:
        raise ValueError(
            f"`{name}` must be in (0, 1] (logical batch size / dataset size), "
            f"got {value!r}.")
    return value


def check_steps(value, name="steps"):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif float(value).is_integer():
        value = int(value)
    else:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return value


def check_delta(value, name="delta"):
    value = check_number(name, value)
    if not 0 < value < 1:
        raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
    return value


def check_epsilon(value, name="target_epsilon"):
    value = check_number(name, value)
    if not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    return value


def check_accountant(value):
    if not isinstance(value, str) or value.lower() not in ACCOUNTANTS:
        raise ValueError(
            f"`accountant` must be one of {ACCOUNTANTS}, got {value!r}.")
    return value.lower()


def check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if not float(value).is_integer() or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def check_integer(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_sampling_rate(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"`sampling_rate` must be in (0, 1], got {value!r}.")
    return float(value)
