"""Errors every rank agrees on.

A rank that raises while the others wait in a collective hangs the job. gclip
therefore never raises alone: an error found on one rank travels in the
header all-reduce, every rank learns of it at the same moment, and every rank
raises the same class with the same message, naming the offending rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AgreedError",
    "GclipError",
    "GclipTypeError",
    "GclipValueError",
    "NonFiniteNormError",
    "exception_line",
    "one_line",
]


class GclipError(Exception):
    """Base of every error gclip raises on purpose."""


class GclipValueError(GclipError, ValueError):
    """A bad value (negative limit, invalid norm type, ranks that disagree...)."""


class GclipTypeError(GclipError, TypeError):
    """A bad type (non-float array, nested lists...)."""


class NonFiniteNormError(GclipError, FloatingPointError, RuntimeError):
    """The global norm is inf or NaN and ``error_if_nonfinite=True``.

    Also a RuntimeError: what torch's clip raises, so ``except RuntimeError`` catches both."""


class AgreedError:
    """Builds the one exception all ranks raise from what each rank reported."""

    @staticmethod
    def from_reports(reports: Sequence[Any], mismatch: bool) -> GclipError:
        """``reports[r]`` is rank r's ``(error, arguments)``; error is (type name, message) or None."""
        size = len(reports)
        if mismatch:
            seen: dict[str, list[int]] = {}
            for rank, (_, args) in enumerate(reports):
                seen.setdefault(args, []).append(rank)
            parts = "; ".join(f"{_ranks(r)}: {args}" for args, r in seen.items())
            return GclipValueError(one_line(f"ranks disagree on the arguments ({parts})"))
        bad = [(rank, err) for rank, (err, _) in enumerate(reports) if err is not None]
        kind, message = bad[0][1]
        same = [rank for rank, err in bad if err == bad[0][1]]
        where = f"{_ranks(same)} of {size}"
        if len(same) < len(bad):
            where += f" (and {_ranks([r for r, _ in bad if r not in same])} with other errors)"
        cls = _CLASSES.get(kind, GclipError)
        if cls is GclipError and kind != "GclipError":
            message = f"{kind}: {message}"
        return cls(one_line(f"{where}: {message}"))


def one_line(text: str) -> str:
    """Messages are one line, whatever the caller's objects look like when printed."""
    return " ".join(str(text).split())


def exception_line(exc: BaseException, *, limit: int | None = None, with_type: bool = True) -> str:
    """An exception as one line: ``Type: message`` (the type alone if it says nothing).

    ``with_type=False`` keeps gclip's own messages as they are (they name their
    cause already); ``limit`` cuts the line to that many characters.
    """
    text = one_line(str(exc))
    if with_type or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_CLASSES: dict[str, type[GclipError]] = {
    "GclipError": GclipError,
    "GclipValueError": GclipValueError,
    "ValueError": GclipValueError,
    "GclipTypeError": GclipTypeError,
    "TypeError": GclipTypeError,
    "NonFiniteNormError": NonFiniteNormError,
}
