"""Fast-clipping rules, one file per layer family.

A rule describes one layer class's forward computation well enough to give
each example's gradient norm and the clipped sum from the layer's input and
output gradient. It has four static methods:

- ``matches(layer)``: whether this instance is one the rule describes;
- ``variables(layer)``: the trainable variables it covers;
- ``forward(layer, recorder, *args, **kwargs)``: the layer's output, computed
  as the layer computes it, adding one contribution per use of a variable
  (:mod:`keras_dp_lm.clipping.ghost`) to ``recorder``;
- ``static_method(layer, variable, T, B)``: ``"ghost"`` or ``"instantiate"``,
  the expected choice for the coverage report.

Rules are bound to exact classes by :func:`keras_dp_lm.clipping.register_clipping_rule`.
"""
