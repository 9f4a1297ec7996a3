"""Releases that layers of the trained model made about its training data
(``DPFeatureNormalization``'s DP mean) must be in the accountant's total."""

import dp_accounting

from keras_dp_lm.data.feature_normalization import DPFeatureNormalization
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm.training.keras_internals import flatten_layers


def _flat(events):
    for event in events:
        yield event
        if isinstance(event, dp_accounting.ComposedDpEvent):
            yield from _flat(event.events)


def check_feature_releases(model, extra_events, unit):
    """Refuse (before any update) a model holding a ``DPFeatureNormalization``
    whose current releases are not among ``extra_events``, or whose privacy
    unit is not the training's (``unit``: ``"example"``, ``"user"``, or
    ``None`` when not known yet, read as ``"example"``)."""
    accounted = list(_flat(extra_events))
    for layer in flatten_layers(model, include_self=False):
        if not isinstance(layer, DPFeatureNormalization) or not layer.num_releases:
            continue
        if layer.privacy_unit != (unit or "example"):
            raise PrivacyRefusalError(
                f"{layer.name!r} released its mean with one {layer.privacy_unit} as the "
                f"privacy unit, but this training protects one {unit or 'example'}: adapt "
                f"it again {'with' if unit == 'user' else 'without'} `user_ids` (a user "
                "with k records moves a per-record mean k times as far).")
        if layer.dp_event() not in accounted:
            raise PrivacyRefusalError(
                f"{layer.name!r} released the mean of this training data "
                f"{layer.num_releases} time(s), and that is not in the accountant's "
                "extra_events: pass PrivacyAccountant(extra_events=[layer.dp_event()]) "
                "(suggest_recipe(extra_events=[layer.dp_event()]) after the last adapt "
                "does it for recipe.accountant()).")
