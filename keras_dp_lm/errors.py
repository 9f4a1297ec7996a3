"""The exception the DP step raises when it refuses a model, a loss or a batch.

A refusal happens before any update, so the weights are unchanged. It is a
``ValueError`` (and a ``TypeError`` / ``NotImplementedError``, for the refusals
that were raised as those), so existing ``except`` clauses keep working;
:func:`keras_dp_lm.testing.check_privacy` counts only this type as a refusal,
never an error the model itself raised.

Example:
    >>> from keras_dp_lm.errors import PrivacyRefusalError
    >>> issubclass(PrivacyRefusalError, ValueError)
    True
"""

__all__ = ["PrivacyRefusalError"]


class PrivacyRefusalError(ValueError, TypeError, NotImplementedError):
    """keras_dp_lm refused to train (or to check) privately; the message names the fix."""
