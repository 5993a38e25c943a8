"""The bug gallery, listed: ``--list-bugs`` (text or ``--json``)."""

from __future__ import annotations

from .._lab.jsonout import dumps
from ..strategies import BUGS
from .text import ansi_pad, bold, red

__all__ = ["render_bugs"]


def render_bugs(as_json: bool) -> str:
    """The gallery: name, summary, where it happened."""
    if as_json:
        return dumps([b.as_dict() for b in BUGS], separators=(",", ":"))
    lines = [bold(f"gclip bug gallery: {len(BUGS)} ways to get global-norm clipping wrong"), ""]
    for b in BUGS:
        lines.append(f"  {red(b.name):<{14 + ansi_pad(red(''))}}{b.summary}")
        lines.append(f"  {'':<14}seen in: {b.incident}")
    lines += ["", "Run one next to the correct clip: mpiexec -n 4 python -m gclip.demo --buggy NAME"]
    return "\n".join(lines)
