"""Keras callbacks: :class:`PrivacyAccountant`."""

from keras_dp_lm.callbacks.privacy_accountant import PrivacyAccountant

__all__ = ["PrivacyAccountant"]

from keras_dp_lm._activation import activate_if_pending as _activate_if_pending  # noqa: E402

_activate_if_pending()
