"""The implementation under judgement runs here: in a worker process, never in the judge's.

One JSON request per line on the worker's stdin, one JSON reply per line on
its stdout; its own stdin and stdout go to /dev/null, so the
implementation's ``print()`` and ``input()`` cannot disturb the protocol.
Replies are read with a deadline (``select``), and a worker that hangs or
dies is killed with its whole process group.
"""

from __future__ import annotations

import json
import numbers
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple

import numpy as np

from .._lab.jsonout import dumps
from .._lab.lines import exception_line
from .target import LoadError, Target, form_error, load

__all__ = ["MESSAGE_LIMIT", "Outcome", "Worker", "rows_of", "serve", "start"]

MESSAGE_LIMIT = 200  # characters of an exception's line kept in a verdict


def serve() -> None:
    """Worker main: load the target, then answer one JSON call per line."""
    proto_in = os.fdopen(os.dup(0), "r")
    proto_out = os.fdopen(os.dup(1), "w")
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 0)  # the implementation's input() and print() reach /dev/null,
    os.dup2(quiet, 1)  # not the judge's protocol

    def send(obj: dict) -> None:
        proto_out.write(dumps(obj) + "\n")
        proto_out.flush()

    kind, target, func = sys.argv[1:4]
    try:
        fn, note = load(kind, target, func)
    except LookupError as exc:
        send({"usage": str(exc)})
        return
    except BaseException as exc:  # noqa: BLE001 - anything the file does while loading
        send({"usage": f"cannot load {target}: {exception_line(exc, limit=MESSAGE_LIMIT)}"})
        return
    misfit = form_error(fn, "single", f"{target}:{func}")
    if misfit is not None:
        send({"usage": misfit})
        return
    send({"loaded": True, "note": note})

    for line in proto_in:
        request = json.loads(line)
        try:
            value = fn(request["shards"], request["limit"])
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            send({"raised": exception_line(exc, limit=MESSAGE_LIMIT)})
            continue
        rows, why = rows_of(value)
        send({"value": rows} if why is None else {"bad": why})


def _sequence(value: Any) -> bool:
    """A list, a tuple, a numpy array or the like: not a string, a dict or a number."""
    if isinstance(value, (str, bytes, dict)) or getattr(value, "ndim", 1) == 0:
        return False
    return hasattr(value, "__len__") and hasattr(value, "__iter__")


def rows_of(value: Any) -> tuple[list | None, str | None]:
    """The returned shards as lists of floats, or why they are not shards.

    Lists, tuples and numpy arrays are all accepted, at either level: a
    numpy version that returns arrays returns the same layout.
    """
    if not _sequence(value):
        return None, f"returned {type(value).__name__}, not a list of shards (lists or arrays of numbers)"
    rows = []
    for i, shard in enumerate(value):
        if not _sequence(shard):
            return None, f"returned shard {i} as {type(shard).__name__}, not a list of numbers (nor an array)"
        row = []
        for j, v in enumerate(shard):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                return None, f"returned shard {i} item {j} as {type(v).__name__}, not a number"
            try:
                row.append(float(v))
            except (OverflowError, ValueError) as exc:
                return None, f"shard {i} item {j}: {exc}"
        rows.append(row)
    return rows, None


class Outcome(NamedTuple):
    """What one call gave: a value, or why there is none."""

    value: list[list[float]] | None
    problem: str | None  # "raised ...", "returned ...", "timed out ...", "crashed ..."
    lost: bool = False  # the worker had to be killed or died


class Worker:
    """The implementation in a subprocess; replies are read with a deadline (select)."""

    def __init__(self, kind: str, target: str, func: str, timeout: float) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from gclip.conformance.worker import serve; serve()", kind, target, func],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # so close() ends whatever the implementation started too
        )
        self.buffer = b""
        self.eof = False

    def receive(self, timeout: float) -> dict | None:
        """The next message; None if the worker did not answer in time or closed its end."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if self.eof or left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            self.eof = not chunk
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def exit_status(self) -> int | None:
        """The worker's exit status once its end is closed (None: still running)."""
        if not self.eof:
            return self.proc.poll()
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its output but lives on: treat as a hang
            return None

    def call(self, shards: list, limit: float) -> Outcome:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(dumps({"shards": shards, "limit": limit}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the worker is gone (or closed its input): lost either way
            self.eof = True
            status = self.exit_status()
            return Outcome(None, f"crashed the process (exit status {status})", True)
        reply = self.receive(self.timeout)
        if reply is None:
            status = self.exit_status()
            if status is None:
                return Outcome(None, f"timed out: no answer within {self.timeout:g} s", True)
            return Outcome(None, f"crashed the process (exit status {status})", True)
        if "raised" in reply:
            return Outcome(None, f"raised {reply['raised']}")
        if "bad" in reply:
            return Outcome(None, reply["bad"])
        return Outcome(_from_json(reply["value"]), None)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def _from_json(rows: Any) -> Any:
    """The worker's rows as floats again: it wrote non-finite ones as strings ("inf", "nan")."""
    if isinstance(rows, list):
        return [_from_json(r) for r in rows]
    return float(rows) if isinstance(rows, str) else rows


def start(target: Target, timeout: float) -> tuple[Worker, str | None]:
    """A loaded worker, or a usage error when the target cannot be loaded."""
    worker = Worker(target.kind, target.where, target.func, timeout)
    hello = worker.receive(max(10.0, timeout))
    if hello is None or "usage" in hello:
        alive = worker.exit_status() is None
        worker.close()
        if hello is not None:
            raise LoadError(hello["usage"])
        why = "timed out while loading" if alive else "the worker process died while loading"
        raise LoadError(f"cannot load {target}: {why}")
    return worker, hello.get("note")
