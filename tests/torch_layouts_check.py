"""gclip.torch on PyTorch's own layouts, as users launch them (run by test_torch_layouts.py).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_layouts_check.py LAYOUT OUTDIR

LAYOUT is one of fsdp, hsdp, tp, fsdp_tp, pp_fsdp, ddp, fsdp_2d (FSDP on dp of
a (dp, tp) mesh whose tp peers hold copies: refused, then ``replicated="tp"``). Each process builds a
small model on that layout (FSDP2 ``fully_shard``, ``parallelize_module``,
DeviceMesh, DDP, two pipeline stages passing activations by send/recv), runs
one backward, and writes OUTDIR/rank<R>.json with:

- ``norm``: what ``gclip.torch.clip_grad_norm_(model.parameters(), limit)``
  returned, called as torch's is (no declaration; DDP: see below);
- ``oracle``: math.fsum of the squares of every full gradient
  (``full_tensor()``), each tensor once (one rank per pipeline stage gives its
  stage's), gathered from every rank;
- ``clipped``: the fsum norm of the full gradients after the clip;
- ``scaled_once``: whether every full gradient is exactly its old value times
  the scale rounded toward zero to float32;
- ``explain_norm``: the norm from ``gclip.torch.explain``'s rows (each tensor or
  shard once), and ``explain_shares`` their shares' sum;
- ``torch``: torch's own ``get_total_norm`` of the same gradients on this
  rank, or its error.

DDP, and the parameters TP leaves plain (embed, norms, head), are called with
``replicated=True``, pp_fsdp with ``comm=mesh`` (``undeclared``: the error without it).

The model's width 6 does not divide by 4: FSDP2's shards are uneven and
some are empty.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gclip.torch as gt
from torch_jobs import run_case

D, H, IN, OUT, BATCH = 6, 12, 5, 3, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, first: bool = True, last: bool = True, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, D) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, OUT) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


def batch(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(100 + seed))


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (y * y).sum() * 10.0  # large enough that the clip is at work


TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
COMM: dict = {}  # the layouts whose clip names its DeviceMesh as comm=


def build(layout: str, rank: int):
    """(the parameters of this rank's model, does this rank give its stage's full gradient, run backward)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    if layout == "fsdp":
        model = Net()
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        return model, rank == 0, lambda: loss_of(model(batch(rank))).backward()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = Net()
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rank == 0, lambda: loss_of(model(batch(rank))).backward()
    if layout == "tp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = Net()
        for b in model.blocks:
            parallelize_module(b, mesh, TP_PLAN)
        return model, rank == 0, lambda: loss_of(model(batch(0))).backward()  # tp ranks: the same batch
    if layout == "fsdp_tp":  # torchtitan's layout; embed, norms and head stay 1-D dp DTensors
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = Net()
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], TP_PLAN)
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh.get_coordinate()[0]
        return model, rank == 0, lambda: loss_of(model(batch(dp))).backward()
    if layout == "pp_fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage, dp = mesh.get_coordinate()
        whole = Net(blocks=2)
        model = Net(
            first=stage == 0, last=stage == 1, blocks=1
        )  # stage 0: embed + block 0; 1: block 1 + head
        model.blocks[0].load_state_dict(whole.blocks[stage].state_dict())
        if stage == 0:
            model.embed.load_state_dict(whole.embed.state_dict())
        else:
            model.head.load_state_dict(whole.head.state_dict())
        fully_shard(model.blocks[0], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        COMM[layout] = mesh  # its dimension names are read from comm= alone
        peer = int(mesh.mesh[1 - stage, dp])

        def step() -> None:  # one microbatch through two stages
            if stage == 0:
                act = model(batch(dp))
                dist.send(act.detach().contiguous(), peer)
                grad = torch.empty_like(act)
                dist.recv(grad, peer)
                act.backward(grad)
            else:
                act = torch.empty(BATCH, D)
                dist.recv(act, peer)
                act.requires_grad_(True)
                loss_of(model(act)).backward()
                dist.send(act.grad.contiguous(), peer)

        return model, dp == 0, step
    if layout == "fsdp_2d":  # FSDP on dp of a (dp, tp) mesh, nothing on tp: its peers hold copies
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = Net()
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh.get_coordinate()[0]
        return model, rank == 0, lambda: loss_of(model(batch(dp))).backward()
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(Net())
        return model, rank == 0, lambda: loss_of(model(batch(rank))).backward()
    raise SystemExit(f"unknown layout {layout!r}")


def full(g: torch.Tensor) -> torch.Tensor:
    """The whole gradient (a collective over a DTensor's mesh), as float64."""
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().double().reshape(-1)


def squares(fulls: list[torch.Tensor]) -> list[float]:
    return [x * x for f in fulls for x in f.tolist()]  # a float32 squared is exact in float64


def gathered_norm(fulls: list[torch.Tensor], leader: bool) -> float:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, squares(fulls) if leader else [])
    return math.sqrt(math.fsum(x for theirs in every for x in theirs))


def float32_toward_zero(x: float) -> float:
    x32 = np.float32(x)
    return float(np.nextafter(x32, np.float32(0)) if float(x32) > x else x32)


def error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return ""


def case(outdir: str, layout: str) -> None:
    rank = dist.get_rank()
    model, leader, backward = build(layout, rank)
    backward()
    params = [p for p in model.parameters() if p.grad is not None]
    before = [full(p.grad) for p in params]
    oracle = gathered_norm(before, leader)
    report: dict = {"rank": rank, "layout": layout, "oracle": oracle}
    try:
        mine = torch.nn.utils.get_total_norm([p.grad for p in params])
        report["torch"] = float(mine.full_tensor() if hasattr(mine, "full_tensor") else mine)
    except Exception as exc:  # noqa: BLE001 - what torch's own clip does on this layout
        report["torch"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    declared = {"ddp": True, "tp": True, "fsdp_2d": "tp"}.get(layout)
    rows = gt.explain([p.grad for p in params], replicated=declared)  # who counts what, as the clip reads it
    report["explain_norm"] = math.sqrt(math.fsum(row.power for row in rows))
    report["explain_shares"] = math.fsum(row.share for row in rows)
    limit = oracle / 3
    if layout in ("ddp", "tp"):  # plain tensors (DDP's, those TP leaves alone) are refused without a
        # declaration, then declared as copies on every rank: True applies to the plain ones only
        report["undeclared"] = error_of(lambda: gt.clip_grad_norm_(model.parameters(), limit))
        norm = gt.clip_grad_norm_(model.parameters(), limit, replicated=True).item()
    elif layout == "fsdp_2d":  # copies no DTensor shows: refused, then declared by the mesh dimension's name
        report["undeclared"] = error_of(lambda: gt.clip_grad_norm_(model.parameters(), limit))
        norm = gt.clip_grad_norm_(model.parameters(), limit, replicated="tp").item()
    elif layout in COMM:  # pipeline stages: named by comm's mesh (torch's recorded root may be stale)
        report["undeclared"] = error_of(lambda: gt.clip_grad_norm_(model.parameters(), limit))
        norm = gt.clip_grad_norm_(model.parameters(), limit, comm=COMM[layout]).item()
    else:
        norm = gt.clip_grad_norm_(model.parameters(), limit).item()  # as torch's is called
    after = [full(p.grad) for p in params]
    scale = float32_toward_zero(limit / norm)
    report["norm"], report["limit"] = norm, limit
    report["clipped"] = gathered_norm(after, leader)
    report["scaled_once"] = all(torch.equal(a, (b * scale).float().double()) for a, b in zip(after, before))
    report["local_counts"] = [
        p.grad.to_local().numel() if hasattr(p.grad, "to_local") else p.grad.numel() for p in params
    ]
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_case(case, sys.argv[2], sys.argv[1])
