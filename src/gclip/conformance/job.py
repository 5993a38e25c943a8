"""The judge's own MPI job: started, watched, and ended when a case never finishes.

``run_cases`` starts ``mpirun -n R python -m gclip.conformance.rank JOBDIR``
(through ``gclip._lab.mpirun.run``, in a thread) and tails the ranks' event
files. A case must finish on every rank within ``timeout`` seconds of its
start; if it does not, or a rank dies, the judge reads the ranks' traces
(``hangs.explain``), ends the job (SIGKILL to each rank's process group: the
ranks gave their pids first thing; mpirun then exits, and ``run``'s own
timeout is the backstop that ends the whole job), checks that no rank is
left, and starts a fresh job at the next case, up to ``MAX_LOST`` times.

Loading the file is watched too: a rank still loading it ``LOAD_LAG`` seconds
(or ``timeout``, if longer) after another rank has loaded it (its top level
sleeps, loops or waits on that rank), or every rank still loading it after
``START_TIMEOUT``, is a ``LoadError`` that names those ranks, and the job is ended.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._lab import mpirun
from . import hangs
from .hangs import rank_list
from .outcome import CaseRun, RankRun, decode
from .target import LoadError, Target

__all__ = ["LOAD_LAG", "MAX_LOST", "POLL_S", "START_TIMEOUT", "JobSpec", "Runs", "run_cases"]

MAX_LOST = 3  # cases that hang or kill a rank before the judge stops
START_TIMEOUT = 120.0  # seconds for every rank to start and load the function (torch is slow)
LOAD_LAG = 10.0  # seconds (or --timeout, if longer) a rank may still be loading after another loaded
POLL_S = 0.01


class JobSpec(NamedTuple):
    target: Target
    ranks: int
    mode: str  # "numpy", "torch" or "layout"
    layout: dict[str, int] | None
    timeout: float


class Runs(NamedTuple):
    runs: list[CaseRun]  # one per case run (fewer than the cases when the judge stopped)
    stopped: str | None
    note: str | None
    ran: list[int] | None = None  # the index of each run's case (None: the first len(runs) cases)
    not_run: dict[str, int] | None = None  # per family that crashed: how many of its cases were left


class _Rank:
    """What the judge knows of one rank: its pid, and its events by case."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.pid: int | None = None
        self.events: dict[int, list[dict]] = {}
        self.flags: dict[str, Any] = {}
        self.done = -1  # the last case it finished (after the barrier)

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            ev = json.loads(line)
            kind = ev["e"]
            if kind == "hello":
                self.pid = ev["pid"]
            elif kind in ("loading", "ready", "usage", "end"):
                self.flags[kind] = ev
            elif kind == "done":
                self.done = ev["c"]
            if "c" in ev:
                self.events.setdefault(ev["c"], []).append(ev)


def _kill(ranks: Sequence[_Rank]) -> None:
    """SIGKILL each rank's process group (Hydra gives each rank a session of its own)."""
    for r in ranks:
        if r.pid is None:
            continue
        try:
            if os.getpgid(r.pid) == r.pid and r.pid != os.getpgrp():
                os.killpg(r.pid, signal.SIGKILL)
            else:
                os.kill(r.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (ended, its parent not told yet) answers kill(0) but runs nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _rank_run(events: list[dict]) -> RankRun:
    ops = tuple(e["op"] for e in events if e["e"] == "enter")
    for ev in events:
        if ev["e"] == "outcome":
            if ev["kind"] == "value":
                return RankRun("value", decode(ev["value"]), None, ops)
            return RankRun(ev["kind"], None, ev.get("msg"), ops)
    return RankRun("lost", None, None, ops)


def _deaths(ranks: Sequence[_Rank], case: int) -> dict[int, str]:
    """The ranks that died in ``case``: neither finished nor waiting in a collective when the
    job ended (mpirun then killed the others, wherever they waited). Which exit status the
    dead rank had, mpirun does not reliably say (it reports one of the ranks it killed)."""
    dead = {}
    for i, r in enumerate(ranks):
        trace = hangs.trace_of(r.events.get(case, []))
        if trace.finished is None and trace.inside is None:
            dead[i] = "its process ended"
    return dead or {i: "its process ended" for i, r in enumerate(ranks) if "outcome" not in _kinds(r, case)}


class _Job:
    """One mpirun, from case ``first`` on."""

    def __init__(self, spec: JobSpec, jobdir: str, first: int, total: int) -> None:
        with open(os.path.join(jobdir, "job.json"), "w") as f:
            json.dump(
                {
                    "kind": spec.target.kind,
                    "where": os.path.abspath(spec.target.where)
                    if spec.target.kind == "file"
                    else spec.target.where,
                    "func": spec.target.func,
                    "mode": spec.mode,
                    "layout": spec.layout,
                    "first": first,
                },
                f,
            )
        for name in os.listdir(jobdir):
            if name.startswith(("rank", "torch-store")):
                os.unlink(os.path.join(jobdir, name))
        self.ranks = [_Rank(os.path.join(jobdir, f"rank{r}.jsonl")) for r in range(spec.ranks)]
        self.result: list[Any] = []
        budget = START_TIMEOUT + spec.timeout * (total - first + 1) + 30
        args = [sys.executable, "-m", "gclip.conformance.rank", jobdir]
        env = {"PYTHONUNBUFFERED": "1"}

        def launch() -> None:
            try:
                self.result.append(mpirun.run(spec.ranks, *args, timeout=budget, env=env))
            except Exception as exc:  # noqa: BLE001 - handed to the watching thread
                self.result.append(exc)

        self.thread = threading.Thread(target=launch, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        for r in self.ranks:
            r.read()

    def finished(self) -> bool:
        return not self.thread.is_alive()

    def output(self) -> str:
        res = self.result[0] if self.result else None
        if isinstance(res, Exception):
            raise res
        return "" if res is None else (res.stdout or "") + (res.stderr or "")

    def end(self) -> None:
        """Kill every rank, wait for mpirun, and check that nothing is left."""
        _kill(self.ranks)
        self.thread.join(timeout=mpirun.KILL_GRACE + 30)
        left = [i for i, r in enumerate(self.ranks) if _alive(r.pid)]
        if left or self.thread.is_alive():
            raise RuntimeError(f"the judge's job did not end (ranks {left} still running)")


def _case_run(job: _Job, case: int, died: dict[int, str], seconds: float | None) -> CaseRun:
    """A case that never finished: every rank's trace, and why, in words."""
    events = [r.events.get(case, []) for r in job.ranks]
    traces = [hangs.trace_of(evs)._replace(died=died.get(i)) for i, evs in enumerate(events)]
    stuck = hangs.explain(traces, seconds)
    ranks = []
    for evs in events:
        run = _rank_run(evs)
        ranks.append(run._replace(message=stuck.reason) if run.kind == "lost" else run)
    return CaseRun(ranks, stuck.reason, stuck.kind, stuck.culprits)


CRASHED = ("raised", "died")  # a lost case whose culprit raised or died: the family crashed, no hang


def run_cases(spec: JobSpec, cases: Sequence[Any], families: Sequence[str] | None = None) -> Runs:
    """Every case on ``spec.ranks`` ranks, a fresh job after each case that hangs or kills.

    ``families``: each case's family (its dtypes, whether a rank holds nothing). A case lost
    because a rank raised or died while the others waited (float64 in code that takes float32
    only, gloo aborting on a dtype mismatch across ranks) counts against its family: after
    ``MAX_LOST`` of them the family's other cases are left out and the others go on. A hang (a
    rank that skipped the collective, a deadlock, a loop) counts against the job: after
    ``MAX_LOST`` the judge stops, as ever."""
    kinds = list(families) if families is not None else ["" for _ in cases]
    runs: list[CaseRun] = []
    ran: list[int] = []
    todo = list(range(len(cases)))
    hung = 0
    crashed: dict[str, int] = {}
    not_run: dict[str, int] = {}
    note = None
    stopped = None
    jobdir = tempfile.mkdtemp(prefix="gclip-judge-")
    try:
        while todo:
            with open(os.path.join(jobdir, "cases.pkl"), "wb") as f:
                pickle.dump([cases[i] for i in todo], f)
            job = _Job(spec, jobdir, 0, len(todo))
            outcome = _watch(job, spec, 0, len(todo))
            runs += outcome.runs
            ran += todo[: len(outcome.runs)]
            note = note or outcome.note
            if outcome.usage is not None:
                raise LoadError(outcome.usage)
            if outcome.lost is None:
                break
            todo = todo[len(outcome.runs) :]
            if outcome.runs[-1].lost_kind in CRASHED:
                family = kinds[ran[-1]]
                crashed[family] = crashed.get(family, 0) + 1
                if crashed[family] >= MAX_LOST:
                    left = [i for i in todo if kinds[i] == family]
                    if left:
                        not_run[family] = len(left)
                        todo = [i for i in todo if kinds[i] != family]
                continue
            hung += 1
            if hung >= MAX_LOST and todo:
                stopped = f"{hung} cases hung; the other {len(todo)} cases were not run"
                break
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    return Runs(runs, stopped, note, ran, not_run)


class _Watched(NamedTuple):
    runs: list[CaseRun]
    lost: str | None
    usage: str | None
    note: str | None


def _watch(job: _Job, spec: JobSpec, first: int, total: int) -> _Watched:
    """Tail the ranks until the job ends, a case overruns ``spec.timeout``, or a rank dies."""
    started = time.monotonic()
    first_loaded: float | None = None  # when a rank was first seen to have loaded the file
    runs: list[CaseRun] = []
    case = first
    case_start: float | None = None
    note = None
    while True:
        ended = job.finished()  # before reading: then every event of an ended job is read
        job.poll()
        ranks = job.ranks
        if any("usage" in r.flags for r in ranks):
            usage = _usage(job)
            job.end()
            return _Watched(runs, None, usage, note)
        ready = all("ready" in r.flags for r in ranks)
        if ready and note is None:
            note = ranks[0].flags["ready"].get("note")
        while case < total and all(r.done >= case for r in ranks):
            runs.append(CaseRun([_rank_run(r.events.get(case, [])) for r in ranks]))
            for r in ranks:
                r.events.pop(case, None)
            case, case_start = case + 1, None
        if case >= total:  # every case ran; mpirun should exit now
            job.thread.join(timeout=mpirun.KILL_GRACE + 30)
            job.end()
            return _Watched(runs, None, None, note)
        if case_start is None and any(case in r.events for r in ranks):
            case_start = time.monotonic()
        if ended:
            output = job.output()
            job.end()
            if not ready:
                tail = " / ".join(output.strip().splitlines()[-3:]) or "no output"
                unloaded = _who([i for i, r in enumerate(ranks) if "ready" not in r.flags])
                raise LoadError(
                    f"cannot load {spec.target}: the job ended before {unloaded} had loaded it ({tail})"
                )
            died = _deaths(ranks, case)
            runs.append(_case_run(job, case, died, None))
            return _Watched(runs, runs[-1].lost, None, note)
        now = time.monotonic()
        if not ready:
            if first_loaded is None and any("ready" in r.flags for r in ranks):
                first_loaded = now
            lag = max(spec.timeout, LOAD_LAG)
            if (first_loaded is not None and now - first_loaded > lag) or now - started > START_TIMEOUT:
                job.end()
                raise _not_loaded(spec, ranks, lag if first_loaded is not None else None)
        if case_start is not None and now - case_start > spec.timeout:
            job.poll()
            # a rank whose process ended before mpirun ended the job (slow to, under load)
            gone = {
                i: "its process ended"
                for i, r in enumerate(ranks)
                if r.pid is not None and not _alive(r.pid) and "outcome" not in _kinds(r, case)
            }
            run = _case_run(job, case, gone, spec.timeout)
            job.end()
            runs.append(run)
            return _Watched(runs, run.lost, None, note)
        time.sleep(POLL_S)


def _usage(job: _Job, wait: float = 2.0) -> str:
    """A rank could not load the file: its message, naming the ranks when some others could
    (waiting ``wait`` seconds at most for every rank to say which)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(
        "ready" in r.flags or "usage" in r.flags for r in job.ranks
    ):
        time.sleep(POLL_S)
        job.poll()
    failed = [i for i, r in enumerate(job.ranks) if "usage" in r.flags]
    message = job.ranks[failed[0]].flags["usage"]["msg"]
    return message if len(failed) == len(job.ranks) else f"{message} (on {_who(failed)} only)"


def _who(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_list(ranks)}"


def _not_loaded(spec: JobSpec, ranks: Sequence[_Rank], lag: float | None) -> Exception:
    """The ranks still loading the file (its top level hangs on them), or the job that never started.

    ``lag``: the seconds they were given after another rank had loaded it (None: no rank had)."""
    loaded = [i for i, r in enumerate(ranks) if "ready" in r.flags]
    loading = [i for i, r in enumerate(ranks) if "loading" in r.flags and "ready" not in r.flags]
    if not loading:
        return RuntimeError(f"the ranks did not start within {START_TIMEOUT:g} s")
    if lag is None:
        when = f"{START_TIMEOUT:g} s after the job started"
    else:
        when = f"{lag:g} s after {_who(loaded)} had loaded it"
    was = "was" if len(loading) == 1 else "were"
    return LoadError(
        f"cannot load {spec.target}: {_who(loading)} {was} still loading it "
        f"(running the file's top level) {when}"
    )


def _kinds(rank: _Rank, case: int) -> set[str]:
    return {e["e"] for e in rank.events.get(case, [])}
