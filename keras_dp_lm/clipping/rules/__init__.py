"""Fast-clipping rules, one file per layer family.

A rule describes one layer class's forward computation well enough to give
each example's gradient norm and the clipped sum from the layer's input and
output gradient. It has four static methods:

- ``matches(layer)``: whether this instance is one the rule describes;
- ``variables(layer)``: the trainable variables it covers;
- ``forward(layer, recorder, *args, **kwargs)``: the layer's output, computed
  as the layer computes it, adding one contribution per use of a variable
  (:mod:`keras_dp_lm.clipping.contributions`) to ``recorder``;
- ``static_method(layer, variable, T, B)``: ``"ghost"`` or ``"instantiate"``,
  the expected choice for the coverage report.

Each rule binds itself to exact classes with the public decorator
:func:`keras_dp_lm.clipping.register_clipping_rule`, as a custom rule does;
importing this package registers them all (:mod:`keras_dp_lm.clipping`
imports it; KerasHub's classes are registered on first use,
:func:`register_keras_hub_rules`).
"""

from keras_dp_lm._keras_internals import keras_hub_layer
from keras_dp_lm.clipping.registry import register_on_first_use

from keras_dp_lm.clipping.rules import dense  # noqa: F401
from keras_dp_lm.clipping.rules import einsum_dense  # noqa: F401
from keras_dp_lm.clipping.rules import embedding  # noqa: F401
from keras_dp_lm.clipping.rules import normalization  # noqa: F401
from keras_dp_lm.clipping.rules import conv  # noqa: F401
from keras_dp_lm.clipping.rules import masked_lm_head  # noqa: F401


def register_keras_hub_rules():
    """Register the built-in rules for KerasHub's layer classes.

    Finding them (:func:`keras_dp_lm._keras_internals.keras_hub_layer`) imports
    KerasHub, so this runs on the registry's first use, not on import.
    """
    embedding.register_keras_hub_rules(keras_hub_layer)
    normalization.register_keras_hub_rules(keras_hub_layer)
    masked_lm_head.register_keras_hub_rules(keras_hub_layer)


register_on_first_use(register_keras_hub_rules)
