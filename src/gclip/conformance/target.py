"""What to judge: ``FILE.py:FUNC`` or ``package.module:func``."""

from __future__ import annotations

import os
from typing import NamedTuple

from .._lab.cli import UsageError

__all__ = ["Target", "parse_target"]


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
