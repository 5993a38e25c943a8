"""FSDP2 x tensor parallel (torchtitan's layout) with gclip.torch, against one process.

    torchrun --nproc-per-node 4 examples/torch_fsdp_tp.py           # mesh (dp=2, tp=2), gloo
    python examples/torch_fsdp_tp.py --reference                    # one process, the whole model

A small float64 model: an embedding, two residual blocks (a LayerNorm, a
column-parallel and a row-parallel linear, tanh between them) and a head. On 4
processes the blocks' linears are cut over ``tp`` by ``parallelize_module`` and
every module is sharded over ``dp`` by FSDP2's ``fully_shard``; the embedding,
the norms and the head stay 1-D ``dp`` DTensors whose ``tp`` peers hold copies.
The clip is torch's call, unchanged:

    clip_grad_norm_(model.parameters(), MAX_NORM)

gclip reads every gradient's placements and counts each value once, in one
all-reduce (torch's own clip fails on this layout: "All operands in
aten.stack.default must have the same mesh"). The reference trains the same
model in one process on the same batches, with torch's ``get_total_norm`` and
the exact scale min(1, max_norm / norm). ``--json`` prints the losses and norms
(rank 0 only).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

D, H, IN, OUT, BATCH, DP = 8, 16, 5, 3, 4, 2
MAX_NORM, LR = 0.5, 0.2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def data(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank ``dp`` at ``step`` (the same on its tp peers)."""
    g = torch.Generator().manual_seed(1000 * step + dp)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, OUT, generator=g, dtype=torch.float64)


def new_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def loss_of(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((model(x) - t) ** 2).mean()


def reference(steps: int) -> dict:
    """One process: the mean of the dp ranks' losses, torch's norm, the exact scale."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        loss = sum(loss_of(model, *data(step, dp)) for dp in range(DP)) / DP
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads).item()
        torch._foreach_mul_(grads, min(1.0, MAX_NORM / norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm)
    return {"ranks": 1, "losses": losses, "norms": norms}


def distributed(steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gclip.torch import clip_grad_norm_

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (DP, dist.get_world_size() // DP), mesh_dim_names=("dp", "tp"))
    model = new_model()
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = mesh.get_coordinate()[0]
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, *data(step, dp))
        loss.backward()  # FSDP2 averages the gradients over dp
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)  # torch's call: no declaration
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(mean.item() / DP)
        norms.append(norm.item())
    out = {"ranks": dist.get_world_size(), "losses": losses, "norms": norms}
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true", help="train in one process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the losses and norms as JSON")
    args = parser.parse_args()
    run = reference(args.steps) if args.reference else distributed(args.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if args.json:
        print(json.dumps(run))
        return
    for step, (loss, norm) in enumerate(zip(run["losses"], run["norms"])):
        print(f"step {step:3d}  loss {loss:.12f}  norm {norm:.6f}")


if __name__ == "__main__":
    main()
