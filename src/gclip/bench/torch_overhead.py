"""One process: ``gclip.torch.clip_grad_norm_`` against torch's own clip, overhead included.

``--lists overhead`` (or its three names): one parameter of 1,000 values, 2,000 tensors
of 64 values, GPT-2 small's 148 tensors, float32 ``.grad`` on the CPU, each with the clip
off (the limit never reached) and active. The two clips run interleaved on the same
parameters:

- ``gclip.torch``: ``gclip.torch.clip_grad_norm_(params, max_norm)`` (float64 accumulation,
  the header, the scale; a job of one process);
- ``torch``: ``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``.

Each row gives both medians, gclip's over torch's (wall clock and the thread's CPU time,
which other processes on a loaded machine disturb less) and the target the ratio must stay
under (1.0; 1.05 for GPT-2 active, where both run the same memory-bound read and write).
Only a job of one rank runs them (a bigger job: none; the rows are about one process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..gallery import TORCH_EPS
from .lists import base_row
from .ops import Norm
from .timing import slowest_rank_medians, time_reps
from .torch_lists import _params
from .workloads import DELTA, INACTIVE_FACTOR, OVERHEAD_LIMITS, OVERHEAD_LISTS, ListWorkload

__all__ = ["bench_overhead", "limit_of", "overhead_ops", "overhead_rows"]


def limit_of(workload: ListWorkload, active: bool) -> float:
    """The ratio gclip.torch / torch must stay at or under."""
    return OVERHEAD_LIMITS.get(workload.name, (1.0, 1.0))[active]


def overhead_ops(torch: Any, params: list, norm: Norm, active: bool) -> list[tuple[str, Callable[[], None]]]:
    """The two clips on ``params``; active, each clips to just under the current norm."""
    from .. import torch as gclip_torch

    fixed = INACTIVE_FACTOR * norm.value

    def limit() -> float:
        return norm.value * (1.0 - DELTA) if active else fixed

    def gclip() -> None:
        total = float(gclip_torch.clip_grad_norm_(params, limit()))
        if active:
            norm.misses += total <= limit()
            norm.value = total * min(1.0, limit() / total)

    def reference() -> None:
        total = float(torch.nn.utils.clip_grad_norm_(params, limit(), foreach=True))
        if active:
            norm.value = total * min(1.0, limit() / (total + TORCH_EPS))

    return [("gclip.torch", gclip), ("torch", reference)]


def bench_overhead(comm: Any, torch_ctx: Any, names: list[str], repeat: int | None) -> list[dict]:
    """Rows of the overhead workloads named in ``names`` (a one-rank job only; else [])."""
    if torch_ctx is None or comm.Get_size() != 1:
        return []
    rows: list[dict] = []
    for workload in OVERHEAD_LISTS:
        if workload.name not in names:
            continue
        params = _params(torch_ctx.torch, workload, 0)
        for active in (False, True):
            grads = [p.grad.double() for p in params]
            norm = Norm(
                float(torch_ctx.torch.linalg.vector_norm(torch_ctx.torch.cat([g.reshape(-1) for g in grads])))
            )
            cpu: dict[str, list] = {}
            times = time_reps(
                comm, overhead_ops(torch_ctx.torch, params, norm, active), repeat or workload.repeat, cpu=cpu
            )
            rows += overhead_rows(workload, active, slowest_rank_medians([times], [cpu]), norm.misses)
        del params
    return rows


def overhead_rows(workload: ListWorkload, active: bool, times: dict[str, dict], misses: int) -> list[dict]:
    """One row per clip; gclip's carries its ratios to torch's, the target and whether it is met."""
    reference = times["torch"]
    rows = []
    for impl, t in times.items():
        row = base_row(workload, active, impl, t)
        if "cpu_median_s" in t:
            row["cpu_median_s"] = t["cpu_median_s"]
        if impl == "gclip.torch":
            row["vs_torch"] = t["median_s"] / reference["median_s"]
            if "cpu_median_s" in t and reference.get("cpu_median_s"):
                row["cpu_vs_torch"] = t["cpu_median_s"] / reference["cpu_median_s"]
            row["limit"] = limit_of(workload, active)
            row["ok"] = row["vs_torch"] <= row["limit"]
            row["misses"] = misses if active else 0
        rows.append(row)
    return rows
