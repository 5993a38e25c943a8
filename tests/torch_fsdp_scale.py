"""Per-parameter cost of the clip on FSDP2 as the parameter count grows (a measurement, quoted in
docs/torch.md; no test asserts on its timings).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_fsdp_scale.py 1000,4000,16000 4000

N parameters of 8 values each under one ``fully_shard`` (4 ranks, gloo), each gradient a DTensor:
the best of 3 clips (active) of ``gclip.torch.clip_grad_norm_``, and of torch's
``clip_grad_norm_`` (with ``.full_tensor()`` of its norm) for N up to the second argument. Rank 0
prints one line per N: the seconds and microseconds per parameter.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

import gclip.torch as gt


def best_of(call, reps: int) -> float:
    call()
    dist.barrier()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def main(counts: str, torch_up_to: str) -> None:
    dist.init_process_group("gloo")
    for n in (int(x) for x in counts.split(",")):
        module = nn.Module()
        module.ps = nn.ParameterList([nn.Parameter(torch.randn(8)) for _ in range(n)])
        fully_shard(module)
        params = list(module.parameters())
        for p in params:
            p.grad = distribute_tensor(torch.randn(8), p.device_mesh, p.placements)
        seconds = best_of(lambda ps=params: gt.clip_grad_norm_(ps, 1e-3), 3)
        row = {"gclip_s": seconds, "gclip_us_per_param": seconds / n * 1e6}
        if n <= int(torch_up_to):
            seconds = best_of(lambda ps=params: torch.nn.utils.clip_grad_norm_(ps, 1e-3).full_tensor(), 1)
            row.update(torch_s=seconds, torch_us_per_param=seconds / n * 1e6)
        if dist.get_rank() == 0:
            print(n, row, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
