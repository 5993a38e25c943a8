"""Drivers: what runs the engine's programs (``engine.program``, and the lab's own).

A program yields collectives (``engine.Reduce``, ``engine.Gather``) and is sent their
results. :meth:`Driver.run` is the one loop that answers them on one real rank:
:class:`Mpi` with mpi4py's collectives (one buffer-based ``Allreduce`` per ``Reduce``),
:func:`drive` with the functions given (``gclip.torch``: torch.distributed's).
:func:`run_simulated` runs R programs in lockstep in one process, as R ranks would
(the judge, the seed contract, the demo and the unit tests).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import numpy as np

from .comm import Comm
from .engine import Gather, NormOp, Reduce
from .errors import GclipError, GclipTypeError

__all__ = [
    "LAUNCHER_SIZE_VARS",
    "Driver",
    "Mpi",
    "communicator",
    "drive",
    "launched_size",
    "refuse_lone_rank",
    "run_simulated",
]

T = TypeVar("T")


class Driver:
    """A real rank's driver: :meth:`run` answers each Reduce with ``all_reduce`` and each
    Gather with ``all_gather``."""

    rank: int
    size: int
    all_reduce: Callable[[np.ndarray, NormOp], np.ndarray]
    all_gather: Callable[[Any], list[Any]]

    def run(self, program: Generator[Reduce | Gather, Any, T]) -> T:
        """Run a program on this rank; returns what it returns (``engine.program``: the norm
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


def drive(
    program: Generator[Reduce | Gather, Any, T],
    all_reduce: Callable[[np.ndarray, NormOp], np.ndarray],
    all_gather: Callable[[Any], list[Any]],
) -> T:
    """Run a program on one rank with these collectives (``gclip.torch``: torch.distributed's)."""
    driver = Driver()
    driver.all_reduce, driver.all_gather = all_reduce, all_gather
    return driver.run(program)


class Mpi(Driver):
    """The MPI driver: runs programs on this rank of an mpi4py communicator, one buffer-based
    ``Allreduce`` per ``Reduce``."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.all_reduce, self.all_gather = self._all_reduce, comm.allgather

    def _all_reduce(self, data: np.ndarray, op: NormOp) -> np.ndarray:
        MPI = _mpi()
        out = np.empty(data.size)
        self.comm.Allreduce(data, out, op=MPI.MAX if op is NormOp.MAX else MPI.SUM)
        return out


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


# ---------------------------------------------------------------------------
# the communicator: None means MPI's COMM_WORLD, unless this process is one of several


def communicator(comm: Any) -> Any:
    """The communicator to clip over, or a one-line error (raised alike on every rank)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(comm, mpi.Comm):  # the usual case, checked first
        if comm.Get_size() == 1 and comm == mpi.COMM_WORLD:  # COMM_WORLD spelled out: the same trap
            refuse_lone_rank("comm=MPI.COMM_WORLD:")
        return comm
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() == 1:
            refuse_lone_rank("comm=None:")
        return comm
    if not (hasattr(comm, "Get_rank") and hasattr(comm, "Allreduce")):
        hint = ""
        if "torch" in type(comm).__module__:
            hint = "; for a torch.distributed group use gclip.torch.clip_grad_norm_(..., comm=group)"
        raise GclipTypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}{hint}")
    return comm  # an object with mpi4py's methods (a test's fake), never COMM_WORLD


# launchers that say how many processes they started; MPI seeing one means it was not told
LAUNCHER_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def launched_size() -> tuple[int, str] | None:
    """(processes, who says so) when this process was started as one of several, else None."""
    for var in LAUNCHER_SIZE_VARS:
        try:
            n = int(os.environ.get(var, "1"))
        except ValueError:
            continue
        if n > 1:
            return n, f"{var}={n}"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), f"torch.distributed world size {dist.get_world_size()}"
    return None


def refuse_lone_rank(given: str, fix: str = "") -> None:
    """Raise where MPI sees one rank but the process was started as one of several:
    clipping alone there is the very bug gclip prevents. ``given`` says what led here."""
    launched = launched_size()
    if launched is not None:
        n, why = launched
        raise GclipError(
            f"{given} MPI sees 1 rank, but this process is one of {n} ({why}); clipping here "
            f"would use this process's own norm. {fix or _LONE_RANK_FIX}"
        )


_LONE_RANK_FIX = (
    "Start the job with mpirun, pass the communicator of the ranks that share the gradient "
    "(MPI.COMM_SELF if each process really clips alone), or use gclip.torch.clip_grad_norm_ "
    "(it takes the torch.distributed group)"
)
