"""Bench: gclip.torch on FSDP2 with GPT-2 small's shapes, against torch's own DTensor clip.

    torchrun --nproc-per-node 4 -m gclip.bench.fsdp [--layers 12] [--repeat 15] [--json]

The model is GPT-2 small's parameter shapes (vocabulary 50257, 1024 positions,
width 768; per layer two LayerNorms, c_attn 768 x 2304, c_proj 768 x 768, the
MLP's 768 x 3072 and 3072 x 768, with biases), ``--layers`` of its 12 blocks
(fewer to fit a small machine: the embedding, 39M of GPT-2's 124M values, is
always there). Built on the meta device, sharded by FSDP2's ``fully_shard``
per block and for the whole model over every process, then materialised
(each rank holds its shards only); every gradient is a random DTensor shaped
like its parameter.

Rows, each timed as the bench times (``timing.time_reps``: after a barrier,
rotating order, the slowest rank per rep, the median over reps):

- ``gclip``: ``gclip.torch.clip_grad_norm_(model.parameters(), max_norm)``;
- ``torch``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
  (right on FSDP2: its norm is a DTensor reduced over the mesh), with
  ``.full_tensor()`` so the norm is known on every rank, as gclip's is.

max_norm is far above the norm: both only read (the scale is 1). Prints the
medians and ``gclip / torch``; ``--json`` one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

VOCAB, POSITIONS, WIDTH = 50257, 1024, 768


def _model(layers: int) -> Any:
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.c_attn, self.attn_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.c_fc, self.mlp_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    class GPT2Shapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(POSITIONS, WIDTH)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(WIDTH)

    return GPT2Shapes()


class _Barrier:
    """What timing.time_reps needs of a communicator."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist

    def Barrier(self) -> None:
        self.dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun -m gclip.bench.fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 small's blocks to keep (of 12)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gclip.torch as gt

    from .timing import slowest_rank_medians, time_reps

    if "RANK" not in os.environ:
        print(
            "gclip.bench.fsdp: launch it with torchrun --nproc-per-node N -m gclip.bench.fsdp",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = _model(args.layers)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(dist.get_rank())
    values = 0
    for p in model.parameters():
        local = p.to_local()
        p.grad = torch.distributed.tensor.DTensor.from_local(
            torch.randn(local.shape, generator=gen) * 1e-3,
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
        values += p.numel()
    limit = 1e9

    def gclip() -> None:
        gt.clip_grad_norm_(model.parameters(), limit)

    def torch_clip() -> None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        getattr(norm, "full_tensor", lambda: norm)()  # the norm known on every rank, as gclip's is

    ours = gt.get_total_norm([p.grad for p in model.parameters()]).item()
    theirs_norm: Any = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])  # a DTensor
    theirs = theirs_norm.full_tensor().item()
    times = time_reps(_Barrier(dist), [("gclip", gclip), ("torch", torch_clip)], args.repeat)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    rows = slowest_rank_medians(every)
    out = {
        "bench": "fsdp2-gpt2-small-shapes",
        "ranks": dist.get_world_size(),
        "layers": args.layers,
        "values": values,
        "norm_gclip": ours,
        "norm_torch": theirs,
        "gclip_median_s": rows["gclip"]["median_s"],
        "torch_median_s": rows["torch"]["median_s"],
        "gclip_vs_torch": rows["gclip"]["median_s"] / rows["torch"]["median_s"],
        "reps": args.repeat,
    }
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(out))
        else:
            print(
                f"FSDP2, GPT-2 small's shapes ({args.layers} of 12 blocks, {values / 1e6:.1f}M values) "
                f"on {out['ranks']} ranks: gclip {out['gclip_median_s'] * 1e3:.2f} ms, "
                f"torch {out['torch_median_s'] * 1e3:.2f} ms, gclip / torch {out['gclip_vs_torch']:.2f} "
                f"(norms {ours:.9g}, {theirs:.9g})"
            )
    dist.barrier()  # no rank tears its gloo pairs down while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
