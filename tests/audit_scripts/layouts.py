"""The small model and the layouts the framework scripts lay it out on (torch's own APIs).

A framework that cannot lay a model out on the CPU itself (accelerate ignores its FSDP
plugin there) gets the model laid out here, and its clip is audited on it as its own
code path runs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

MAX_NORM = 0.2
LAYOUTS = ("ddp", "fsdp2", "hsdp", "tp", "fsdp-tp")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def data(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: its own under data parallelism, its tensor-parallel group's under TP
    (the ranks of a TP group compute on the same batch)."""
    rank = dist.get_rank()
    replica = {"tp": 0, "fsdp-tp": rank // 2}.get(layout, rank)
    torch.manual_seed(1 + replica)
    return torch.randn(8, 5) * 4, torch.randn(8, 3)


def lay_out(model: Net, layout: str) -> nn.Module:
    """``model`` laid out by torch's APIs (DDP is left to the framework)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
    elif layout == "fsdp-tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout != "ddp":
        raise SystemExit(f"unknown layout {layout}")
    return model
