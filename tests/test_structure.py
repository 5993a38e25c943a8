"""The package's shape: no import cycle, the core never imports the lab, no module over 600 lines.

The import graph is read from the source with ``ast`` (nothing is imported):
every ``import`` and ``from ... import`` of a gclip module, relative or
absolute, at any depth (inside functions too), is an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "gclip"
CORE = {
    "gclip",
    "gclip.errors",
    "gclip._validate",
    "gclip.partials",
    "gclip._kernels",
    "gclip.strategies",
    "gclip.engine",
    "gclip.clip",
    "gclip.contract",
    "gclip.layout",
}
LAB = ("gclip.demo", "gclip.train", "gclip.conformance", "gclip.bench", "gclip._lab", "gclip.classroom")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is, or is in: the longest gclip module that prefixes it."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gclip modules ``module`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from X import y`: y is a submodule of X, or a name defined in X
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_relative_absolute_and_function_level_imports():
    assert "gclip.errors" in GRAPH["gclip._lab.cli"]  # from ..errors import ...
    assert "gclip.demo.options" in GRAPH["gclip.demo.command"]  # from .options import ...
    assert "gclip" in GRAPH["gclip.bench.ops"]  # `import gclip` inside a function
    assert "gclip._lab.plots" in GRAPH["gclip.demo.figure"]  # from .._lab import plots (a submodule)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    assert _cycle(GRAPH) is None, f"import cycle: {' -> '.join(_cycle(GRAPH) or [])}"


def test_every_core_module_is_there():
    assert CORE <= set(MODULES), CORE - set(MODULES)


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_imports_nothing_from_the_lab(module):
    seen, todo = set(), [module]
    while todo:  # everything the module imports, directly or not
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    lab = sorted(m for m in seen if m.startswith(LAB))
    assert not lab, f"{module} imports the lab: {lab}"


def test_the_old_flat_lab_modules_are_gone():
    for name in ("demo.py", "train.py", "conformance.py", "bench.py", "plots.py", "_cli.py"):
        assert not (PACKAGE / name).exists(), name


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines"
