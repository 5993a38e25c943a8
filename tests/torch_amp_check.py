"""The AMP loop on HSDP (2 x 2) or FSDP2 (4) when one rank's shard holds an inf
(run by test_torch_layouts.py).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_amp_check.py RECIPE OUTDIR [LAYOUT]

RECIPE ``standard``: torch's loop (``unscale_``, the clip, ``scaler.step``, ``update``) with
``scaler=scaler`` given to gclip's clip; ``agreed``: the manual branch on gclip's norm;
``local``: torch's loop with gclip's clip unaware of the scaler, where ``scaler.step``
decides from this rank's own gradients. LAYOUT: ``hsdp`` (the default) or ``fsdp``.
After one step with an inf injected into
rank 0's shard, each rank writes OUTDIR/rank<R>.json: whether its weights moved,
its scale, and whether its shard equals its replica's (rank r and r + 2 hold the
same shard), and what gclip.torch.check_replicas says of the parameters.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gclip.torch as gt
from torch_jobs import run_case
from torch_layouts_check import Net, batch, loss_of


def case(outdir: str, recipe: str, layout: str = "hsdp") -> None:
    rank = dist.get_rank()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    scaler.scale(loss_of(model(batch(rank)))).backward()
    if rank == 0:
        model.blocks[0].up.weight.grad.to_local().view(-1)[0] = math.inf  # an overflow in one shard
    scaler.unscale_(opt)
    norm = gt.clip_grad_norm_(model.parameters(), 1.0, scaler=scaler if recipe == "standard" else None)
    if recipe == "agreed":  # docs/torch.md: every rank decides from the same global norm
        if torch.isfinite(norm):
            scaler.step(opt)
            scaler.update()
        else:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
    else:  # scaler.step decides from this rank's own gradients
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    mine = [p.detach().to_local() for p in model.parameters()]
    moved = any(not torch.equal(a, b) for a, b in zip(mine, before))
    peer = (rank + 2) % 4 if layout == "hsdp" else rank  # the same shard on the other replica
    theirs: list = [None] * 4
    dist.all_gather_object(theirs, [t.tolist() for t in mine])
    report = {
        "rank": rank,
        "norm": norm.item(),
        "stepped": moved,
        "scale": scaler.get_scale(),
        "same_as_replica": theirs[rank] == theirs[peer],
    }
    try:  # are the replicas still identical? (every rank raises the same error if not)
        gt.check_replicas(model.parameters())
        report["check_replicas"] = ""
    except Exception as exc:  # noqa: BLE001 - reported
        report["check_replicas"] = f"{type(exc).__name__}: {exc}"
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    recipe, outdir, *layout = sys.argv[1:]
    run_case(case, outdir, recipe, *layout)
