"""The supported Keras / KerasHub / TensorFlow versions are named once and agree (issue 39).

``keras_dp_lm/_keras_internals.py`` names the Keras and KerasHub minors whose
private API it was checked against (``TESTED_KERAS``, ``TESTED_KERAS_HUB``);
``pyproject.toml`` declares the ranges users install from; ``ci/oldest-constraints.txt``
and ``ci/newest-constraints.txt`` pin the two ends that ``make test`` runs (the fast
subset on the oldest set, the full suite on the newest). These tests check that the
four say the same thing, and that the environment running them is inside the ranges.
"""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from keras_dp_lm import _keras_internals as keras_internals

ROOT = Path(__file__).resolve().parents[1]
STACK = ("keras", "keras-hub", "keras-nlp", "tensorflow", "tensorflow-text")


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_canonical(r.name): r for r in map(Requirement, project["dependencies"])}


def _pins(name):
    pins = {}
    for line in (ROOT / "ci" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", line
            pins[_canonical(requirement.name)] = Version(spec.version)
    return pins


def _minors_in(specifier, major, up_to=80):
    """The ``major.minor`` series the specifier admits (each checked at .0 and a late patch)."""
    return tuple(f"{major}.{m}" for m in range(up_to)
                 if specifier.contains(f"{major}.{m}.0") and specifier.contains(f"{major}.{m}.99"))


def _minor(version):
    return f"{version.major}.{version.minor}"


def test_the_stack_is_declared_as_ranges_not_pins():
    requirements = _requirements()
    for name in STACK:
        operators = {spec.operator for spec in requirements[name].specifier}
        assert operators == {">=", "<"}, (name, str(requirements[name].specifier))


def test_keras_range_is_exactly_the_tested_keras_minors():
    assert _minors_in(_requirements()["keras"].specifier, 3) == keras_internals.TESTED_KERAS


def test_keras_hub_and_keras_nlp_ranges_are_exactly_the_tested_keras_hub_minors():
    requirements = _requirements()
    for name in ("keras-hub", "keras-nlp"):  # keras-nlp is KerasHub under its old name
        assert _minors_in(requirements[name].specifier, 0) == keras_internals.TESTED_KERAS_HUB, name


def test_tensorflow_text_follows_tensorflow_minor_for_minor():
    requirements = _requirements()
    assert (_minors_in(requirements["tensorflow"].specifier, 2)
            == _minors_in(requirements["tensorflow-text"].specifier, 2))


def test_at_least_three_minors_of_each_are_supported():
    requirements = _requirements()
    for name, major in (("keras", 3), ("keras-hub", 0), ("tensorflow", 2)):
        assert len(_minors_in(requirements[name].specifier, major)) >= 3, name


@pytest.mark.parametrize("constraints,end", [("oldest-constraints.txt", 0),
                                             ("newest-constraints.txt", -1)])
def test_constraint_files_pin_the_ends_of_the_ranges(constraints, end):
    """The oldest set pins the lowest supported minor of Keras, TensorFlow and
    tensorflow-text, the newest the highest; KerasHub's ends follow Keras (KerasHub
    0.30+ needs Keras >= 3.15, so the oldest Keras comes with KerasHub 0.29). Every pin
    of a declared dependency is inside its range."""
    requirements, pins = _requirements(), _pins(constraints)
    for name, pin in pins.items():
        if name in requirements:
            assert requirements[name].specifier.contains(pin), (constraints, name, str(pin))
    assert _minor(pins["keras"]) == keras_internals.TESTED_KERAS[end]
    assert _minor(pins["keras-hub"]) == keras_internals.TESTED_KERAS_HUB[end]
    assert pins["keras-nlp"] == pins["keras-hub"]
    tensorflow_minors = _minors_in(requirements["tensorflow"].specifier, 2)
    assert _minor(pins["tensorflow"]) == tensorflow_minors[end]
    assert _minor(pins["tensorflow-text"]) == _minor(pins["tensorflow"])


def test_the_installed_stack_is_inside_the_declared_ranges():
    """Whichever set runs the tests (the newest in `make test`, the oldest in
    `make test-oldest`), it is one the package declares."""
    requirements = _requirements()
    for name in STACK + ("sentencepiece",):
        installed = importlib.metadata.version(name)
        assert requirements[name].specifier.contains(installed), (name, installed)
    assert _minor(Version(importlib.metadata.version("keras"))) in keras_internals.TESTED_KERAS
    assert (_minor(Version(importlib.metadata.version("keras-hub")))
            in keras_internals.TESTED_KERAS_HUB)


def test_an_untested_keras_is_refused_at_import():
    tested = keras_internals.TESTED_KERAS
    first, last = (int(v.split(".")[1]) for v in (tested[0], tested[-1]))
    for version in (f"3.{last + 1}.0", f"3.{first - 1}.9", "4.0.0"):
        with pytest.raises(ImportError, match="tested with Keras " + re.escape(", ".join(tested))):
            keras_internals._check_version(version)
    for minor in tested:
        keras_internals._check_version(minor + ".0")
        keras_internals._check_version(minor + ".3")
