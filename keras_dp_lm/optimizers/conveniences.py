"""``DPSGD``, ``DPAdam``, ``DPAdamW``, ``DPAdamBC``: a :class:`DPOptimizer` around SGD /
Adam / AdamW / :class:`NoiseCorrectedAdam`.

They take the inner optimizer's arguments (``learning_rate``, ``momentum``,
``beta_1``, ``weight_decay``, ...) and the privacy arguments by keyword, the
argument names TensorFlow Privacy's ``DPKeras*Optimizer`` used.
"""

import keras

from keras_dp_lm.optimizers.dp_optimizer import DPOptimizer
from keras_dp_lm.optimizers.noise_corrected_adam import NoiseCorrectedAdam

_PRIVACY_ARGS = ("gradient_accumulation_steps", "expected_batch_size", "seed", "clipping",
                 "name")


def _convenience(inner_class, doc_example, name=None, inner_path=None):
    class Convenience(DPOptimizer):
        def __init__(self, *args, l2_norm_clip, noise_multiplier, inner_optimizer=None,
                     **kwargs):
            privacy = {k: kwargs.pop(k) for k in _PRIVACY_ARGS if k in kwargs}
            if inner_optimizer is None:
                inner_optimizer = inner_class(*args, **kwargs)
            elif args or kwargs:
                raise ValueError("Pass either inner_optimizer or its arguments, not both.")
            elif not isinstance(inner_optimizer, inner_class):
                raise TypeError(
                    f"{type(self).__name__} wraps a {inner_class.__name__}, got "
                    f"{type(inner_optimizer).__name__}: use DPOptimizer(inner_optimizer, "
                    "...) for another optimizer.")
            super().__init__(inner_optimizer, l2_norm_clip=l2_norm_clip,
                             noise_multiplier=noise_multiplier, **privacy)

    name = name or "DP" + inner_class.__name__
    inner_path = inner_path or f"keras.optimizers.{inner_class.__name__}"
    Convenience.__name__ = Convenience.__qualname__ = name
    Convenience.__module__ = "keras_dp_lm.optimizers"
    Convenience.__doc__ = (
        f"Differentially private ``{inner_path}``.\n\n"
        f"``{name}(*args, l2_norm_clip, noise_multiplier, **kwargs)``: positional and "
        f"other keyword arguments go to ``{inner_class.__name__}``; see "
        ":class:`DPOptimizer` for the privacy arguments.\n\n"
        "Example:\n" + doc_example)
    return keras.saving.register_keras_serializable(package="keras_dp_lm")(Convenience)


DPSGD = _convenience(keras.optimizers.SGD, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPSGD(0.1, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.1)
    >>> float(opt.inner_optimizer.momentum), opt.l2_norm_clip
    (0.9, 1.0)
""")
DPAdam = _convenience(keras.optimizers.Adam, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdam(learning_rate=1e-3, l2_norm_clip=0.1, noise_multiplier=0.8,
    ...                  gradient_accumulation_steps=4)
    >>> opt.dp_accumulation_steps
    4
""")
DPAdamW = _convenience(keras.optimizers.AdamW, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdamW(learning_rate=1e-3, weight_decay=0.01, l2_norm_clip=1.0,
    ...                   noise_multiplier=1.0)
    >>> float(opt.inner_optimizer.weight_decay)
    0.01
""")
DPAdamBC = _convenience(NoiseCorrectedAdam, """\
    >>> import keras_dp_lm as kdp
    >>> opt = kdp.DPAdamBC(learning_rate=1e-4, floor_ratio=0.1, l2_norm_clip=0.1,
    ...                    noise_multiplier=0.8)
    >>> type(opt.inner_optimizer).__name__, opt.inner_optimizer.floor_ratio
    ('NoiseCorrectedAdam', 0.1)
""", name="DPAdamBC", inner_path="keras_dp_lm.optimizers.NoiseCorrectedAdam")
