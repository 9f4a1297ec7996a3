"""Type annotations (PEP 484) on the public API: every parameter and return of every
public callable is annotated, and ``typing.get_type_hints`` resolves them.

The public API is found, not listed: every public module of the package that
declares ``__all__`` (``keras_dp_lm`` itself, its subpackages, ``corpora``,
``errors``, ...), every function and class its ``__all__`` names, and every
public method, property and constructor of those classes and of their bases
defined in the package. Annotations that only a type checker imports (under
``if TYPE_CHECKING:``) are resolved with those imports run.
"""

import ast
import importlib
import inspect
import pathlib
import sys
import typing

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

import keras_dp_lm


PACKAGE = pathlib.Path(keras_dp_lm.__file__).parent
# Names an annotation may use without its module importing them at run time.
COMMON_NAMES = {"keras": keras, "tf": tf, "np": np, "dp_accounting": dp_accounting}


def _public_modules():
    """keras_dp_lm and each of its modules whose dotted name has no private part
    and that declares ``__all__``."""
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if any(part.startswith("_") for part in parts):
            continue
        module = importlib.import_module(name)
        if hasattr(module, "__all__"):
            modules.append(module)
    return modules


def _function_of(member):
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__, isinstance(member, classmethod)
    if isinstance(member, property):
        return member.fget, True
    if inspect.isfunction(member):
        return member, True
    return None, False


def _class_callables(cls):
    """(qualified name, function, whether its first parameter is self / cls) of the
    constructor and public methods of ``cls`` and its bases in the package."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("keras_dp_lm"):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            function, bound = _function_of(member)
            if function is not None:
                yield f"{klass.__module__}.{klass.__qualname__}.{name}", function, bound


def public_callables():
    """Every public callable of the package: (qualified name, function, bound)."""
    seen, found = set(), {}
    for module in _public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                for qualified, function, bound in _class_callables(obj):
                    found.setdefault(qualified, (function, bound))
                if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
                    found.setdefault(f"{obj.__module__}.{obj.__qualname__}", (obj, False))
            else:
                found.setdefault(f"{obj.__module__}.{obj.__qualname__}", (obj, False))
    return found


def _type_checking_names(module):
    """What the module's ``if TYPE_CHECKING:`` blocks import."""
    names = {}
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return names
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and \
                ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exec(compile(ast.Module(body=node.body, type_ignores=[]),  # noqa: S102
                         module.__file__, "exec"), names)
    names.pop("__builtins__", None)
    return names


def _namespace(obj):
    module = sys.modules[obj.__module__]
    return {**COMMON_NAMES, **vars(module), **_type_checking_names(module)}


def missing_annotations(function, bound):
    """Parameters (and ``return``) of ``function`` without an annotation."""
    if inspect.isclass(function):  # a named tuple: its fields
        return [field for field in function._fields
                if field not in getattr(function, "__annotations__", {})]
    function = inspect.unwrap(function)  # e.g. functools.lru_cache
    annotations = function.__annotations__
    parameters = list(inspect.signature(function, follow_wrapped=False).parameters)
    if bound:
        parameters = parameters[1:]
    missing = [name for name in parameters if name not in annotations]
    if "return" not in annotations:
        missing.append("return")
    return missing


def unresolved(function):
    """Why ``typing.get_type_hints`` fails on ``function`` (None when it resolves)."""
    try:
        typing.get_type_hints(function, globalns=_namespace(function))
    except Exception as error:  # noqa: BLE001  pylint: disable=broad-except
        return f"{type(error).__name__}: {error}"
    return None


def test_public_api_is_found():
    callables = public_callables()
    assert len(callables) > 250, len(callables)
    for name in ("keras_dp_lm.accounting.epsilon.compute_epsilon",
                 "keras_dp_lm.optimizers.dp_optimizer.DPOptimizer.__init__",
                 "keras_dp_lm.samplers.budget.DecodingBudget.spent",
                 "keras_dp_lm.corpora.load_kjv",
                 "keras_dp_lm.callbacks.privacy_accountant.PrivacyAccountant.__init__",
                 "keras_dp_lm.callbacks.privacy_accountant.PrivacyAccountant.report"):
        assert name in callables


def test_every_public_parameter_and_return_is_annotated():
    missing = {name: names for name, (function, bound) in public_callables().items()
               if (names := missing_annotations(function, bound))}
    assert not missing, "\n".join(f"{name}: {names}" for name, names in sorted(missing.items()))


def test_every_public_annotation_resolves():
    failures = {name: why for name, (function, _) in public_callables().items()
                if (why := unresolved(function))}
    assert not failures, "\n".join(f"{name}: {why}" for name, why in sorted(failures.items()))


def test_the_checks_catch_a_missing_or_unresolvable_annotation():
    def unannotated(x, y: int = 0):
        return x

    def unresolvable(x: "NoSuchType") -> int:  # noqa: F821
        return 0

    def annotated(x: "tf.Tensor", y: int = 0) -> "np.ndarray | None":
        return None

    assert missing_annotations(unannotated, False) == ["x", "return"]
    assert missing_annotations(annotated, False) == []
    assert unresolved(unresolvable).startswith("NameError")
    assert unresolved(annotated) is None


def test_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()
