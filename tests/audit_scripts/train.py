"""A small training script, left as a user would write it: gclip.audit runs it unmodified.

    torchrun --nproc-per-node 4 train.py --layout fsdp2 --clip torch
    torchrun --nproc-per-node 4 -m gclip.audit train.py --layout fsdp2 --clip per-rank

--layout: ddp, fsdp2, hsdp (2 x 2) or pp-fsdp (2 stages x 2 FSDP ranks). --clip: how the
step clips, each the way some real code did it:

- torch:           torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
- gclip:           gclip.torch.clip_grad_norm_ (replicated=True under DDP)
- per-rank:        each rank clips its own shard by its own norm (the seed incident)
- per-stage:       torch's clip on each pipeline stage's parameters (torchtitan #596)
- replicas-summed: the squares all-reduced over every rank, DDP replicas counted as shards
                   (twinkle PR #290)
- never-scaled:    the norm of full copies of the gradients, then clip_grads_with_norm_ given
                   the gradients where it expects parameters, so nothing is scaled
                   (transformers #46113)
- none:            no clip at all
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

MAX_NORM = 0.2
PP_MESH: dict = {}  # pp-fsdp's DeviceMesh, named to gclip's clip as comm=


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def clip(how: str, params: list[nn.Parameter], layout: str) -> None:
    if how == "torch":
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    elif how == "gclip":
        from gclip.torch import clip_grad_norm_

        # pipeline stages: named by the DeviceMesh given as comm= (torch's recorded root may be stale)
        copies = True if layout == "ddp" else None
        clip_grad_norm_(params, MAX_NORM, replicated=copies, comm=PP_MESH.get(layout))
    elif how == "per-rank":
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
        for g in local:
            g.mul_(min(1.0, MAX_NORM / (float(norm) + 1e-6)))
    elif how == "per-stage":
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)  # this stage's parameters only
    elif how == "replicas-summed":
        sq = sum(p.grad.detach().double().pow(2).sum() for p in params)
        dist.all_reduce(sq)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, sq.sqrt())
    elif how == "never-scaled":  # as transformers #46113 found it: the norm right, nothing scaled
        grads = [p.grad for p in params]
        local = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        total = torch.nn.utils.get_total_norm(local)
        torch.nn.utils.clip_grads_with_norm_(grads, MAX_NORM, total)  # gradients have no .grad
    elif how != "none":
        raise SystemExit(f"unknown --clip {how}")


def oracle_norm(params: list[nn.Parameter], layout: str) -> float:
    """The test's oracle, outside the audit: math.fsum over the squares of every full gradient,
    each parameter once (a DTensor's full_tensor(); a stage's parameters gathered from every stage)."""
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    mine = math.fsum(float(v) ** 2 for g in full for v in g.double().reshape(-1).tolist())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if layout == "pp-fsdp":  # the mesh (pp, dp): ranks 0-1 hold stage 0, ranks 2-3 stage 1
        return math.sqrt(every[0] + every[2])
    return math.sqrt(mine)


def local_scale(before: list[torch.Tensor], params: list[nn.Parameter]) -> float | None:
    """The factor this rank's local gradients got, by least squares over real copies."""
    after = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    bb = math.fsum(float((b.double() * b.double()).sum()) for b in before)
    ab = math.fsum(float((a.double() * b.double()).sum()) for a, b in zip(after, before))
    return ab / bb if bb > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="ddp", choices=["ddp", "fsdp2", "hsdp", "pp-fsdp"])
    parser.add_argument("--clip", default="torch")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 + rank)
    x, y = torch.randn(8, 6) * 4, torch.randn(8, 3)
    net = model()
    schedule = None
    if args.layout == "ddp":
        net = nn.parallel.DistributedDataParallel(net)
    elif args.layout in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = (
            init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            if args.layout == "fsdp2"
            else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        )
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        PP_MESH["pp-fsdp"] = mesh
        stage_index = mesh["pp"].get_local_rank()
        net = net[:3] if stage_index == 0 else net[3:]
        fully_shard(net, mesh=mesh["dp"])
        stage = PipelineStage(net, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(args.steps):
        optimizer.zero_grad()
        if schedule is None:
            nn.functional.mse_loss(net(x), y).backward()
        elif stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        params = list(net.parameters())
        oracle = os.environ.get("TRAIN_ORACLE")
        if oracle:
            norm = oracle_norm(params, args.layout)
            before = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in params]
        clip(args.clip, params, args.layout)
        if oracle:
            with open(os.path.join(oracle, f"rank{rank}.jsonl"), "a") as out:
                out.write(json.dumps({"norm": norm, "scale": local_scale(before, params)}) + "\n")
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and os.environ.get("TRAIN_SAYS"):
        print("trained")


if __name__ == "__main__":
    main()
