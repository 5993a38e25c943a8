"""Lists of many arrays (a model's gradient): gclip against torch's foreach clip.

Each rank holds its own list of a ``ListWorkload``'s shapes (``workloads``).
Timed, interleaved as the shards are, with clipping off and active:

- ``floor``: the memory passes no clip can skip, nothing checked: a dot per
  array (one read), and when clipping is active a multiply in place (a read and
  a write), plus the one all-reduce; its time over torch's is the best ratio
  any standalone clip can reach on this machine;
- ``gclip``: ``clip_by_global_norm(arrays, max_norm, inplace=True)``;
- ``gclip-repro``: the same with ``reproducible=True``;
- ``torch-foreach``: what ``torch.nn.utils.clip_grad_norm_(foreach=True)``
  computes, with the all-reduce a sharded model adds (FSDP's way), on the same
  memory: ``_foreach_norm``, the norm of the stacked norms, squared,
  ``all_reduce``, sqrt, ``max_norm / (norm + 1e-6)`` clamped to 1,
  ``_foreach_mul_``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..gallery import TORCH_EPS
from .ops import Norm
from .timing import slowest_rank_medians, time_reps
from .workloads import DELTA, INACTIVE_FACTOR, ListWorkload, list_arrays

__all__ = ["base_row", "bench_list", "list_rows", "torch_foreach"]


def torch_foreach(torch_ctx: Any, arrays: list, norm: Norm, limit: Callable[[], float], active: bool):
    """The torch op on ``arrays``' memory (None without torch)."""
    if torch_ctx is None:
        return None
    torch, dist = torch_ctx.torch, torch_ctx.dist
    tensors = [torch.from_numpy(a) for a in arrays]

    def run() -> None:
        norms = torch._foreach_norm(tensors, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) ** 2
        dist.all_reduce(total)
        got = total.sqrt()
        coef = torch.clamp(limit() / (got + TORCH_EPS), max=1.0)
        torch._foreach_mul_(tensors, coef)
        if active:
            norm.value = float(got) * float(coef)

    return run


def _ops(arrays: list, norm: Norm, active: bool, torch_ctx: Any, comm: Any) -> list:
    import numpy as np
    from mpi4py import MPI

    import gclip

    fixed = INACTIVE_FACTOR * norm.value

    def limit() -> float:
        return norm.value * (1.0 - DELTA) if active else fixed

    local, total = np.zeros(1), np.empty(1)
    flat = [a.reshape(-1) for a in arrays]  # views: np.dot of 2-D arrays would be a matrix product

    def floor() -> None:
        local[0] = sum(float(np.dot(v, v)) for v in flat)
        comm.Allreduce(local, total, op=MPI.SUM)
        if active:
            for a in arrays:
                np.multiply(a, 1.0 - DELTA, out=a)
            norm.value *= 1.0 - DELTA

    def clip(reproducible: bool) -> Callable[[], None]:
        def run() -> None:
            res = gclip.clip_by_global_norm(
                arrays, limit(), comm=comm, inplace=True, reproducible=reproducible
            )
            if active:
                norm.misses += res.scale >= 1.0
                norm.value = res.total_norm * res.scale

        return run

    ops = [("floor", floor), ("gclip", clip(False)), ("gclip-repro", clip(True))]
    torch_op = torch_foreach(torch_ctx, arrays, norm, limit, active)
    if torch_op is not None:
        ops.append(("torch-foreach", torch_op))
    return ops


def bench_list(comm: Any, workload: ListWorkload, torch_ctx: Any, repeat: int | None) -> list[dict]:
    """Rows of one list workload, clipping off and active (rank 0 gets them; others: [])."""
    import gclip

    arrays = list_arrays(workload, comm.Get_rank())
    rows: list[dict] = []
    for active in (False, True):
        norm = Norm(gclip.global_norm(arrays, comm=comm))
        times = time_reps(comm, _ops(arrays, norm, active, torch_ctx, comm), repeat or workload.repeat)
        misses = comm.allreduce(norm.misses)
        every = comm.gather(times, root=0)
        if every is not None:
            rows += list_rows(workload, active, slowest_rank_medians(every), misses)
    return rows


def base_row(workload: ListWorkload, active: bool, impl: str, t: dict) -> dict:
    """The fields every list row has: what ran, on what, and its time (also per array)."""
    import math

    return {
        "workload": workload.name,
        "tensors": len(workload.shapes),
        "elements": sum(math.prod(s) for s in workload.shapes),
        "dtype": workload.dtype,
        "active": active,
        "impl": impl,
        "median_s": t["median_s"],
        "min_s": t["min_s"],
        "reps": t["reps"],
        "per_tensor_s": t["median_s"] / len(workload.shapes),
    }


def list_rows(workload: ListWorkload, active: bool, times: dict[str, dict], misses: int) -> list[dict]:
    """One row per implementation: time, time per array, and the ratios."""
    default = times["gclip"]["median_s"]
    torch, floor = times.get("torch-foreach"), times.get("floor")
    rows = []
    for impl, t in times.items():
        row = base_row(workload, active, impl, t)
        if torch is not None and impl != "torch-foreach":
            row["vs_torch"] = t["median_s"] / torch["median_s"]
        if impl == "gclip-repro":
            row["vs_default"] = t["median_s"] / default
        if impl.startswith("gclip"):
            row["misses"] = misses if active else 0
            if floor is not None:
                row["vs_floor"] = t["median_s"] / floor["median_s"]
        rows.append(row)
    return rows
