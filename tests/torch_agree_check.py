"""gclip.torch where a layout could count silently wrong, or where torch is right and gclip
refused (run by test_torch_agree.py).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_agree_check.py CASE OUTDIR

CASE:

- ``stale``: a model built on a ("pp", "dp") mesh, then one trained with FSDP2 on
  ``mesh_b["dp"]`` of a ("rep", "dp") mesh. torch compares meshes by ranks and names only, so
  the second model's DTensors may carry a mesh sliced from the first root. Each call's result
  (norm or error) is written: as torch's is called, ``replicated="pp"`` (the declaration the
  error names), ``comm=mesh_b``, ``comm=mesh_b, replicated="rep"``.
- ``mismatch``: FSDP2 over 4 ranks; rank 2 passes one parameter fewer; rank 1 lacks one .grad;
  rank 3 passes one DTensor with other placements; then all alike (the norm).
- ``tp_sp``: tensor parallel with SequenceParallel norms and no FSDP (torchtitan's TP layout):
  the norms' gradients are ``Partial(sum)``. The clip, torch's clip, and the count of
  all_reduce calls gclip made (one per Partial group, none for a layout without Partial).
- ``inf_meta``: ``max_norm=inf`` (the norm, nothing scaled; torch's alike), meta gradients.
- ``ep``: expert parallel's meshes in one call: dense gradients sharded over a ("dp",) mesh of 4,
  experts on an ("edp", "ep") mesh of 2 x 2 built apart (another root), replicated along edp and
  sharded along ep; torch's clip on the same list, and gclip's.

The oracle: math.fsum over the squares of every full gradient (``full_tensor()``), each
tensor once. Each process writes OUTDIR/rank<R>.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import gclip.torch as gt
from torch_jobs import run_case
from torch_layouts_check import Block, Net, batch, error_of, full, gathered_norm, loss_of


def outcome(call) -> float | str:
    """The norm a call returns, or its one-line error."""
    got: list = []
    message = error_of(lambda: got.append(call().item()))
    return got[0] if got else message


def fsdp_model(mesh=None) -> Net:
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def stale(rank: int) -> dict:
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    first = fsdp_model(mesh_a["dp"])
    loss_of(first(batch(0))).backward()  # trained once: torch's caches now hold mesh_a's slices
    mesh_b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    model = fsdp_model(mesh_b["dp"])
    loss_of(model(batch(mesh_b.get_coordinate()[1]))).backward()  # rep peers: the same batch
    grads = [p.grad for p in model.parameters()]
    report = {
        "oracle": gathered_norm([full(g) for g in grads], rank == 0),
        "recorded_root": list(grads[0].device_mesh._get_root_mesh().mesh_dim_names),
        "torch": torch.nn.utils.get_total_norm(grads).full_tensor().item(),
    }
    report["as_torch"] = outcome(lambda: gt.get_total_norm(grads))
    report["declared"] = outcome(lambda: gt.get_total_norm(grads, replicated="pp"))
    report["comm"] = outcome(lambda: gt.get_total_norm(grads, comm=mesh_b))
    report["comm_declared"] = outcome(lambda: gt.get_total_norm(grads, comm=mesh_b, replicated="rep"))
    report["comm_rep_unknown"] = outcome(lambda: gt.get_total_norm(grads, replicated="rep"))
    return report


def mismatch(rank: int) -> dict:
    model = fsdp_model()
    loss_of(model(batch(rank))).backward()
    params = list(model.parameters())
    report = {"oracle": gathered_norm([full(p.grad) for p in params], rank == 0)}
    report["fewer"] = outcome(
        lambda: gt.get_total_norm([p.grad for p in params][: -1 if rank == 2 else None])
    )
    saved = params[3].grad
    if rank == 1:
        params[3].grad = None  # skipped, as torch skips a parameter without a gradient
    report["no_grad"] = outcome(lambda: gt.clip_grad_norm_(model.parameters(), math.inf))
    params[3].grad = saved
    mesh = params[0].grad.device_mesh
    odd = DTensor.from_local(torch.ones(3), mesh, [Replicate() if rank == 3 else Shard(0)], run_check=False)
    report["placements"] = outcome(lambda: gt.get_total_norm([p.grad for p in params] + [odd]))
    report["alike"] = outcome(lambda: gt.clip_grad_norm_(model.parameters(), math.inf))
    return report


class _Counted:
    """Counts dist.all_reduce calls (and passes them on)."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = dist.all_reduce

    def __enter__(self) -> _Counted:
        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.real


SP_PLAN = {
    "norm": SequenceParallel(),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
}


def tp_sp(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for b in model:
        parallelize_module(b, mesh, SP_PLAN)
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(1))  # (batch, sequence, width)
    y = model(distribute_tensor(x, mesh, [Shard(1)]).to_local())
    (10.0 * (y * y).sum()).backward()
    params = list(model.parameters())
    before = [full(p.grad) for p in params]
    report: dict = {"oracle": gathered_norm(before, rank == 0)}
    report["placements"] = sorted({repr(p.grad.placements) for p in params})
    report["torch"] = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor().item()
    limit = report["oracle"] / 3
    with _Counted() as counted:
        report["norm"] = gt.clip_grad_norm_(params, limit).item()
    report["all_reduces"] = counted.calls
    report["limit"] = limit
    report["clipped"] = gathered_norm([full(p.grad) for p in params], rank == 0)
    report["still_partial"] = sum(p.grad.placements[0].is_partial() for p in params)
    plain = [p.grad for p in params if not p.grad.placements[0].is_partial()]
    with _Counted() as counted:
        gt.get_total_norm(plain)
    report["all_reduces_without_partial"] = counted.calls
    return report


def inf_meta(rank: int) -> dict:
    model = fsdp_model()
    loss_of(model(batch(rank))).backward()
    params = list(model.parameters())
    before = [full(p.grad) for p in params]
    report: dict = {"oracle": gathered_norm(before, rank == 0)}
    report["norm"] = gt.clip_grad_norm_(params, math.inf).item()
    report["unchanged"] = all(torch.equal(a, full(p.grad)) for a, p in zip(before, params))
    report["norm_tensor_inf"] = gt.clip_grad_norm_(params, torch.tensor(math.inf)).item()
    report["torch"] = torch.nn.utils.clip_grad_norm_(params, math.inf).full_tensor().item()
    report["torch_unchanged"] = all(torch.equal(a, full(p.grad)) for a, p in zip(before, params))
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    for p in meta.parameters():
        p.grad = torch.empty_like(p)
    report["meta"] = outcome(lambda: gt.clip_grad_norm_(meta.parameters(), 1.0, replicated=False))
    return report


def ep(rank: int) -> dict:
    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    g = torch.Generator().manual_seed(7)
    dense = [distribute_tensor(torch.randn(8, 3, generator=g), dense_mesh, [Shard(0)]) for _ in range(3)]
    experts = [
        distribute_tensor(torch.randn(4, 5, generator=g), expert_mesh, [Replicate(), Shard(0)])
        for _ in range(2)
    ]
    grads = dense + experts
    report: dict = {"oracle": gathered_norm([full(t) for t in grads], rank == 0)}
    report["torch"] = error_of(lambda: torch.nn.utils.get_total_norm(grads))[:200]
    report["norm"] = outcome(lambda: gt.get_total_norm(grads))
    return report


CASES = {"stale": stale, "mismatch": mismatch, "tp_sp": tp_sp, "inf_meta": inf_meta, "ep": ep}


def case(outdir: str, name: str) -> None:
    rank = dist.get_rank()
    report = {"rank": rank, **CASES[name](rank)}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run_case(case, sys.argv[2], sys.argv[1])
