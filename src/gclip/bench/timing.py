"""Timing: interleaved reps after a Barrier, the slowest rank per rep, the median over reps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ..engine import HEADER_SIZE
from .workloads import ALLREDUCE_REPS, CACHE_EVICT_BYTES

__all__ = ["slowest_rank_medians", "time_allreduce", "time_reps"]


def time_reps(
    comm: Any,
    ops: Sequence[tuple[str, Callable[[], Any]]],
    repeat: int,
    cold: bool = False,
    cpu: dict[str, list] | None = None,
) -> dict[str, list]:
    """``repeat`` rounds over the ops in a rotating order; returns this rank's times.

    Each timed call starts after a Barrier. Before it, an untimed call of the
    same op (warm: each op in its own steady state, not in the caches the
    previous op left), or with ``cold`` a write of CACHE_EVICT_BYTES that evicts L1 and L2
    (the clip after a backward pass has swept the caches). ``cpu``, if given, gets the
    calling thread's CPU time of each timed call too (per op name), which a busy machine
    disturbs less: a moment another process holds the core does not count.
    """
    from time import perf_counter, thread_time

    sweep = _CacheEvictor() if cold else None
    times: dict[str, list] = {name: [] for name, _ in ops}
    k = len(ops)
    for rep in range(repeat):
        for name, op in [ops[(rep + i) % k] for i in range(k)]:
            comm.Barrier()
            if sweep is None or rep == 0:
                op()
            if sweep is not None:
                sweep()
            comm.Barrier()
            t0, c0 = perf_counter(), thread_time()
            op()
            t, c = perf_counter() - t0, thread_time() - c0
            times[name].append(t)
            if cpu is not None:
                cpu.setdefault(name, []).append(c)
    return times


class _CacheEvictor:
    """Writes a buffer larger than L2, evicting what the caches held."""

    def __init__(self, nbytes: int = CACHE_EVICT_BYTES) -> None:
        import numpy as np

        self.buf = np.zeros(nbytes // 8)

    def __call__(self) -> None:
        self.buf += 1.0


def slowest_rank_medians(
    per_rank: Sequence[dict[str, list]], cpu: Sequence[dict[str, list]] | None = None
) -> dict[str, dict[str, float]]:
    """Per rep the slowest rank's time; then median and min over reps. With ``cpu`` (each
    rank's CPU times, as time_reps gives them): per rep the busiest rank's, its median as
    ``cpu_median_s``."""
    out = {}
    for name in per_rank[0]:
        reps = [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
        out[name] = {"median_s": statistics.median(reps), "min_s": min(reps), "reps": len(reps)}
        if cpu is not None and name in cpu[0]:
            busiest = [max(r[name][i] for r in cpu) for i in range(len(cpu[0][name]))]
            out[name]["cpu_median_s"] = statistics.median(busiest)
    return out


def time_allreduce(comm: Any, repeat: int = ALLREDUCE_REPS) -> float:
    """Median time of a bare SUM Allreduce of the clip's header size (slowest rank per rep)."""
    import numpy as np
    from mpi4py import MPI

    buf, out = np.zeros(HEADER_SIZE), np.empty(HEADER_SIZE)
    times = time_reps(comm, [("allreduce", lambda: comm.Allreduce(buf, out, op=MPI.SUM))], repeat)
    every = comm.gather(times, root=0)
    return slowest_rank_medians(every)["allreduce"]["median_s"] if every else math.nan
