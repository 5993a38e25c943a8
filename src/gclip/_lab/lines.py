"""How the lab's commands print an exception: one line, cut to a width."""

from __future__ import annotations

from ..errors import one_line

__all__ = ["exception_line"]


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
