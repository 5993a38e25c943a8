"""The package's shape: no import cycle, the core never imports the lab, no module over 600 lines,
the core has no hook for the lab (no steps to replace, no mode, no gallery bug) and stays small.

The core is the package's flat modules (``gclip/*.py``, the package's
``__init__`` among them): the numpy library. Two library packages sit beside it, over its
public pieces and never importing the lab: ``gclip/torch/`` (the torch front end: a second
reader, backend and driver) and ``gclip/limits/`` (per-group, adaptive and unit-wise limits).
The lab is every other subpackage (``gclip/gallery/``, ``demo/``, ``train/``,
``conformance/``, ``bench/``, ``_lab/``, ``testing/``, ``audit/``).

The import graph is read from the source with ``ast`` (nothing is imported):
every ``import`` and ``from ... import`` of a gclip module, relative or
absolute, at any depth (inside functions too), is an edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "gclip"
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


def _package(name: str) -> set[str]:
    return {m for m in MODULES if m == name or m.startswith(name + ".")}


# the core: gclip itself and its flat modules; torch and the limits: library packages over it;
# every other subpackage is the lab
CORE = {name for name, path in MODULES.items() if path.parent == PACKAGE}
TORCH = _package("gclip.torch")
LIMITS = _package("gclip.limits")
LIBRARY = CORE | TORCH | LIMITS
LAB = {name for name in MODULES if name not in LIBRARY}


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


def _reached(module: str) -> set[str]:
    """Everything ``module`` imports, directly or not."""
    seen, todo = set(), [module]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


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


def test_the_core_is_the_flat_modules():
    assert {"gclip", "gclip.engine", "gclip.clip", "gclip.policy", "gclip.replicas"} <= CORE
    assert {"gclip.torch", "gclip.torch._partials", "gclip.torch._dtensor"} <= TORCH
    assert {"gclip.gallery", "gclip.gallery.bugs", "gclip.testing", "gclip.demo.command"} <= LAB
    assert not any(name.startswith(("gclip.gallery", "gclip.conformance")) for name in CORE)
    assert {"gclip.limits", "gclip.limits.groups", "gclip.limits.units"} <= LIMITS


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_the_core_imports_nothing_from_the_lab(module):
    lab = sorted(_reached(module) & LAB)
    assert not lab, f"{module} imports the lab: {lab}"


def test_the_graph_catches_a_core_module_importing_the_lab():
    graph = {"gclip.engine": {"gclip.gallery.bugs"}, "gclip.gallery.bugs": set()}
    assert graph["gclip.engine"] & LAB  # the check above would fail on this


ENTRY_TYPES = ("Strategy", "LayoutBug", "UsageBug")


def _gallery_names() -> set[str]:
    """The gallery's bug names, read from its source: each entry's first string."""
    names = set()
    for path in (PACKAGE / "gallery").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            entry = isinstance(node, ast.Call) and getattr(node.func, "id", None) in ENTRY_TYPES
            if entry:
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value)
    return names


def test_the_gallery_names_its_bugs():
    assert {"per-rank", "fp16-sumsq", "dp-replicas-summed", "generator-consumed"} <= _gallery_names()


@pytest.mark.parametrize("module", sorted(CORE | TORCH))
def test_no_core_module_names_a_gallery_bug(module):
    """The core has no string that is a bug's name (the gallery's bugs are the lab's own programs)."""
    names = _gallery_names() - {"global"}
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    named = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names})
    assert not named, f"{module} names gallery bugs: {named}"


def test_the_old_flat_lab_modules_are_gone():
    for name in ("demo.py", "train.py", "conformance.py", "bench.py", "plots.py", "_cli.py"):
        assert not (PACKAGE / name).exists(), name


# The lab's bugs are its own programs, over the core's public checks, header, drivers and sums
# (gclip/gallery/program.py): no core module defines or names a hook through which a caller
# replaces a step, nor a mode. (multiply_by: the backends' multiply by a factor, no hook.)
HOOK_NAMES = frozenset(
    {
        "Steps",
        "CORRECT",
        "steps",
        "steps_for",
        "norm_by",
        "clip_by",
        "clip_simulated_by",
        "clip_grad_norm_by",
        "half_power_sum",
        "in_header",
        "fill",
        "mode",
    }
)
ENTRIES_BY = frozenset({"multiply_by"})


def names_in(tree: ast.AST) -> set[str]:
    """Every name a module defines or uses: definitions, parameters, keywords, attributes, imports."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.rpartition(".")[2])
    return found


def hook_names(tree: ast.AST) -> list[str]:
    """The names of a hook or a mode in a module: HOOK_NAMES, a ``*_by`` entry, or a string that
    says ``mode=`` (a message naming a mode)."""
    names = names_in(tree)
    found = {n for n in names if n in HOOK_NAMES or (n.endswith("_by") and n not in ENTRIES_BY)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.search(r"\bmode\s*=", node.value)
        ):
            found.add(f"{node.value[:40]!r}")
    return sorted(found)


def test_the_hook_check_sees_a_hook():
    hook = "class Steps: ...\ndef clip_by(steps, grads): ...\nlabel = f'mode={1}'\nx.norm_by(fill=0)"
    assert hook_names(ast.parse(hook)) == ["'mode='", "Steps", "clip_by", "fill", "norm_by", "steps"]
    assert hook_names(ast.parse("def multiply_by(a, factor): ...")) == []


# gclip.torch._limits is the limits' torch front end: its ``mode`` is ZClip's own ("zscore" or
# "percentile", the reference's signature), as in gclip.limits, which this check leaves alone too
HOOK_FREE = CORE | TORCH - {"gclip.torch._limits"}


@pytest.mark.parametrize("module", sorted(HOOK_FREE))
def test_no_core_module_defines_or_names_the_hook_or_a_mode(module):
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found = hook_names(tree)
    assert not found, f"{module} names the hook or a mode: {found}"


# The core's flat modules (the reader, the sums, the bins, the engine, the drivers, the layout,
# the scale rule, the errors, the front end) are read in an hour: at most CORE_LINES in all. The
# torch front end (gclip/torch/) is counted apart: a second reader, backend and driver.
CORE_LINES = 3500


def _lines(modules: set[str]) -> int:
    return sum(len(MODULES[name].read_text().splitlines()) for name in modules)


def test_the_core_never_imports_the_torch_front_end():
    # nor do the limits: gclip's __init__ imports them, and `import gclip` must not need torch
    reached = {name: sorted(_reached(name) & TORCH) for name in CORE | LIMITS}
    assert not {name: got for name, got in reached.items() if got}
    assert {"gclip.torch._dtensor", "gclip.engine"} <= GRAPH["gclip.torch._gradients"]  # edges are seen


def test_the_core_flat_modules_are_at_most_3500_lines():
    lines = _lines(CORE)
    assert lines <= CORE_LINES, f"the core is {lines} lines (the torch front end: {_lines(TORCH)})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines"
