"""torchtitan's ``clip_grad_norm_`` on torchtitan's own meshes; gclip.audit runs this unmodified.

    torchrun --nproc-per-node 4 fw_torchtitan.py --layout pp-fsdp|fsdp-tp [--clip titan|titan-no-pp|gclip]

torchtitan's trainer needs a model, tokenizer and data from its own configs and a GPU: on a
machine without one its ``ParallelDims.build_mesh`` asks CUDA for the device
(``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``: its
``device_type`` falls back to "cuda"). So this script sets that ``device_type`` to "cpu"
and keeps what decides the clip: the meshes of torchtitan's ``build_mesh`` (pp x fsdp, or
fsdp x tp: 4 ranks), the small model laid out on
them with torch's APIs as torchtitan's parallelize functions do (FSDP2 per block, TP plans,
a ``PipelineStage`` per pp rank with the GPipe schedule), and the clip the trainer calls:

- titan:       ``torchtitan.distributed.utils.clip_grad_norm_(params, MAX_NORM, pp_mesh=...)``
- titan-no-pp: the same without ``pp_mesh``, the reduction PR #649 added (issue #596)
- gclip:       ``gclip.torch.clip_grad_norm_(params, MAX_NORM)`` in its place
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from layouts import MAX_NORM, Net
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchtitan.distributed import parallel_dims
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip


class Stage(nn.Module):
    """One pipeline stage of Net: the input layer and block 0, or block 1 and the head."""

    def __init__(self, net: Net, first: bool) -> None:
        super().__init__()
        self.first = first
        self.layers = nn.ModuleList([net.inp, net.blocks[0]] if first else [net.blocks[1], net.out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="pp-fsdp", choices=["pp-fsdp", "fsdp-tp"])
    parser.add_argument("--clip", default="titan", choices=["titan", "titan-no-pp", "gclip"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pp, tp = (2, 1) if args.layout == "pp-fsdp" else (1, 2)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world // (pp * tp), cp=1, tp=tp, pp=pp, ep=1, world_size=world
    )
    parallel_dims.device_type = "cpu"  # its fallback is "cuda" (see above)
    dims.build_mesh()
    fsdp_mesh = dims.get_mesh("dp_shard")
    torch.manual_seed(0)
    net = Net()
    schedule, pp_mesh = None, None
    if args.layout == "pp-fsdp":
        pp_mesh = dims.get_mesh("pp")
        first = pp_mesh.get_local_rank() == 0
        model: nn.Module = Stage(net, first)
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        stage = PipelineStage(
            model, pp_mesh.get_local_rank(), 2, torch.device("cpu"), group=pp_mesh.get_group()
        )
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    else:
        first = True
        model = net
        for block in net.blocks:
            parallelize_module(
                block, dims.get_mesh("tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()}
            )
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(net, mesh=fsdp_mesh)
    torch.manual_seed(1 + fsdp_mesh.get_local_rank())  # a batch per data-parallel rank
    x, y = torch.randn(8, 5) * 4, torch.randn(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        if schedule is None:
            nn.functional.mse_loss(model(x), y).backward()
        elif first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        params = list(model.parameters())
        if args.clip == "titan":
            titan_clip(params, MAX_NORM, pp_mesh=pp_mesh)
        elif args.clip == "titan-no-pp":
            titan_clip(params, MAX_NORM)
        else:
            from gclip.torch import clip_grad_norm_

            clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
