"""Clips with a scope of their own, gclip's or a wrong one, in a training step; gclip.audit runs this.

    torchrun --nproc-per-node 4 scoped_clip.py --layout tp --clip agc-gclip|agc-timm
    torchrun --nproc-per-node 4 scoped_clip.py --layout fsdp2 --clip groups-gclip|groups-global

- ``agc-gclip``: ``gclip.torch.AGC`` (the units' squares summed over the ranks that split them);
- ``agc-timm``: timm's ``adaptive_clip_grad`` (timm/utils/agc.py, transcribed in
  tests/test_adaptive_torch.py) on each rank's local slices, as a Megatron-style row-parallel
  Linear holds them: each slice clipped by its own part of the row's norms;
- ``groups-gclip``: ``gclip.torch.clip_groups_`` over two parameter groups, the matrices
  ("Muon's", not clipped) and the vectors (clipped to ``LIMIT``);
- ``groups-global``: one ``gclip.torch.clip_grad_norm_`` over every parameter at ``LIMIT``:
  the global norm right, its scope not.

Each step's loss is larger on the steps of ``SPIKES``, so that the limits bind there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from layouts import data, lay_out, net
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the reference's transcription
import gclip.torch as gclip_torch
from test_adaptive_torch import timm_adaptive_clip_grad

STEPS, SPIKES, LIMIT = 4, (1, 3), 0.05


class _Slice:
    """A parameter as a row-parallel framework holds it: the local tensor and its grad."""

    def __init__(self, p: torch.Tensor) -> None:
        local = p.to_local() if hasattr(p, "to_local") else p
        self.data, self.grad = local, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad

    def detach(self) -> torch.Tensor:
        return self.data.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="tp")
    parser.add_argument(
        "--clip", required=True, choices=["agc-gclip", "agc-timm", "groups-gclip", "groups-global"]
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = lay_out(net(), args.layout)
    x, y = data(args.layout)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() <= 1]}]
    optimizer = torch.optim.SGD(groups, lr=0.01)
    agc = gclip_torch.AGC(clipping=0.01)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) * (25.0 if step in SPIKES else 1.0)
        loss.backward()
        if args.clip == "agc-gclip":
            agc.step(params)
        elif args.clip == "agc-timm":
            timm_adaptive_clip_grad([_Slice(p) for p in params], clip_factor=0.01)
        elif args.clip == "groups-gclip":
            gclip_torch.clip_groups_(optimizer.param_groups, [None, LIMIT])
        else:
            gclip_torch.clip_grad_norm_(params, LIMIT)
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
