"""keras_dp_lm: differentially private vocabularies, training and decoding for Keras 3."""

__version__ = "0.1.0"
