"""Which collectives a rank entered, and whether it left them: the judge's eyes.

The function under judgement gets a communicator that is the real one (an
``mpi4py.MPI.Intracomm`` on the same handle, so gclip, mpi4py and MPI accept
it) but whose collectives first tell the :class:`Recorder` "entered
Allreduce" and, once MPI returns, "left Allreduce". Communicators it makes
(``Dup``, ``Split``) and requests of nonblocking calls (``Iallreduce`` then
``Wait``) are recorded the same way, and so is ``MPI.COMM_WORLD`` (much real
code calls it instead of the communicator it is given): ``record_world`` puts
a recording copy in ``mpi4py.MPI``'s place. Under ``--torch`` the functions of
``torch.distributed`` are wrapped alike. A rank stuck in a collective has
told the judge where it waits; a rank that never entered one has told it
nothing: that difference is what names the rank that skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = [
    "COLLECTIVES",
    "TORCH_COLLECTIVES",
    "Recorder",
    "current",
    "install",
    "record_torch",
    "record_world",
    "recorded",
]

# mpi4py methods that wait for other ranks (collectives, point-to-point, communicator makers)
COLLECTIVES = (
    "Allreduce allreduce Reduce reduce Bcast bcast Barrier barrier Allgather allgather Allgatherv "
    "Gather gather Gatherv Scatter scatter Scatterv Alltoall alltoall Alltoallv Reduce_scatter "
    "Reduce_scatter_block Scan scan Exscan exscan Send send Recv recv Sendrecv sendrecv Ssend ssend "
    "Dup Split Split_type Create Create_group"
).split()
NONBLOCKING = (
    "Iallreduce Ireduce Ibcast Ibarrier Iallgather Iallgatherv Igather Iscatter Ialltoall "
    "Ireduce_scatter Ireduce_scatter_block Iscan Iexscan Isend isend Irecv irecv Issend issend Idup"
).split()
_MAKERS = {"Dup", "Split", "Split_type", "Create", "Create_group"}
TORCH_COLLECTIVES = (
    "all_reduce all_gather all_gather_into_tensor all_gather_object broadcast broadcast_object_list "
    "reduce reduce_scatter reduce_scatter_tensor barrier monitored_barrier all_to_all all_to_all_single "
    "gather gather_object scatter scatter_object_list send recv isend irecv all_reduce_coalesced"
).split()


class Recorder:
    """Per process: the case being run and every collective entered in it, sent to ``sink``."""

    def __init__(self, sink: Callable[[dict], None]) -> None:
        self.sink = sink
        self.case: int | None = None
        self.count = 0
        self.inside: list[str] = []  # ops entered and not yet left, innermost last

    def begin(self, case: int) -> None:
        self.case, self.count, self.inside = case, 0, []

    def end(self) -> None:
        self.case = None

    def enter(self, op: str) -> int | None:
        if self.case is None:  # the judge's own setup (a mesh's Split): not the function's
            return None
        self.count += 1
        self.inside.append(op)
        self.sink({"e": "enter", "c": self.case, "op": op, "n": self.count})
        return self.count

    def leave(self, op: str, n: int | None, raised: bool = False) -> None:
        if n is None or self.case is None:
            return
        if op in self.inside:
            self.inside.remove(op)
        event = {"e": "leave", "c": self.case, "op": op, "n": n}
        if raised:
            event["raised"] = True
        self.sink(event)


_RECORDER: list[Recorder] = []  # the one of this process, once installed


def install(recorder: Recorder) -> Recorder:
    _RECORDER[:] = [recorder]
    return recorder


def current() -> Recorder | None:
    return _RECORDER[0] if _RECORDER else None


def _watched(op: str, call: Callable[[], Any]) -> Any:
    rec = current()
    n = rec.enter(op) if rec is not None else None
    try:
        result = call()
    except BaseException:
        if rec is not None:
            rec.leave(op, n, raised=True)
        raise
    if rec is not None:
        rec.leave(op, n)
    return result


@functools.cache
def _classes() -> tuple[type, type]:
    """The recording subclasses of mpi4py's Intracomm and Request (made once MPI is needed)."""
    from mpi4py import MPI

    class RecordedRequest(MPI.Request):
        """A request whose Wait/Test are recorded under the nonblocking call's name."""

        op = "request"

        def Wait(self, *args: Any, **kwargs: Any) -> Any:
            return _watched(f"{self.op} (Wait)", lambda: MPI.Request.Wait(self, *args, **kwargs))

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            return _watched(f"{self.op} (wait)", lambda: MPI.Request.wait(self, *args, **kwargs))

    def blocking(name: str) -> Callable[..., Any]:
        base = getattr(MPI.Intracomm, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = _watched(name, lambda: base(self, *args, **kwargs))
            if name in _MAKERS and isinstance(result, MPI.Intracomm) and result != MPI.COMM_NULL:
                return RecordedComm(result)
            return result

        method.__name__ = name
        return method

    def nonblocking(name: str) -> Callable[..., Any]:
        base = getattr(MPI.Intracomm, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = _watched(name, lambda: base(self, *args, **kwargs))
            if isinstance(result, tuple):  # Idup: (communicator, request)
                return result
            request = RecordedRequest(result)
            request.op = name
            return request

        method.__name__ = name
        return method

    methods = {n: blocking(n) for n in COLLECTIVES if hasattr(MPI.Intracomm, n)}
    methods |= {n: nonblocking(n) for n in NONBLOCKING if hasattr(MPI.Intracomm, n)}
    RecordedComm = type("RecordedComm", (MPI.Intracomm,), methods)
    return RecordedComm, RecordedRequest


def recorded(comm: Any) -> Any:
    """``comm`` as a recording communicator: the same MPI handle, the same type to MPI."""
    return _classes()[0](comm)


def record_world() -> Callable[[], None]:
    """Put a recording ``COMM_WORLD`` (the same handle) in ``mpi4py.MPI``'s place; returns the
    function that puts the real one back.

    Code that reads ``MPI.COMM_WORLD`` from now on, or imports it from now on
    (``from mpi4py.MPI import COMM_WORLD``), gets the recording one. Nothing
    else changes: the judge's own communicators were made before (``Dup``), and
    collectives are recorded only while a case runs (``Recorder.begin``/``end``).
    """
    from mpi4py import MPI

    real = MPI.COMM_WORLD
    if isinstance(real, _classes()[0]):  # already in place
        return lambda: None
    MPI.COMM_WORLD = recorded(real)

    def restore() -> None:
        MPI.COMM_WORLD = real

    return restore


def record_torch() -> None:
    """Wrap torch.distributed's collectives (module attributes) so they are recorded too."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in TORCH_COLLECTIVES:
        base = getattr(c10d, name, None)
        if base is None or getattr(base, "_gclip_recorded", False):
            continue

        def wrapper(*args: Any, _base: Any = base, _name: str = name, **kwargs: Any) -> Any:
            work = _watched(_name, lambda: _base(*args, **kwargs))
            if kwargs.get("async_op") and work is not None:
                return _RecordedWork(work, _name)
            return work

        functools.update_wrapper(wrapper, base)
        wrapper._gclip_recorded = True  # type: ignore[attr-defined]
        for module in (c10d, dist):
            if getattr(module, name, None) is base:
                setattr(module, name, wrapper)


class _RecordedWork:
    """torch's async work handle, its wait() recorded."""

    def __init__(self, work: Any, op: str) -> None:
        self._work, self._op = work, op

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return _watched(f"{self._op} (wait)", lambda: self._work.wait(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
