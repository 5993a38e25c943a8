"""What gclip does in a torchrun job without MPI (run by test_torch_launch.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/torch_torchrun_check.py OUTDIR

Each process writes OUTDIR/rank<R>.json: the errors the core API raises with
comm=None (MPI sees one rank, but WORLD_SIZE says 2) and with the torch group
as comm; gclip.torch's error with comm=None before init_process_group; and,
once the gloo group is up, the norm gclip.torch.clip_grad_norm_ finds with
comm=None beside the fsum of both processes' gradients, and whether every
gradient was scaled once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist

import gclip
import gclip.torch as gt
from torch_jobs import teardown, watchdog
from torch_oracle import float64, fsum_norm, scaled_once


def error_of(call) -> str | None:
    try:
        call()
    except gclip.GclipError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported: the test wants a GclipError
        return f"not a GclipError: {type(exc).__name__}: {exc}"
    return None


def main(outdir: str) -> None:
    watchdog()
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    params = []
    for shape, dtype in (((5, 4), torch.float32), ((7,), torch.bfloat16), ((3,), torch.float16)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    arrays = [float64(p.grad) for p in params]
    report: dict = {"rank": rank}
    report["core_none"] = error_of(lambda: gclip.clip_by_global_norm(arrays, 1.0))
    report["torch_none_before_init"] = error_of(lambda: gt.clip_grad_norm_(params, 1.0))
    dist.init_process_group("gloo")
    report["core_none_after_init"] = error_of(lambda: gclip.global_norm(arrays))
    report["core_world"] = error_of(lambda: gclip.global_norm(arrays, comm=dist.group.WORLD))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, arrays)
    exact = fsum_norm([a for theirs in everyone for a in theirs])
    limit = exact / 3
    norm = gt.clip_grad_norm_((p for p in params), limit, replicated=False)  # comm=None: the torch group
    report["norm"], report["oracle"] = norm.item(), exact
    report["scaled_once"] = [scaled_once(b, p.grad, limit / norm.item()) for b, p in zip(arrays, params)]
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
    teardown(dist)  # after the verdict: an abort at teardown cannot take it away


if __name__ == "__main__":
    main(sys.argv[1])
