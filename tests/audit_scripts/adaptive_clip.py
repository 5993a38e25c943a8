"""An adaptive clip in a training step, gclip's or the reference's on the wrong norm; gclip.audit runs this.

    torchrun --nproc-per-node 4 adaptive_clip.py --layout fsdp2 --clip gclip|local|world [--cap X]

Every step clips with ZClip (warmup 5; the loss times 25 on steps 8 and 11, a spike):

- ``gclip``: ``gclip.torch.ZClip``, fed the global norm;
- ``local``: the reference's rule (bluorion-com/ZClip ``zclip.py``, transcribed in
  tests/unit/test_limits.py) on its non-distributed branch: the norm of this rank's own local
  gradients, which is what FSDP2 / DTensor gradients get there;
- ``world``: the same rule on its FSDP branch: the local sums of squares all-reduced over the
  whole default group (under HSDP the replicas are counted).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from layouts import data, lay_out, net
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the reference's transcription
import gclip.torch as gclip_torch
from unit.test_limits import ReferenceZClip

STEPS, WARMUP, SPIKES = 14, 5, (8, 11)


def local_sumsq(params: list) -> torch.Tensor:
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    return torch.stack([g.double().square().sum() for g in grads]).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="fsdp2")
    parser.add_argument("--clip", default="gclip", choices=["gclip", "local", "world"])
    parser.add_argument("--cap", type=float, default=None, help="ZClip's max_grad_norm (default none)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = lay_out(net(), args.layout)
    x, y = data(args.layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ours = gclip_torch.ZClip(warmup_steps=WARMUP, max_grad_norm=args.cap)
    reference = ReferenceZClip(warmup_steps=WARMUP, max_grad_norm=args.cap)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) * (25.0 if step in SPIKES else 1.0)
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if args.clip == "gclip":
            ours.step(params)
        else:
            sumsq = local_sumsq(params)
            if args.clip == "world":
                dist.all_reduce(sumsq)
            _, coef = reference.step(math.sqrt(float(sumsq)))
            for p in params:
                p.grad.mul_(coef)
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
