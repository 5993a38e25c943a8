"""The bug gallery, listed: ``--list-bugs`` (text or ``--json``)."""

from __future__ import annotations

from .._lab.jsonout import dumps
from ..gallery import BUGS, LAYOUT_BUGS, USAGE_BUGS, card
from .options import USAGE_SEE
from .text import ansi_pad, bold, red

__all__ = ["render_bugs"]


NO_INCIDENT = "(no public incident confirmed: a teaching example)"


def render_bugs(as_json: bool) -> str:
    """The gallery: name, summary, where it happened; the combine bugs, the layout bugs,
    then the bugs of how a training loop calls the clip (shown with gclip.torch)."""
    if as_json:
        items = [{**b.as_dict(), "kind": "combine", "buggy": True} for b in BUGS]
        items += [{**b.as_dict(), "kind": "layout", "buggy": True} for b in LAYOUT_BUGS]
        items += [{**card(b), "kind": "usage", "buggy": False, "see": USAGE_SEE} for b in USAGE_BUGS]
        return dumps(items, separators=(",", ":"))
    total = len(BUGS) + len(LAYOUT_BUGS) + len(USAGE_BUGS)
    width = max(22, 2 + max(len(b.name) for b in (*BUGS, *LAYOUT_BUGS, *USAGE_BUGS)))
    pad = width + ansi_pad(red(""))
    lines = [bold(f"gclip bug gallery: {total} ways to get global-norm clipping wrong"), ""]
    lines.append(
        bold(f"How the norm is combined ({len(BUGS)}): mpirun -n 4 python -m gclip.demo --buggy NAME")
    )
    for b in BUGS:
        lines.append(f"  {red(b.name):<{pad}}{b.summary}")
        lines.append(f"  {'':<{width}}seen in: {b.incident or NO_INCIDENT}")
    run = "mpirun -n 8 python -m gclip.demo --layout AXES --buggy NAME"
    lines += ["", bold(f"What the clip is told about the layout ({len(LAYOUT_BUGS)}): {run}")]
    for b in LAYOUT_BUGS:
        lines.append(f"  {red(b.name):<{pad}}{b.summary}")
        lines.append(f"  {'':<{width}}seen in: {b.incident}")
        lines.append(f"  {'':<{width}}shows on: --layout {b.shows_on}")
    lines += [
        "",
        bold(f"How the training loop calls the clip ({len(USAGE_BUGS)}): usage bugs, not run by --buggy"),
        f"  (the clip is right, the loop around it is not: see {USAGE_SEE})",
    ]
    for b in USAGE_BUGS:
        lines.append(f"  {red(b.name):<{pad}}[usage bug] {b.summary}")
        lines.append(f"  {'':<{width}}seen in: {b.incident}")
    return "\n".join(lines)
