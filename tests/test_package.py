"""The package's own surface: no deprecated module paths, and its code structure (issue 39)."""

import importlib

import pytest

import keras_dp_lm


@pytest.mark.parametrize("old", ["vocab", "sampling", "generation", "fast_clipping", "losses"])
def test_removed_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"keras_dp_lm.{old}")
    assert old not in keras_dp_lm.__all__
    with pytest.raises(AttributeError):
        getattr(keras_dp_lm, old)


# -- code structure (issue 39) -------------------------------------------------
import ast  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

PACKAGE = pathlib.Path(keras_dp_lm.__file__).parent
MAX_MODULE_LINES = 500


def _modules():
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def _relative(path):
    return path.relative_to(PACKAGE).as_posix()


def _subpackage(parts):
    """``keras_dp_lm.<sub>...`` -> its subpackage (``clipping.rules`` is one of
    its own); modules directly in keras_dp_lm -> the top level."""
    parts = list(parts)
    if parts[:1] == ["keras_dp_lm"]:
        parts = parts[1:]
    if len(parts) >= 2 and parts[:2] == ["clipping", "rules"]:
        return "clipping.rules"
    if parts and (PACKAGE / parts[0]).is_dir():
        return parts[0]
    return ""


def _private_imports_across_subpackages():
    crossings = []
    for path in _modules():
        relative = path.relative_to(PACKAGE).with_suffix("").parts
        own = _subpackage(relative[:-1] if relative[-1] == "__init__" else relative)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith("keras_dp_lm"):
                continue
            for alias in node.names:
                target = node.module.split(".") + [alias.name]
                if target[:1] == ["keras_dp_lm"] and len(target) == 2 and \
                        (PACKAGE / f"{alias.name}.py").is_file():
                    continue   # a top-level private module: the floor every room shares
                if alias.name.startswith("_") and _subpackage(target) != own:
                    crossings.append(f"{_relative(path)}:{node.lineno} imports "
                                     f"{alias.name} from {node.module}")
    return crossings


def test_no_module_is_over_500_lines():
    long = {_relative(path): n for path in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_private_name_is_imported_across_subpackages():
    assert _private_imports_across_subpackages() == []


def test_only_keras_internals_touches_keras_private_trees():
    touches = [f"{_relative(path)}:{number}" for path in _modules()
               if _relative(path) != "_keras_internals.py"
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if "keras.src" in line or "keras_hub.src" in line]
    assert touches == []


def test_built_in_clipping_rules_register_through_the_public_decorator():
    import keras

    from keras_dp_lm.clipping import registry
    from keras_dp_lm.clipping import rules

    assert "_register_builtin_rules" not in vars(registry)
    source = "\n".join(path.read_text() for path in (PACKAGE / "clipping" / "rules").glob("*.py"))
    assert "_RULES_BY_CLASS" not in source
    assert "@register_clipping_rule(keras.layers.Dense)" in source
    registered = registry._rules()
    for layer_class in (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding,
                        keras.layers.LayerNormalization, keras.layers.GroupNormalization,
                        keras.layers.Conv1D, keras.layers.Conv2D):
        assert layer_class in registered
    assert registered[keras.layers.Dense] is rules.dense._DenseRule
    # a custom rule registers the same way
    class _Custom(keras.layers.Dense):
        pass

    try:
        assert keras_dp_lm.clipping.register_clipping_rule(_Custom)(
            rules.dense._DenseRule) is rules.dense._DenseRule
        assert registered[_Custom] is rules.dense._DenseRule
    finally:
        registered.pop(_Custom, None)


# -- the import graph (issue 51: no circles) ------------------------------------
def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """module -> the package's modules it imports, at module level or inside a
    function (an import inside a function is an arrow all the same)."""
    names = {_module_name(path): path for path in _modules()}
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                modules = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for module in modules:
                while module and module not in names:
                    module = module.rpartition(".")[0]
                if module and module != name and not name.startswith(module + "."):
                    targets.add(module)
        graph[name] = targets
    return graph


def _circles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_package_has_no_import_circle():
    """No module imports, directly or through others, one that imports it: e.g.
    ``training/`` is ordered marks -> ledger -> model ledgers -> guards -> step ->
    binding, and a lower floor notifies a higher one through a listener
    (``weight_marks.on_marked``, ``clipping.registry.register_on_first_use``),
    never by importing it."""
    assert [sorted(c) for c in _circles(_import_graph())] == []


def test_keras_internals_sits_below_every_room():
    """The one module that touches Keras's private API imports nothing of the package."""
    graph = _import_graph()
    assert graph["keras_dp_lm._keras_internals"] == set()


REVIEW_ID = re.compile(r"\b(r\d{2}[a-z]?,? ?[A-Z]\d|[Rr]eview r?\d|[Aa]udit F\d|review[ ]round)")


def test_no_review_round_ids_in_package_or_tests():
    """Code and tests say what they protect, not which review found it."""
    tests = PACKAGE.parent / "tests"
    found = [f"{path.name}:{number}" for path in [*_modules(), *sorted(tests.glob("*.py"))]
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if REVIEW_ID.search(line)]
    assert found == []
