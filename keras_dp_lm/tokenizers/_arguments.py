"""Argument checks of the DP vocabulary (``ValueError`` naming the argument)."""

import math

import numpy as np


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    return int(value)


def _as_float(name, value, expected):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}") from None


def _check_positive(name, value):
    value = _as_float(name, value, "a positive number")
    if not value > 0 or math.isnan(value) or math.isinf(value):
        raise ValueError(f"`{name}` must be a positive, finite number. Received: {name}={value!r}")
    return value


def _check_open_unit(name, value):
    value = _as_float(name, value, "a number in (0, 1)")
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"`{name}` must be in the open interval (0, 1). Received: {name}={value!r}")
    return value


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be None or a non-negative integer. Received: seed={seed!r}")
    return int(seed)
