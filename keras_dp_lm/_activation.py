"""Activation: patching Keras as soon as both Keras and keras_dp_lm are imported.

``import keras_dp_lm`` calls :func:`activate` when Keras is already imported,
else installs :class:`ActivateAfterKeras`, which calls it right after
``import keras`` finishes. Every subpackage calls :func:`activate_if_pending`
at the end of its ``__init__``. Internal to keras_dp_lm.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Modules that register Keras objects or patch Keras: imported as soon as Keras is.
KERAS_MODULES = ("keras_dp_lm.training", "keras_dp_lm.optimizers",
                 "keras_dp_lm.samplers", "keras_dp_lm.tokenizers", "keras_dp_lm.data")


def activate():
    """Patch ``compile`` and register keras_dp_lm's Keras objects."""
    for module in KERAS_MODULES:
        importlib.import_module(module)
    sys.modules["keras_dp_lm.training"].install()


_pending = False


def activate_if_pending():
    """Finish an activation that Keras's import could not complete.

    When importing one of our own modules imports Keras (through TensorFlow),
    activation runs while that module is only half initialised and fails; every
    subpackage calls this at the end of its ``__init__``, so activation completes
    as soon as the import chain that started it has finished.
    """
    global _pending
    if not _pending:
        return
    try:
        activate()
    except (ImportError, AttributeError):
        return
    _pending = False


class ActivateAfterKeras(importlib.abc.MetaPathFinder):
    """Runs :func:`activate` right after ``import keras`` finishes.

    ``find_spec`` may be called without a load (TensorFlow probes for Keras), so
    the finder stays installed until Keras has actually been executed.
    """

    _searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras" or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec("keras")
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_then_activate(module):
            global _pending
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            _pending = True
            activate_if_pending()

        spec.loader.exec_module = exec_then_activate
        return spec


def install_activation():
    """Activate now if Keras is imported, else once it is."""
    if "keras" in sys.modules:
        activate()
    elif not any(isinstance(f, ActivateAfterKeras) for f in sys.meta_path):
        sys.meta_path.insert(0, ActivateAfterKeras())
