"""Counting the collectives of a clip: a communicator proxy passed as ``comm``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from .workloads import COLLECTIVE_CASES, COUNT_SIZE, shard

__all__ = ["COUNTED", "CountingComm", "collective_counts", "count_collectives"]

# mpi4py's communication calls: lowercase ones pickle Python objects, uppercase ones move buffers
COUNTED = frozenset(
    "Allreduce allreduce Iallreduce Allgather allgather Allgatherv Bcast bcast Reduce reduce "
    "Reduce_scatter Reduce_scatter_block Gather gather Gatherv Scatter scatter Alltoall alltoall "
    "Scan scan Exscan exscan Barrier barrier Send send Recv recv Sendrecv sendrecv Isend isend "
    "Irecv irecv".split()
)


class CountingComm:
    """A communicator proxy that counts the communication calls made through it.

    mpi4py's lowercase methods pickle Python objects; uppercase ones move
    buffers. Everything else is forwarded untouched.
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name not in COUNTED:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def summary(self) -> dict[str, Any]:
        total = sum(self.calls.values())
        pickled = sum(n for name, n in self.calls.items() if name[0].islower())
        return {"total": total, "pickle_based": pickled, "calls": dict(sorted(self.calls.items()))}


def count_collectives(comm: Any, clip: Callable[..., Any], case: Callable[[Any], tuple]) -> dict[str, Any]:
    """Run one clip with a counting proxy as ``comm``; the counts, max over ranks.

    ``case(proxy)`` gives the clip's arguments: a communicator among them (a
    replicated array's group) is the proxy too, so its calls count as well."""
    proxy = CountingComm(comm)
    args, kwargs = case(proxy)
    clip(*args, comm=proxy, **kwargs)
    mine = proxy.summary()
    every = comm.allgather(mine)  # after the clip, outside the counted proxy
    worst = max(every, key=lambda s: s["total"])
    return {**worst, "same_on_all_ranks": all(s == every[0] for s in every)}


def collective_counts(comm: Any) -> dict[str, Any]:
    """Collectives per clip on each path of ``COLLECTIVE_CASES``, with a counting proxy as ``comm``."""
    import numpy as np

    import gclip

    x = shard(COUNT_SIZE, "float64", comm.Get_rank())
    norm = gclip.global_norm(x, comm=comm)
    arrays = {"float64": x, "float32": x.astype("float32")}  # copies made before any clip scales x
    shared = np.ones(16)  # the same on every rank
    out = {}
    for case in COLLECTIVE_CASES:
        array = arrays[case.dtype]
        limit = norm * case.limit_factor
        kwargs = {"inplace": True, **({"reproducible": True} if case.reproducible else {})}

        def call(proxy: Any, a: Any = array, m: float = limit, kw: dict = kwargs, c: Any = case) -> tuple:
            if c.replicated is None:
                return (a, m), kw
            group = True if c.replicated == "flag" else proxy
            return ([a, shared], m), {**kw, "replicated": [False, group]}

        out[case.name] = count_collectives(comm, gclip.clip_by_global_norm, call)
    return out
