"""Checks a deprecated module path in a fresh process, where its once-only warning fires."""

import subprocess
import sys

_SCRIPT = '''
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import keras, keras_dp_lm  # activation imports the package's own modules only
    quiet = [str(w.message) for w in caught if "{old}" in str(w.message)]
    import {old} as old
import {new} as new
moved = [w for w in caught if issubclass(w.category, DeprecationWarning)
         and str(w.message).startswith("{old} moved to {new};")]
same = old.__all__ == new.__all__ and all(getattr(old, n) is getattr(new, n) for n in new.__all__)
print(quiet, len(moved), same)
'''


def check_moved_module(old, new):
    """``import old`` warns once (DeprecationWarning) and gives ``new``'s objects;
    ``import keras_dp_lm`` (with Keras) does not import ``old``."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(old=old, new=new)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] 1 True", out.stdout
