"""What clipping adds to an optimizer step: GPT-2 small's gradients, torch's fused AdamW.

Each rank holds torch parameters of GPT-2 small's 148 shapes and their ``.grad`` (float32, or
bfloat16 parameters and gradients), with ``torch.optim.AdamW(fused=True)``, and times, interleaved,
over the bench's gloo group, the clip always active (the limit below the norm):

- ``step``: ``optimizer.step()`` alone, no clip (the floor these rows subtract);
- ``torch-clip+step``: torch's pieces, as a sharded job uses them: ``get_total_norm``, squared,
  ``dist.all_reduce``, sqrt, ``clip_grads_with_norm_``, then ``optimizer.step()``;
- ``gclip-folded+step``: ``gclip.torch.clip_step``: the global norm, the scale handed to the
  fused step as ``grad_scale``;
- ``step+grad_scale``: ``optimizer.step()`` handed the same ``grad_scale`` (2: the limit is half
  the norm) with no norm at all: what the fold costs inside torch's own fused step (on the CPU it
  divides each gradient and writes it back), the part of ``gclip-folded+step`` that is not gclip's;

and the same with a ``GradScaler`` (the gradients hold the scaled values):

- ``amp-step``: ``scaler.step(optimizer)`` + ``update()`` (its own inf check, no clip);
- ``torch-amp-clip+step``: ``scaler.unscale_``, torch's clip as above, ``scaler.step``, ``update()``;
- ``gclip-folded-amp+step``: ``clip_step(optimizer, scaler=scaler)``, ``update()``.

Before each timed call the gradients are restored from a saved copy (untimed), so every call
sees the same gradients whatever the previous one did to them. ``adds`` is a row's time minus
its floor's (``step`` or ``amp-step``); ``vs_torch`` is gclip's ``adds`` over torch's. The same in
the calling thread's CPU time (``cpu_*``: torch runs one thread), which a busy machine disturbs less:
a moment another process holds the core does not count.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from .lists import base_row
from .workloads import GPT2_SMALL, LIST_SCALE, ListWorkload

__all__ = ["STEP_LISTS", "bench_step"]

STEP_LISTS = (
    ListWorkload("gpt2-small-step", GPT2_SMALL, "float32", 5),
    ListWorkload("gpt2-small-step-bf16", GPT2_SMALL, "bfloat16", 5),
)
LOSS_SCALE = 2.0**10  # the GradScaler's (it never grows here: growth_interval is beyond the reps)


def _setup(torch: Any, workload: ListWorkload, rank: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(2000 + rank)
    dtype = getattr(torch, workload.dtype)
    params, saved = [], []
    for shape in workload.shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype) * 0.02)
        g = (torch.randn(shape, generator=gen) * LIST_SCALE).to(dtype)
        p.grad = g.clone()
        params.append(p)
        saved.append(g)
    return params, saved


def _ops(
    torch_ctx: Any, params: list, limit: float
) -> tuple[Any, list[tuple[str, bool, Callable[[], None]]]]:
    """(the optimizer, [(name, amp, op)]): amp ops expect the gradients multiplied by LOSS_SCALE."""
    from .. import torch as gclip_torch

    torch, dist = torch_ctx.torch, torch_ctx.dist
    group = dist.group.WORLD
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # makes the scale tensor

    def torch_clip() -> None:
        total = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
        dist.all_reduce(total, group=group)
        torch.nn.utils.clip_grads_with_norm_(params, limit, total.sqrt())

    def step() -> None:
        opt.step()

    halve = torch.full((), 2.0, dtype=torch.float32)
    no_inf = torch.zeros((), dtype=torch.float32)

    def grad_scale_step() -> None:
        opt.grad_scale, opt.found_inf = halve, no_inf
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf

    def torch_clip_step() -> None:
        torch_clip()
        opt.step()

    def folded() -> None:
        gclip_torch.clip_step(opt, limit, comm=group, replicated=False)

    def amp_step() -> None:
        scaler.step(opt)
        scaler.update()

    def torch_amp() -> None:
        scaler.unscale_(opt)
        torch_clip()
        scaler.step(opt)
        scaler.update()

    def folded_amp() -> None:
        gclip_torch.clip_step(opt, limit, scaler=scaler, comm=group, replicated=False)
        scaler.update()

    return opt, [
        ("step", False, step),
        ("torch-clip+step", False, torch_clip_step),
        ("gclip-folded+step", False, folded),
        ("step+grad_scale", False, grad_scale_step),
        ("amp-step", True, amp_step),
        ("torch-amp-clip+step", True, torch_amp),
        ("gclip-folded-amp+step", True, folded_amp),
    ]


def _time(comm: Any, torch: Any, params: list, saved: list, ops: list, repeat: int) -> dict[str, list]:
    """Per op: [(wall seconds, this thread's CPU seconds)] per rep. torch runs one thread here, so
    the CPU time is the op's own work, less the moments another process held the core."""
    from time import perf_counter, thread_time

    times: dict[str, list] = {name: [] for name, _, _ in ops}
    k = len(ops)
    with torch.no_grad():
        for rep in range(repeat + 1):  # rep 0: untimed, every op once (state made, code warm)
            for name, amp, op in [ops[(rep + i) % k] for i in range(k)]:
                for p, g in zip(params, saved):
                    p.grad.copy_(g)
                if amp:
                    torch._foreach_mul_([p.grad for p in params], LOSS_SCALE)
                comm.Barrier()
                t0, c0 = perf_counter(), thread_time()
                op()
                t, c = perf_counter() - t0, thread_time() - c0
                if rep:
                    times[name].append((t, c))
    return times


def bench_step(comm: Any, torch_ctx: Any, names: list[str], repeat: int | None) -> list[dict]:
    """Rows of the step workloads named in ``names`` (rank 0 gets them; others: [])."""
    if torch_ctx is None:
        return []
    from .. import torch as gclip_torch

    rows: list[dict] = []
    for workload in STEP_LISTS:
        if workload.name not in names:
            continue
        params, saved = _setup(torch_ctx.torch, workload, comm.Get_rank())
        norm = float(gclip_torch.get_total_norm(saved, comm=torch_ctx.dist.group.WORLD, replicated=False))
        _, ops = _ops(torch_ctx, params, 0.5 * norm)
        times = _time(comm, torch_ctx.torch, params, saved, ops, repeat or workload.repeat)
        every = comm.gather(times, root=0)
        if every is not None:
            rows += _rows(workload, every)
        del params, saved, ops
    return rows


def _rows(workload: ListWorkload, every: list[dict[str, list]]) -> list[dict]:
    """Per rep the slowest rank (wall) and the busiest (CPU); medians; what each clip adds to its
    floor, and gclip's added time over torch's, in wall time and in CPU time."""
    count = len(every[0]["step"])
    reps = {name: [max(r[name][i][0] for r in every) for i in range(count)] for name in every[0]}
    cpu = {
        name: statistics.median(max(r[name][i][1] for r in every) for i in range(count)) for name in every[0]
    }
    med = {name: statistics.median(t) for name, t in reps.items()}
    floors = {"torch-clip+step": "step", "gclip-folded+step": "step", "step+grad_scale": "step"}
    floors |= {"torch-amp-clip+step": "amp-step", "gclip-folded-amp+step": "amp-step"}
    peer = {"gclip-folded+step": "torch-clip+step", "gclip-folded-amp+step": "torch-amp-clip+step"}
    rows = []
    for name, t in reps.items():
        row = base_row(workload, True, name, {"median_s": med[name], "min_s": min(t), "reps": len(t)})
        row["ranks"] = len(every)
        row["cpu_median_s"] = cpu[name]
        if name in floors:
            row["adds_s"] = med[name] - med[floors[name]]
            row["cpu_adds_s"] = cpu[name] - cpu[floors[name]]
        if name in peer:
            torch_adds = med[peer[name]] - med[floors[peer[name]]]
            row["vs_torch"] = row["adds_s"] / torch_adds if torch_adds > 0 else float("nan")
            torch_cpu = cpu[peer[name]] - cpu[floors[peer[name]]]
            row["cpu_vs_torch"] = row["cpu_adds_s"] / torch_cpu if torch_cpu > 0 else float("nan")
        if name == "gclip-folded+step" and "step+grad_scale" in reps:  # of what it adds, torch's part
            row["torch_fold_s"] = med["step+grad_scale"] - med["step"]
            row["cpu_torch_fold_s"] = cpu["step+grad_scale"] - cpu["step"]
        rows.append(row)
    return rows
