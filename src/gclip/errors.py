"""The errors gclip raises, each one line.

A rank that raises while the others wait in a collective hangs the job. gclip
therefore never raises alone: an error found on one rank travels in the
header all-reduce, every rank learns of it at the same moment, and every rank
raises the same class with the same message, naming the offending rank
(``engine.agreed_error`` builds it from what each rank reported).
"""

from __future__ import annotations

__all__ = [
    "GclipError",
    "GclipTypeError",
    "GclipValueError",
    "NonFiniteNormError",
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


def one_line(text: str) -> str:
    """Messages are one line, whatever the caller's objects look like when printed."""
    return " ".join(str(text).split())
