"""gclip.testing.audit around the steps of a test's own loop (run by tests/test_audit.py).

    torchrun --nproc-per-node 4 block_audit.py OUT_DIR

FSDP2 on 4 ranks; two blocks: torch's clip (right on FSDP2) must pass, a per-rank clip must
raise AssertionError naming the bug, on every rank alike. Each rank writes what it saw.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gclip.testing


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # made before the block: found there
    torch.manual_seed(1 + rank)
    x, y = torch.randn(8, 6) * 4, torch.randn(8, 3)

    def step(clip) -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        clip()
        optimizer.step()

    def per_rank() -> None:
        local = [p.grad.to_local() for p in net.parameters()]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local])))
        for g in local:
            g.mul_(min(1.0, 0.2 / norm))

    seen = {}
    with gclip.testing.audit() as right:
        step(lambda: torch.nn.utils.clip_grad_norm_(net.parameters(), 0.2))
    seen["right"] = [r.as_json() for r in right.reports]
    try:
        with gclip.testing.audit(max_norm=0.2):
            step(per_rank)
            step(per_rank)
        seen["wrong"] = None
    except AssertionError as error:
        seen["wrong"] = str(error)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump(seen, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
