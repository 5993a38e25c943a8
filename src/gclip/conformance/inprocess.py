"""The distributed judge inside a user's own MPI job: ``gclip.testing.assert_conforms``.

The ranks of the user's test run the same cases as the command, each on its
share, with the same recorded communicator. Between cases they meet in a
nonblocking barrier on a communicator of their own. At the end every rank
gathers every rank's outcomes and computes the same verdict from the same
data, so every rank passes, or raises the same AssertionError.

A case that never finishes cannot be judged from inside: a rank stuck in a
collective never comes back to Python. A watchdog thread on each rank (mpi4py
releases the GIL while MPI waits) notices the overrun, the watchdogs swap
what their ranks did over a third communicator (each rank's trace, as the
command's ranks write it to a file), rank 0 prints the reason that names the
ranks, and the job is aborted: the user's suite ends with a message instead
of hanging.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import hangs, recorder
from .distributed import rank_cases
from .dreport import report
from .dverdict import DistVerdict, judge_runs
from .outcome import CaseRun, RankRun, decode
from .rank import call_numpy

__all__ = ["TRACE_BYTES", "conforms", "verdict_message"]

TRACE_BYTES = 4096  # one rank's trace, as JSON, in the watchdogs' exchange
ABORT_CODE = 3
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Watchdog(threading.Thread):
    """Aborts the job when a case overruns ``timeout``, after saying which ranks did what."""

    def __init__(self, comm: Any, timeout: float, name: str) -> None:
        super().__init__(daemon=True)
        self.comm = comm  # a communicator of the watchdogs alone
        self.timeout = timeout
        self.name_of_fn = name
        self.case: int | None = None
        self.label = ""
        self.started = 0.0
        self.events: list[dict] = []
        self.stop = threading.Event()

    def begin(self, case: int, label: str) -> None:
        self.events = [{"e": "start", "c": case}]
        self.label = label
        self.started = time.monotonic()
        self.case = case

    def finish(self) -> None:
        self.case = None

    def sink(self, event: dict) -> None:
        self.events.append(event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            if self.case is not None and time.monotonic() - self.started > self.timeout:
                self._abort()

    def _exchange(self) -> list[hangs.RankTrace] | None:
        """Every rank's trace, if every rank's watchdog answers in time."""
        mine = json.dumps(list(hangs.trace_of(list(self.events)))).encode()[:TRACE_BYTES]
        send = np.zeros(TRACE_BYTES, dtype=np.uint8)
        send[: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        recv = np.zeros((self.comm.Get_size(), TRACE_BYTES), dtype=np.uint8)
        request = self.comm.Iallgather(send, recv)
        deadline = time.monotonic() + max(self.timeout, 5.0)
        while not request.Test():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        traces = []
        for row in recv:
            fields = json.loads(bytes(row).rstrip(b"\0").decode() or "[]")
            traces.append(hangs.RankTrace(*fields) if fields else hangs.RankTrace())
        return traces

    def _abort(self) -> None:
        rank = self.comm.Get_rank()
        traces = self._exchange()
        head = f"gclip.testing.assert_conforms({self.name_of_fn}): {self.label}"
        if traces is None:
            mine = hangs.trace_of(list(self.events))
            where = f"waiting in {mine.inside}" if mine.inside else (mine.finished or "running")
            message = f"{head}: no answer within {self.timeout:g} s; rank {rank} was {where}; "
            message += "the other ranks did not answer"
        else:
            stuck = hangs.explain(traces, self.timeout)
            message = f"{head}: {stuck.reason}"
            if stuck.kind == "skipped":
                message += " (fingerprint: skip-collective, a rank returned before the all-reduce)"
        if traces is None or rank == 0:
            sys.stderr.write(message + "; aborting the job: the collective can never complete\n")
            sys.stderr.flush()
        else:
            time.sleep(2.0)  # let rank 0 say it first; abort ourselves if it could not
        self.comm.Abort(ABORT_CODE)


def _runs(gathered: list[list[dict]]) -> list[CaseRun]:
    """Every case's CaseRun from each rank's outcome events (in case order)."""
    runs = []
    for i in range(len(gathered[0])):
        ranks = []
        for events in gathered:
            ev = events[i]
            ops = tuple(ev.get("ops", ()))
            if ev["kind"] == "value":
                ranks.append(RankRun("value", decode(ev["value"]), None, ops))
            else:
                ranks.append(RankRun(ev["kind"], None, ev.get("msg"), ops))
        runs.append(CaseRun(ranks))
    return runs


def verdict_message(v: DistVerdict, name: str, seed: int, shown: int = 3) -> str:
    """The AssertionError's text: the command's report, without colours."""
    lines = report(v, mode="numpy", layout=None, seed=seed, shown=shown)
    lines[0] = f"gclip.testing.assert_conforms: {name} on {v.size} rank{'s' * (v.size != 1)}"
    return _ANSI.sub("", "\n".join(lines))


def conforms(
    fn: Callable[..., Any], comm: Any, *, count: int, seed: int, timeout: float
) -> tuple[DistVerdict, str]:
    """Run every case through ``fn`` on the ranks of ``comm``; the verdict, the same on every rank."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    size, rank = comm.Get_size(), comm.Get_rank()
    cases, views, gallery = rank_cases(size, count, seed)
    side, watch = comm.Dup(), comm.Dup()
    user = recorder.recorded(comm.Dup())
    dog = _Watchdog(watch, timeout, name)
    previous = recorder.current()
    rec = recorder.install(recorder.Recorder(dog.sink))
    dog.start()
    mine: list[dict] = []
    try:
        for i, case in enumerate(cases):
            dog.begin(i, case.label)
            rec.begin(i)
            event = call_numpy(fn, case.ranks[rank], case.max_norm, user)
            rec.end()
            event["ops"] = [e["op"] for e in dog.events if e.get("e") == "enter"]
            dog.sink({"e": "outcome", "c": i, **event})
            request = side.Ibarrier()
            while not request.Test():
                time.sleep(0.0002)
            dog.finish()
            mine.append(event)
        gathered = side.allgather(mine)
    finally:
        dog.stop.set()
        dog.join()
        if previous is not None:
            recorder.install(previous)
        for c in (side, watch, user):
            c.Free()
    verdict = judge_runs(name, size, views, _runs(gathered), gallery, None)
    return verdict, verdict_message(verdict, name, seed)
