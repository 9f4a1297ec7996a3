"""Releases that layers of the trained model made about its training data
(``DPFeatureNormalization``'s DP mean, ``DPClassMeans``' class means) must be
in the accountant's total."""

from keras_dp_lm.data.releases import is_release_layer
from keras_dp_lm.errors import PrivacyRefusalError
from keras_dp_lm._keras_internals import flatten_layers


def check_feature_releases(model, extra_events, unit, applied=0):
    """Refuse a model holding a release layer (``DPFeatureNormalization``,
    ``DPClassMeans``) or a loss with released class priors whose current releases
    are not among ``extra_events``, or whose privacy unit is not the training's
    (``unit``: ``"example"`` or ``"user"``; ``None`` when the accountant cannot
    know it before the first update). Returns True when such a layer exists and
    ``unit`` is ``None``: call again with the ledger's unit after one update
    (``applied`` updates are then named in the error). Each extra event
    accounts for one layer only: two layers need two events."""
    accounted = list(extra_events)
    pending = False
    for layer in flatten_layers(model, include_self=False):
        if not is_release_layer(layer) or not layer.releases_made():
            continue
        if unit is None:
            pending = True
        elif layer.privacy_unit != unit:
            raise PrivacyRefusalError(
                f"{layer.name!r} released statistics of this training data with one "
                f"{layer.privacy_unit} as the "
                f"privacy unit, but this training protects one {unit}: adapt it again "
                f"{'with' if unit == 'user' else 'without'} `user_ids` (a user with k "
                "records moves a per-record mean k times as far)"
                + (f"; the {applied} update(s) already applied are in the ledger." if
                   applied else "; refused before any update. Passing `batches=` to the "
                   "accountant lets it check this before the first update."))
        if layer.dp_event() in accounted:
            accounted.remove(layer.dp_event())
        else:
            raise PrivacyRefusalError(
                f"{layer.name!r} released statistics of this training data "
                f"{layer.releases_made()} time(s), and that is not in the accountant's "
                "extra_events: pass PrivacyAccountant(extra_events=[layer.dp_event()]) "
                "(suggest_recipe(extra_events=[layer.dp_event()]) after the last adapt "
                "does it for recipe.accountant()).")
    for loss in _losses(getattr(model, "loss", None)):
        event = getattr(loss, "release_event", None)
        if event is None:
            continue
        released_unit = getattr(loss, "release_unit", None)
        if released_unit is not None and unit is None:
            pending = True
        elif released_unit is not None and released_unit != unit:
            raise PrivacyRefusalError(
                f"The loss {getattr(loss, 'name', loss)!r} uses class priors released "
                f"with one {released_unit} as the privacy unit, but this training "
                f"protects one {unit}: release them again "
                f"{'with' if unit == 'user' else 'without'} `user_ids` "
                "(DPClassPriors.release(labels, user_ids=...)) and compile with those"
                + (f"; the {applied} update(s) already applied are in the ledger." if
                   applied else "; refused before any update."))
        if event in accounted:
            accounted.remove(event)
        else:
            raise PrivacyRefusalError(
                f"The loss {getattr(loss, 'name', loss)!r} uses class priors released from "
                "this training data (DPClassPriors), and that release is not in the "
                "accountant's extra_events: pass PrivacyAccountant(extra_events=[priors."
                "dp_event()]) (or suggest_recipe(extra_events=[...]) after the release).")
    return pending


def _losses(loss):
    """The loss objects of a compiled ``loss`` (one, or a list / dict of them)."""
    if isinstance(loss, dict):
        return [item for value in loss.values() for item in _losses(value)]
    if isinstance(loss, (list, tuple)):
        return [item for value in loss for item in _losses(value)]
    return [] if loss is None else [loss]
