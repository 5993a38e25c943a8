"""What to judge: ``FILE.py:FUNC`` or ``package.module:func``, and how it is loaded."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Any, NamedTuple

from .._lab.cli import UsageError

__all__ = ["FORMS", "LoadError", "Target", "form_error", "load", "parse_target"]


class LoadError(UsageError):
    """The target cannot be loaded where it runs: its file raises, hangs or dies while loading, or
    has no such function. A usage error (exit 2); under ``--json`` it is printed as JSON too."""


class Target(NamedTuple):
    kind: str  # "file" or "module"
    where: str
    func: str

    def __str__(self) -> str:
        return f"{self.where}:{self.func}"


def parse_target(spec: str) -> Target:
    """``FILE.py:FUNC`` or ``package.module:func`` (``FILE.py`` alone means ``solve``)."""
    where, sep, func = spec.rpartition(":")
    if not sep:
        where, func = spec, "solve" if spec.endswith(".py") else ""
    if not where or not func:
        raise UsageError(f"bad target {spec!r}: give FILE.py:FUNC or module:func")
    if not all(part.isidentifier() for part in func.split(".")):
        raise UsageError(f"bad target {spec!r}: {func!r} is not a function name")
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise UsageError(f"no such file: {where}")
        return Target("file", where, func)
    if not all(part.isidentifier() for part in where.split(".")):
        raise UsageError(f"bad target {spec!r}: {where!r} is neither a .py file nor a module name")
    return Target("module", where, func)


def load(kind: str, where: str, func: str) -> tuple[Any, str | None]:
    """(the function, a note) in the process that will call it.

    Raises LookupError when the file has no such callable; anything the file
    itself raises while loading propagates (the caller reports it). A file
    that calls ``sys.exit()`` while loading (a script that runs its own
    checks) keeps what it defined, and the note says so.
    """
    note = None
    if kind == "file":
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec = importlib.util.spec_from_file_location("__judged__", where)
        if spec is None or spec.loader is None:
            raise ImportError(f"not a Python file: {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["__judged__"] = module
        try:
            spec.loader.exec_module(module)
        except SystemExit as exc:
            note = f"the file called sys.exit({exc.code!r}) while loading; judging what it defined"
    else:
        module = importlib.import_module(where)
    fn: Any = module
    for part in func.split("."):
        if not hasattr(fn, part):
            raise LookupError(f"no function {func!r} in {where}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise LookupError(f"{func!r} in {where} is not callable (type {type(fn).__name__})")
    return fn, note


# the forms the judge calls a function in: (its flags, its arguments)
FORMS = {
    "single": ("", "(shards, limit)"),
    "numpy": (" --ranks 2", "(grads, max_norm, comm)"),
    "torch": (" --ranks 2 --torch", "(parameters, max_norm, group)"),
    "layout": (" --layout dp=2", "(grads, max_norm, comm, mesh, replicated)"),
    "torch-layout": (" --layout dp=2 --torch", "(parameters, max_norm, layout)"),
}


def _arity(fn: Any) -> tuple[int, float] | None:
    """(the positional arguments ``fn`` needs, the most it takes), or None when unknown."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or the like: call it and see
        return None
    need, most = 0, 0.0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            most = math.inf
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            most += 1
            need += p.default is p.empty
        elif p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            return (need, -1.0)  # a required keyword: no form of the judge's can call it
    return need, most


def form_error(fn: Any, form: str, target: str) -> str | None:
    """Why ``fn`` cannot be called in ``form`` (a key of FORMS), naming the command that fits;
    None when it can (or its signature cannot be read). A usage error, not a failed check: the
    judge would otherwise call a right answer with the wrong arguments."""
    arity = _arity(fn)
    args = len(FORMS[form][1].split(","))
    if arity is None or arity[0] <= args <= arity[1]:
        return None
    need, most = arity
    takes = f"{need}" if need == most else f"{need} or more" if most == math.inf else f"{need} to {most:g}"
    name = getattr(fn, "__name__", target.rpartition(":")[2])
    if most < 0:
        return f"{name} has a required keyword-only argument: the judge calls {FORMS[form][1]} positionally"
    fits = [f for f, (_, a) in FORMS.items() if f != form and need <= len(a.split(",")) <= most]
    plural = "s" * (takes != "1")
    head = f"{name} takes {takes} positional argument{plural}, not the {args} of {FORMS[form][1]}"
    if not fits:
        return f"{head}: no form of the judge's fits ({', '.join(a for _, a in FORMS.values())})"
    flags, shape = FORMS[fits[0]]
    return f"{head}: for a {shape} function, run python -m gclip.conformance {target}{flags}"
