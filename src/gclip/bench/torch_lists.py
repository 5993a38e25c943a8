"""``gclip.torch`` on a model's gradient: against torch's own clip plus one all-reduce.

Each rank holds torch parameters of GPT-2 small's 148 shapes (124M values),
their ``.grad`` in float32 or bfloat16, and the two clips run interleaved over
the same gloo group, with clipping off and active:

- ``gclip.torch``: ``gclip.torch.clip_grad_norm_(params, max_norm, comm=group)``:
  float64 accumulation where each tensor lives, the engine's header all-reduced
  over the torch group, each gradient scaled in its own dtype;
- ``torch+allreduce``: what a sharded job does with torch's own pieces:
  ``torch.nn.utils.get_total_norm`` (in the gradients' dtype), squared,
  ``dist.all_reduce``, sqrt, ``clip_grads_with_norm_`` (``max_norm / (norm +
  1e-6)``, clamped, ``_foreach_mul_``);
- ``gclip.torch-repro``: ``gclip.torch`` with ``reproducible=True``.

No target rides on these rows: they say what the drop-in costs against the
tool people would otherwise use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..gallery import TORCH_EPS
from .lists import base_row
from .ops import Norm
from .timing import slowest_rank_medians, time_reps
from .workloads import DELTA, INACTIVE_FACTOR, LIST_SCALE, TORCH_LISTS, ListWorkload

__all__ = ["bench_torch_list"]


def _params(torch: Any, workload: ListWorkload, rank: int) -> list:
    gen = torch.Generator().manual_seed(1000 + rank)
    dtype = getattr(torch, workload.dtype)
    params = []
    for shape in workload.shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * LIST_SCALE).to(dtype)
        params.append(p)
    return params


def _ops(torch_ctx: Any, params: list, norm: Norm, active: bool) -> list[tuple[str, Callable[[], None]]]:
    from .. import torch as gclip_torch

    torch, dist = torch_ctx.torch, torch_ctx.dist
    group = dist.group.WORLD
    fixed = INACTIVE_FACTOR * norm.value

    def limit() -> float:
        return norm.value * (1.0 - DELTA) if active else fixed

    def gclip(reproducible: bool) -> Callable[[], None]:
        def run() -> None:
            total = gclip_torch.clip_grad_norm_(
                params, limit(), comm=group, replicated=False, reproducible=reproducible
            )
            if active:
                norm.value = float(total) * min(1.0, limit() / float(total))

        return run

    def reference() -> None:
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads) ** 2
        dist.all_reduce(total, group=group)
        total = total.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, limit(), total)
        if active:
            norm.value = float(total) * min(1.0, limit() / (float(total) + TORCH_EPS))

    return [("gclip.torch", gclip(False)), ("gclip.torch-repro", gclip(True)), ("torch+allreduce", reference)]


def bench_torch_list(comm: Any, torch_ctx: Any, names: list[str], repeat: int | None) -> list[dict]:
    """Rows of the torch list workloads named in ``names`` (rank 0 gets them; others: [])."""
    if torch_ctx is None:
        return []
    from .. import torch as gclip_torch

    rows: list[dict] = []
    for workload in TORCH_LISTS:
        if workload.name not in names:
            continue
        params = _params(torch_ctx.torch, workload, comm.Get_rank())
        for active in (False, True):
            grads = [p.grad for p in params]
            norm = Norm(
                float(gclip_torch.get_total_norm(grads, comm=torch_ctx.dist.group.WORLD, replicated=False))
            )
            times = time_reps(comm, _ops(torch_ctx, params, norm, active), repeat or workload.repeat)
            every = comm.gather(times, root=0)
            if every is not None:
                rows += _rows(workload, active, slowest_rank_medians(every))
        del params
    return rows


def _rows(workload: ListWorkload, active: bool, times: dict[str, dict]) -> list[dict]:
    reference, default = times["torch+allreduce"]["median_s"], times["gclip.torch"]["median_s"]
    rows = []
    for impl, t in times.items():
        row = base_row(workload, active, impl, t)
        if impl != "torch+allreduce":
            row["vs_torch"] = t["median_s"] / reference
        if impl == "gclip.torch-repro":
            row["vs_default"] = t["median_s"] / default
        rows.append(row)
    return rows
