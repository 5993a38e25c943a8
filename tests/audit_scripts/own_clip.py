"""gclip's own clip and the gallery's bugs, each installed in a training step; gclip.audit runs this.

    torchrun --nproc-per-node 4 own_clip.py --layout L --modes A,B,...

Step k clips with mode k: ``global`` is ``gclip.torch.clip_grad_norm_`` itself; a bug of
``gclip.gallery.BUGS`` is ``gclip.gallery.torch.clip_grad_norm_(mode=NAME)``; the layout bugs are
gclip's correct clip told the wrong layout, as real code tells it:

- ``dp-replicas-summed`` (``tp-duplicates-summed``): DDP's (TP's plain) gradients declared
  shards (``replicated=False``);
- ``pp-stages-apart``: the clip over this stage's data-parallel group only (``comm=`` that group).

--layout: the layouts of docs/torch.md (layouts.py), and pp-fsdp (2 stages x 2 FSDP ranks).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from layouts import LAYOUTS, MAX_NORM, data, lay_out, net
from torch import nn

import gclip.gallery.torch as gallery_torch
import gclip.torch as gclip_torch

PP_MESH: dict = {}  # pp-fsdp's DeviceMesh: its stages are named by comm= (a recorded root may be stale)


def clip(mode: str, params: list, layout: str, group, limit: float) -> None:
    plain = True if layout in ("ddp", "tp") else None  # DDP's and TP's plain gradients: copies
    if mode == "global":
        gclip_torch.clip_grad_norm_(params, limit, replicated=plain, comm=PP_MESH.get(layout))
    elif mode in ("dp-replicas-summed", "tp-duplicates-summed"):
        gclip_torch.clip_grad_norm_(params, limit, replicated=False)
    elif mode == "pp-stages-apart":
        gclip_torch.clip_grad_norm_(params, limit, comm=group)
    else:
        gallery_torch.clip_grad_norm_(params, limit, mode=mode, replicated=plain)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="fsdp2", choices=[*LAYOUTS, "pp-fsdp"])
    parser.add_argument("--modes", default="global")
    parser.add_argument("--max-norm", type=float, default=MAX_NORM)
    args = parser.parse_args()
    modes = args.modes.split(",")
    dist.init_process_group("gloo")
    group, schedule, first = None, None, True
    if args.layout == "pp-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
        PP_MESH[args.layout] = mesh
        first = mesh["pp"].get_local_rank() == 0
        whole = net()
        model: nn.Module = (
            nn.Sequential(whole.inp, whole.blocks[0]) if first else nn.Sequential(whole.blocks[1], whole.out)
        )
        fully_shard(model, mesh=mesh["dp"])
        group = mesh["dp"]  # this stage's data-parallel ranks, as a DeviceMesh (its names are read)
        stage = PipelineStage(
            model, mesh["pp"].get_local_rank(), 2, torch.device("cpu"), group=mesh["pp"].get_group()
        )
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
        torch.manual_seed(1 + mesh["dp"].get_local_rank())
        x, y = torch.randn(8, 5) * 4, torch.randn(8, 3)
    else:
        model = lay_out(net(), args.layout)
        if args.layout == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        x, y = data(args.layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for mode in modes:
        optimizer.zero_grad()
        if schedule is None:
            nn.functional.mse_loss(model(x), y).backward()
        elif first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        clip(mode, list(model.parameters()), args.layout, group, args.max_norm)
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
