"""Tensor-parallel training with gclip.torch: linear layers cut over the ranks, biases held by all.

    mpirun -n 4 python examples/torch_tensor_parallel.py                       # over an mpi4py comm
    torchrun --nproc-per-node 4 examples/torch_tensor_parallel.py              # over a gloo group
    python examples/torch_tensor_parallel.py --reference                       # one process, whole model

The model (float64, Megatron-style by hand): two residual blocks, each a
LayerNorm, a column-parallel linear (the rows of its weight and its bias cut
over the ranks), GELU, and a row-parallel linear (the columns of its weight
cut; an all-reduce sums the ranks' partial outputs, then its bias, whole on
every rank, is added); then a linear head that every rank holds whole. The two
all-reduces are tiny autograd functions over the communicator the job has:
mpi4py under mpirun, torch.distributed (gloo) under torchrun.

What gclip is told: every rank passes its own parameters; the shards count
where they are, and what every rank holds whole (the layer norms, the
row-parallel biases, the head) is marked replicated=True, so it counts once.
One all-reduce of the header, the same scale on every rank.

The check: rank 0 then trains the same model in one process (full weights,
torch's get_total_norm and the exact scale min(1, max_norm / norm), i.e.
clip_grad_norm_ without its + 1e-6) and compares the losses of every step: they
agree within 1e-6 relative (in float64, to ~1e-15: what is left is the order of
the sums). ``--mode per-rank`` clips with a bug of the gallery instead, to see
the losses part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import gclip.gallery.torch as gallery_torch
import gclip.torch as gt

D, H, OUT, BATCH = 16, 32, 4, 64  # model width, hidden width (cut over the ranks), outputs, batch
SHARDED = ("w1", "b1", "w2")  # parameter names cut over the ranks; every other one is whole everywhere


class Comm:
    """The one collective the layers need (a SUM all-reduce in place), and gclip's comm."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "mpi":
            from mpi4py import MPI

            self.mpi, self.gclip = MPI, MPI.COMM_WORLD
            self.rank, self.size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        elif kind == "gloo":
            import torch.distributed as dist

            dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR...
            self.dist, self.gclip = dist, dist.group.WORLD
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:  # the single-process reference
            self.gclip, self.rank, self.size = None, 0, 1

    def close(self) -> None:
        """End the gloo group on every rank together: a rank leaving while its group's
        threads still run can abort the process at exit ("terminate called ...")."""
        if self.kind == "gloo":
            self.dist.barrier()
            self.dist.destroy_process_group()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.kind == "mpi":
            self.gclip.Allreduce(self.mpi.IN_PLACE, t.numpy())
        elif self.kind == "gloo":
            self.dist.all_reduce(t)
        return t


class CopyToRanks(torch.autograd.Function):
    """Forward: the input as it is (every rank has it); backward: the ranks' input gradients summed."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce_(grad.clone(memory_format=torch.contiguous_format)), None


class SumOverRanks(torch.autograd.Function):
    """Forward: the ranks' partial outputs summed; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce_(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Block(torch.nn.Module):
    def __init__(self, full: dict, comm: Comm) -> None:
        super().__init__()
        mine = slice(comm.rank * H // comm.size, (comm.rank + 1) * H // comm.size)
        self.comm = comm
        self.norm = torch.nn.LayerNorm(D, dtype=torch.float64)
        with torch.no_grad():
            self.norm.weight.copy_(full["norm_w"])
            self.norm.bias.copy_(full["norm_b"])
        self.w1 = torch.nn.Parameter(full["w1"][mine].clone())  # column-parallel: my rows
        self.b1 = torch.nn.Parameter(full["b1"][mine].clone())
        self.w2 = torch.nn.Parameter(full["w2"][:, mine].clone())  # row-parallel: my columns
        self.b2 = torch.nn.Parameter(full["b2"].clone())  # whole on every rank

    def forward(self, x):
        h = F.gelu(F.linear(CopyToRanks.apply(self.norm(x), self.comm), self.w1, self.b1))
        return x + SumOverRanks.apply(F.linear(h, self.w2), self.comm) + self.b2


class Model(torch.nn.Module):
    def __init__(self, comm: Comm, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

        blocks = []
        for _ in range(2):  # the full weights, the same on every rank; each keeps its part
            full = {
                "norm_w": 1 + randn(D, scale=0.1),
                "norm_b": randn(D, scale=0.1),
                "w1": randn(H, D, scale=D**-0.5),
                "b1": randn(H, scale=0.1),
                "w2": randn(D, H, scale=H**-0.5),
                "b2": randn(D, scale=0.1),
            }
            blocks.append(Block(full, comm))
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = torch.nn.Linear(D, OUT, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(randn(OUT, D, scale=D**-0.5))
            self.head.bias.zero_()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank: a smooth target with a large gradient early on."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    teacher = torch.Generator().manual_seed(7)
    a = torch.randn(D, OUT, generator=teacher, dtype=torch.float64)
    return x, 3 * torch.sin(x @ a)


def exact_clip_(parameters: list, max_norm: float) -> float:
    """torch's clip_grad_norm_ with the exact scale (no + 1e-6): the reference."""
    grads = [p.grad for p in parameters]
    norm = torch.nn.utils.get_total_norm(grads).item()
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g.mul_(scale)
    return norm


def train(comm: Comm, steps: int, max_norm: float, lr: float, mode: str = "global") -> dict:
    torch.manual_seed(0)
    model = Model(comm)
    params = list(model.parameters())
    replicated = [not name.endswith(SHARDED) for name, _ in model.named_parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if comm.kind == "reference":
            norm = exact_clip_(params, max_norm)
        elif mode == "global":
            norm = gt.clip_grad_norm_(params, max_norm, comm=comm.gclip, replicated=replicated)
        else:  # a bug of the lab's gallery, installed through the engine's hook
            norm = gallery_torch.clip_grad_norm_(
                params, max_norm, comm=comm.gclip, replicated=replicated, mode=mode
            )
        opt.step()
        losses.append(loss.item())
        norms.append(float(norm))
    return {"losses": losses, "norms": norms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comm", choices=["auto", "mpi", "gloo"], default="auto")
    ap.add_argument("--reference", action="store_true", help="train the whole model in this process only")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--mode", default="global", help="a gallery bug to clip with instead (e.g. per-rank)")
    ap.add_argument("--json", action="store_true", help="print one JSON line (rank 0)")
    args = ap.parse_args(argv)

    kind = "reference" if args.reference else args.comm
    if kind == "auto":  # torchrun sets RANK and WORLD_SIZE; mpirun does not
        kind = "gloo" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "mpi"
    comm = Comm(kind)
    if H % comm.size:
        print(f"the hidden width {H} must divide over the {comm.size} ranks", file=sys.stderr)
        return 2
    run = train(comm, args.steps, args.max_norm, args.lr, args.mode)
    comm.close()
    if comm.rank != 0:
        return 0
    reference = run if kind == "reference" else train(Comm("reference"), args.steps, args.max_norm, args.lr)
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    clipped = sum(n > args.max_norm for n in run["norms"])
    report = {"comm": kind, "ranks": comm.size, "mode": args.mode, "max_rel_diff": worst, **run}
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{kind} on {comm.size} rank(s), clip mode {args.mode}: {args.steps} steps, clipped on {clipped}"
        )
        print(f"loss {run['losses'][0]:.6f} -> {run['losses'][-1]:.6f}")
        verdict = "matches" if worst <= 1e-6 else "DIFFERS from"
        print(f"the loss {verdict} the single-process reference: max relative difference {worst:.3g}")
    return 0 if worst <= 1e-6 or args.mode != "global" else 1


if __name__ == "__main__":
    sys.exit(main())
