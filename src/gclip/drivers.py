"""Drivers: what runs the engine's programs (``engine.program``, and the lab's own).

A program yields collectives (``engine.Reduce``, ``engine.Gather``) and is sent their
results. :meth:`Driver.run` is the one loop that answers them on one real rank, with
the driver's all-reduce and all-gather: :class:`Mpi` has mpi4py's (one buffer-based
``Allreduce`` per ``Reduce``); :func:`drive` takes them as functions (``gclip.torch``:
torch.distributed's).
:func:`run_simulated` runs R programs in lockstep in one process, as R ranks would
(the judge, the seed contract, the demo and the unit tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import numpy as np

from .comm import Comm
from .engine import Gather, NormOp, Reduce
from .errors import GclipError

__all__ = ["Driver", "Mpi", "drive", "run_mpi", "run_simulated"]

T = TypeVar("T")


class Driver:
    """A real rank's driver: each Reduce through :meth:`all_reduce`, each Gather through
    :meth:`all_gather`; :meth:`run` is the one loop."""

    rank: int
    size: int

    def all_reduce(self, data: np.ndarray, op: NormOp) -> np.ndarray:
        raise NotImplementedError

    def all_gather(self, item: Any) -> list[Any]:
        raise NotImplementedError

    def run(self, program: Generator[Reduce | Gather, Any, T]) -> T:
        """Run a program on this rank: returns what it returns (``engine.program``: the norm
        and the factor)."""
        try:
            request = next(program)
            while True:
                if type(request) is Reduce:
                    request = program.send(self.all_reduce(request.data, request.op))
                else:
                    request = program.send(self.all_gather(request.item))  # type: ignore[union-attr]
        except StopIteration as done:
            result: T = done.value
            return result


class _Given(Driver):
    """A driver of the collectives given as functions."""

    def __init__(
        self, reduce: Callable[[np.ndarray, NormOp], np.ndarray], gather: Callable[[Any], list[Any]]
    ):
        self._reduce, self._gather = reduce, gather

    def all_reduce(self, data: np.ndarray, op: NormOp) -> np.ndarray:
        return self._reduce(data, op)

    def all_gather(self, item: Any) -> list[Any]:
        return self._gather(item)


def drive(
    program: Generator[Reduce | Gather, Any, T],
    all_reduce: Callable[[np.ndarray, NormOp], np.ndarray],
    all_gather: Callable[[Any], list[Any]],
) -> T:
    """Run a program on one rank with these collectives (``gclip.torch``: torch.distributed's)."""
    return _Given(all_reduce, all_gather).run(program)


class Mpi(Driver):
    """The MPI driver: runs programs on this rank of an mpi4py communicator, one buffer-based
    ``Allreduce`` per ``Reduce``."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def all_reduce(self, data: np.ndarray, op: NormOp) -> np.ndarray:
        MPI = _mpi()
        out = np.empty(data.size)
        self.comm.Allreduce(data, out, op=MPI.MAX if op is NormOp.MAX else MPI.SUM)
        return out

    def all_gather(self, item: Any) -> list[Any]:
        return self.comm.allgather(item)


def run_mpi(program: Generator[Reduce | Gather, Any, T], comm: Comm) -> T:
    """Run a program on this rank of ``comm`` (mpi4py)."""
    return Mpi(comm).run(program)


@functools.lru_cache(maxsize=1)
def _mpi() -> Any:
    """mpi4py.MPI, imported on first use: simulated runs (the judge) never start MPI."""
    from mpi4py import MPI

    return MPI


def run_simulated(programs: Sequence[Generator[Reduce | Gather, Any, T]]) -> list[T]:
    """Run R programs in lockstep, as R ranks would, in one process."""
    results: list[Any] = [None] * len(programs)
    requests: list[Any] = []
    for i, prog in enumerate(programs):
        try:
            requests.append(next(prog))
        except StopIteration as done:  # pragma: no cover - every program yields the header
            results[i] = done.value
    while any(r is not None for r in requests):
        first = requests[0]
        if any(type(r) is not type(first) for r in requests):
            raise RuntimeError("simulated ranks diverged")  # pragma: no cover - a gclip bug
        if isinstance(first, Reduce):
            stack = np.stack([r.data for r in requests])
            reply: Any = stack.max(axis=0) if first.op is NormOp.MAX else stack.sum(axis=0)
        else:
            reply = [r.item for r in requests]
        errors: list[BaseException] = []
        for i, prog in enumerate(programs):
            try:
                requests[i] = prog.send(reply.copy() if isinstance(reply, np.ndarray) else reply)
            except StopIteration as done:
                requests[i], results[i] = None, done.value
            except GclipError as exc:
                requests[i] = None
                errors.append(exc)
        if errors:
            raise errors[0]
    return results
