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

import faulthandler
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import hangs, recorder
from .dist_report import report
from .dist_verdict import DistVerdict, judge_runs
from .distributed import rank_cases
from .families import ALL_CASES, Family
from .outcome import CaseRun, RankRun, decode
from .rank import call_numpy

__all__ = ["TRACE_BYTES", "conforms", "verdict_message"]

TRACE_BYTES = 4096  # one rank's trace, as JSON, in the watchdogs' exchange
ABORT_CODE = 3
LAST_RESORT_S = 30.0  # at most, after the timeout: faulthandler ends a rank whose watchdog could not run
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def last_resort(timeout: float) -> float:
    """The grace after a case's timeout before faulthandler ends the rank: long enough for a
    watchdog slowed by a loaded machine to say what happened first (it acts within 0.05 s when it
    can run), and no longer than a short timeout needs (3 x, from 10 s up to LAST_RESORT_S)."""
    return min(LAST_RESORT_S, max(10.0, 3.0 * timeout))


class _Watchdog(threading.Thread):
    """Aborts the job when a case overruns ``timeout``, after saying which ranks did what.

    Each rank's events also go to a file in a folder all ranks share (when
    they share one: one machine, or a shared file system), written before the
    rank blocks in a collective. Any rank whose watchdog can run reads every
    rank's file: mpi4py's pickle-based collectives (``allreduce``, ``bcast``)
    hold the GIL while they wait, so a stuck rank's own watchdog may never
    run. Without a shared folder the watchdogs swap their traces over MPI.
    """

    def __init__(self, comm: Any, timeout: float, name: str, folder: str | None) -> None:
        super().__init__(daemon=True)
        self.comm = comm  # a communicator of the watchdogs alone
        self.timeout = timeout
        self.name_of_fn = name
        self.folder = folder
        self.case: int | None = None
        self.label = ""
        self.started = 0.0
        self.events: list[dict] = []
        self.stop = threading.Event()
        self.stderr = _real_stderr()
        self.fd = None
        if folder is not None:
            path = os.path.join(folder, f"rank{comm.Get_rank()}.jsonl")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def begin(self, case: int, label: str) -> None:
        self.events = []
        self.label = label
        self.started = time.monotonic()
        self.sink({"e": "start", "c": case})
        self.case = case
        # the last resort, which needs no GIL: if even the watchdogs cannot run, end this rank
        grace = last_resort(self.timeout)
        faulthandler.dump_traceback_later(self.timeout + grace, exit=True, file=self.stderr)

    def finish(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.case = None

    def sink(self, event: dict) -> None:
        self.events.append(event)
        if self.fd is not None:
            os.write(self.fd, (json.dumps(event) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def run(self) -> None:
        while not self.stop.wait(0.05):
            if self.case is not None and time.monotonic() - self.started > self.timeout:
                self._abort(self.case)

    def _read(self, case: int) -> list[hangs.RankTrace] | None:
        """Every rank's trace of ``case``, from the shared folder."""
        if self.folder is None:
            return None
        traces = []
        for r in range(self.comm.Get_size()):
            try:
                with open(os.path.join(self.folder, f"rank{r}.jsonl"), "rb") as f:
                    lines = f.read().split(b"\n")
            except OSError:
                return None
            events = [json.loads(line) for line in lines if line.strip()]
            traces.append(hangs.trace_of([e for e in events if e.get("c") == case]))
        return traces

    def _exchange(self) -> list[hangs.RankTrace] | None:
        """Every rank's trace, if every rank's watchdog answers in time (no shared folder)."""
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

    def _first_to_say(self) -> bool:
        """One rank prints: the first whose watchdog gets here (a file only one can create)."""
        if self.folder is None:
            return self.comm.Get_rank() == 0
        try:
            os.close(os.open(os.path.join(self.folder, "said"), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except OSError:
            return False
        return True

    def _abort(self, case: int) -> None:
        rank = self.comm.Get_rank()
        traces = self._read(case) or self._exchange()
        head = f"gclip.testing.assert_conforms({self.name_of_fn}): {self.label}"
        if traces is None:
            mine = hangs.trace_of(list(self.events))
            where = f"waiting in {mine.inside}" if mine.inside else (mine.finished or "running")
            message = f"{head}: no answer within {self.timeout:g} s; rank {rank} was {where}; "
            message += "the other ranks did not answer"
        else:
            stuck = hangs.explain(traces, self.timeout)
            message = f"{head}: {stuck.reason}"
            # as the command names it: ranks that returned before a collective the others entered
            if stuck.kind == "skipped" and stuck.culprits:
                message += " (fingerprint: skip-collective, a rank returned before the all-reduce)"
        if traces is None or self._first_to_say():
            text = message + "; aborting the job: the collective can never complete\n"
            os.write(self.stderr, text.encode())
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
        else:
            time.sleep(2.0)  # let the first say it; abort ourselves if it could not
        self.comm.Abort(ABORT_CODE)


def _real_stderr() -> int:
    """The file descriptor of the real stderr. Under pytest's output capture, fd 2 is a
    temporary file that dies with an aborted rank: pytest keeps the real one aside."""
    capture = sys.modules.get("_pytest.capture")
    if capture is not None:
        try:
            for obj in gc.get_objects():
                if isinstance(obj, capture.CaptureManager):
                    saved = getattr(getattr(obj._global_capturing, "err", None), "targetfd_save", None)
                    if isinstance(saved, int):
                        return saved
        except Exception:  # noqa: BLE001 - pytest's internals moved: fd 2 it is
            pass
    return 2


def _shared_folder(comm: Any) -> str | None:
    """A folder every rank of ``comm`` can write and read, or None (ranks on other machines)."""
    folder = tempfile.mkdtemp(prefix="gclip-conforms-") if comm.Get_rank() == 0 else None
    folder = comm.bcast(folder, root=0)
    seen = folder is not None and os.path.isdir(folder)
    if all(comm.allgather(seen)):
        return folder
    if comm.Get_rank() == 0 and folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    return None


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
    fn: Callable[..., Any], comm: Any, *, count: int, seed: int, timeout: float, family: Family = ALL_CASES
) -> tuple[DistVerdict, str]:
    """Run every case through ``fn`` on the ranks of ``comm``; the verdict, the same on every rank."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    size, rank = comm.Get_size(), comm.Get_rank()
    cases, views, gallery = rank_cases(size, count, seed, family)
    side, watch = comm.Dup(), comm.Dup()
    user = recorder.recorded(comm.Dup())
    folder = _shared_folder(side)
    dog = _Watchdog(watch, timeout, name, folder)
    previous = recorder.current()
    rec = recorder.install(recorder.Recorder(dog.sink))
    restore_world = recorder.record_world()  # fn's MPI.COMM_WORLD records too, while it is judged
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
        dog.close()
        restore_world()
        if previous is not None:
            recorder.install(previous)
    side.Barrier()  # every rank is done with the folder
    if folder is not None and rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    for c in (side, watch, user):
        c.Free()
    note = f"cases of one family: {family.words()}" if family else None
    verdict = judge_runs(name, size, views, _runs(gathered), gallery, None, note)
    return verdict, verdict_message(verdict, name, seed)
