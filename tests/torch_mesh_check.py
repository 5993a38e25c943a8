"""gclip.torch with comm=DeviceMesh, mesh dimension names, refusals (run by test_torch_layouts.py).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_mesh_check.py OUTDIR

On a (dp=2, tp=2) DeviceMesh, plain tensors that dp peers hold identically
(seeded by the tp coordinate): ``comm=mesh, replicated="dp"`` (alone, and as a
per-tensor list) against math.fsum over the tp ranks' values, each once. Then
the one-line errors: a Partial(max) DTensor (sums and averages are reduced), an unknown dimension name, a rank
outside a process group passing the non-member handle; and NonFiniteNormError
caught as a RuntimeError. Each process writes OUTDIR/rank<R>.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

import gclip.torch as gt
from torch_jobs import run_case
from torch_layouts_check import error_of


def case(outdir: str) -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    g = torch.Generator().manual_seed(tp)  # dp peers hold the same values
    grads = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g)]
    every: list = [None] * 4
    dist.all_gather_object(every, [x.item() ** 2 for t in grads for x in t.reshape(-1)] if dp == 0 else [])
    report: dict = {"rank": rank, "oracle": math.sqrt(math.fsum(x for theirs in every for x in theirs))}
    report["alone"] = gt.get_total_norm(grads, comm=mesh, replicated="dp").item()
    report["listed"] = gt.get_total_norm(grads, comm=mesh, replicated=["dp", ("dp",)]).item()
    report["unknown_name"] = error_of(lambda: gt.get_total_norm(grads, comm=mesh, replicated="pp"))
    partial = DTensor.from_local(torch.ones(3), mesh["tp"], [Partial("max")])  # sums are reduced
    report["partial"] = error_of(lambda: gt.get_total_norm([partial]))
    pair = dist.new_group([0, 1])  # every rank calls new_group; ranks 2, 3 get the non-member handle
    report["outside"] = error_of(lambda: gt.get_total_norm(grads, comm=pair, replicated=False))
    bad = [torch.tensor([math.inf if rank == 3 else 1.0])]
    try:
        gt.get_total_norm(bad, error_if_nonfinite=True, replicated=False)
        report["nonfinite"] = "nothing raised"
    except RuntimeError as exc:  # as torch's clip raises
        report["nonfinite"] = f"{type(exc).__name__}: {exc}"
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run_case(case, sys.argv[1])
