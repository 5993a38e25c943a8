"""HF accelerate's clip, in the loop its docs write; gclip.audit runs this unmodified.

    torchrun --nproc-per-node 4 fw_accelerate.py --layout ddp|fsdp2|tp|fsdp-tp [--clip accelerate|gclip]

ddp: ``accelerator.prepare`` wraps the model (DDP, gloo). On the CPU accelerate ignores its
FSDP plugin (its state chooses FSDP only for accelerator devices) and has no TP there, so the
other layouts are made with torch's APIs (layouts.py) and ``accelerator.clip_grad_norm_`` runs
its DTensor-aware path on them, as it does under FSDP2 and TP.

--clip accelerate: ``accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)``;
--clip gclip: ``gclip.torch.clip_grad_norm_`` in its place (docs/frameworks.md).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from layouts import LAYOUTS, MAX_NORM, data, lay_out, net
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="ddp", choices=LAYOUTS)
    parser.add_argument("--clip", default="accelerate", choices=["accelerate", "gclip"])
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    model = net()
    if args.layout == "ddp":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model = lay_out(model, args.layout)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(args.layout)
    for _ in range(2):
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        if args.clip == "accelerate":
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            from gclip.torch import clip_grad_norm_

            # DDP's gradients and the plain ones TP leaves alone are copies on every rank
            replicated = True if args.layout in ("ddp", "tp") else None
            clip_grad_norm_(model.parameters(), MAX_NORM, replicated=replicated)
        optimizer.step()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
