"""A case that never finished, in words that name the ranks.

Each rank told the judge, event by event, what it did in the case: the
collectives it entered (and left), and whether it returned or raised. When
the case does not finish in time, or a rank dies, :func:`explain` reads those
traces and says who did what: "rank 2 returned without entering the
collective; ranks 0, 1 waited in Allreduce". The same function serves the
command's job (traces from the ranks' event files) and
``gclip.testing.assert_conforms`` (traces exchanged by the ranks' watchdogs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..layout import ranges

__all__ = ["RankTrace", "Stuck", "explain", "rank_list", "trace_of"]


class RankTrace(NamedTuple):
    """One rank in one case, from its events."""

    started: bool = False
    entered: tuple[str, ...] = ()  # the collectives it entered, in order
    inside: str | None = None  # the one it is waiting in (entered, not left)
    finished: str | None = None  # "returned", or "raised ValueError: ...", "returned ..." (bad)
    died: str | None = None  # "exit code 9": its process ended during the case
    raised_in: str | None = None  # the collective an exception came out of


class Stuck(NamedTuple):
    """Why a case never finished: the reason, its kind, and the ranks that skipped."""

    reason: str
    kind: str  # "skipped", "raised", "died", "busy", "deadlock", "unknown"
    culprits: tuple[int, ...]  # the ranks that skipped, raised, died or kept running


def trace_of(events: Sequence[dict]) -> RankTrace:
    """A rank's trace from its events of one case (enter/leave/outcome)."""
    entered: list[str] = []
    open_ops: dict[int, str] = {}
    finished = None
    started = False
    raised_in = None
    for ev in events:
        kind = ev.get("e")
        if kind == "start":
            started = True
        elif kind == "enter":
            entered.append(ev["op"])
            open_ops[ev["n"]] = ev["op"]
        elif kind == "leave":
            open_ops.pop(ev["n"], None)
            if ev.get("raised"):
                raised_in = ev["op"]
        elif kind == "outcome":
            finished = "returned" if ev["kind"] in ("value", "bad") else f"raised {ev.get('msg', '')}"
    inside = open_ops[max(open_ops)] if open_ops else None
    return RankTrace(started or bool(entered), tuple(entered), inside, finished, None, raised_in)


def rank_list(ranks: Sequence[int]) -> str:
    """'2', '0, 1', '0, 1, 2', '0-5, 7': short, and plain for the few ranks a learner runs."""
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks)) if len(ranks) <= 3 else ranges(ranks)


def _who(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_list(ranks)}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _waiting_words(traces: Sequence[RankTrace], waiting: Sequence[int]) -> str:
    """'ranks 0, 1 waited in Allreduce' (grouped by where they wait)."""
    where: dict[str, list[int]] = {}
    for r in waiting:
        where.setdefault(traces[r].inside or "?", []).append(r)
    parts = [f"{_who(rs)} waited in {op}" for op, rs in where.items()]
    return ", ".join(parts)


def explain(traces: Sequence[RankTrace], seconds: float | None = None) -> Stuck:
    """Why the case never finished, naming ranks (see the module docstring)."""
    ranks = range(len(traces))
    dead = [r for r in ranks if traces[r].died]
    waiting = [r for r in ranks if traces[r].inside and not traces[r].died]
    finished = [r for r in ranks if traces[r].finished and not traces[r].inside and not traces[r].died]
    busy = [r for r in ranks if r not in dead and r not in waiting and r not in finished]
    later = f" (ended after {seconds:g} s)" if seconds is not None else ""
    deepest = max((len(traces[r].entered) for r in waiting), default=0)

    def before(r: int) -> str:
        n = len(traces[r].entered)
        if traces[r].raised_in and (traces[r].finished or "").startswith("raised"):
            return f"inside {traces[r].raised_in} (its {_ordinal(n)} collective)"
        if n == 0:
            return "without entering the collective"
        if n < deepest:
            return f"after {n} collective{'s' * (n != 1)}, without entering the {_ordinal(deepest)}"
        return f"after entering {n} collective{'s' * (n != 1)}"

    if dead:
        r = dead[0]
        text = f"{_who(dead)} died during the call ({traces[r].died}), {before(r)}"
        if waiting:
            text += f"; {_waiting_words(traces, waiting)}"
        return Stuck(text + later, "died", tuple(dead))
    if finished and waiting:
        raised = [r for r in finished if (traces[r].finished or "").startswith("raised")]
        returned = [r for r in finished if r not in raised]
        parts = []
        if returned:
            parts.append(f"{_who(returned)} returned {before(returned[0])}")
        if raised:
            parts.append(f"{_who(raised)} {traces[raised[0]].finished} {before(raised[0])}")
        text = "; ".join(parts) + f"; {_waiting_words(traces, waiting)}"
        if busy:
            text += f"; {_who(busy)} still running outside any collective"
        kind = "raised" if raised and not returned else "skipped"
        return Stuck(text + later, kind, tuple(sorted(finished)))
    if busy and (waiting or finished):
        text = f"{_who(busy)} did not return: still running outside any collective (a loop or a sleep?)"
        if waiting:
            text += f"; {_waiting_words(traces, waiting)}"
        if finished:
            text += f"; {_who(finished)} returned"
        return Stuck(text + later, "busy", tuple(busy))
    if waiting and not busy:
        ops = {(traces[r].inside, len(traces[r].entered)) for r in waiting}
        if len(ops) > 1:
            text = f"deadlock: {_waiting_words(traces, waiting)}: no collective can complete"
        else:
            op = traces[waiting[0]].inside
            text = (
                f"deadlock: {_who(waiting)} all waited in {op}, which never completed "
                "(different communicators, sizes or partners on different ranks?)"
            )
        return Stuck(text + later, "deadlock", tuple(waiting))
    if busy:
        return Stuck(f"no rank returned: {_who(busy)} still running{later}", "busy", tuple(busy))
    return Stuck(f"every rank returned, but the job did not go on{later}", "unknown", ())
