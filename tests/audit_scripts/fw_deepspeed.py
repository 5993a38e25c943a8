"""DeepSpeed's ZeRO 1/2/3 on its CPU accelerator (gloo), its clip audited from the update.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 fw_deepspeed.py --stage 0|1|2|3 [...] [--json FILE]

``gradient_clipping`` in the config: the ZeRO optimizer clips its own flat partitions
inside ``engine.step()``, where no hook sees the gradients (gclip.audit.update). So the
engine steps plain SGD (lr 1, no momentum, no weight decay, a client optimizer), and each
step is read from the update: the parameters before and after it (gathered under ZeRO-3)
against the reference, the gradients the same batches give a plain copy of the model,
averaged over the ranks as DeepSpeed averages them. Prints the audit's report on rank 0
and writes one JSON object per step (``--json``); exits 1 if a step failed.

DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel
(``deepspeed_shm_comm``) when it starts, minutes of a C++ build; training's gradient
all-reduce does not use it (gloo does), so this script builds none.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.comm.torch  # the module (deepspeed.comm's attribute `torch` is torch itself)
import torch
import torch.distributed as dist
from layouts import MAX_NORM, data, net
from torch import nn

from gclip.audit.update import grade_update

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the kernel above: not built, not used


def full_values(engine: deepspeed.DeepSpeedEngine, stage: int) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if stage < 3:
        return [p.detach().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return [p.detach().clone() for p in params]


def reference_grads(model: nn.Module, values: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list:
    """The gradients of this batch at these values, averaged over the ranks (DeepSpeed's mean)."""
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def audit_stage(stage: int, out) -> int:
    """Two steps of ZeRO-``stage``, each graded from its update; how many failed."""
    model = net()
    plain = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's SGD: DeepSpeed tests Adam-like ones
    }
    sgd = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=config)
    x, y = data("ddp")
    failed = 0
    for step in range(2):
        before = full_values(engine, stage)
        reference = reference_grads(plain, before, x, y)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        after = full_values(engine, stage)
        holds = f"{len(before)} tensors under ZeRO-{stage} (read from the update)"
        report = grade_update(reference, before, after, lr=1.0, max_norm=MAX_NORM, step=step, holds=holds)
        failed += report.grade == "fail"
        if dist.get_rank() == 0:
            print(report, flush=True)
            if out is not None:
                out.write(json.dumps({**report.as_json(), "zero_stage": stage}) + "\n")
    engine.destroy()
    return failed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, nargs="+", default=[1], choices=[0, 1, 2, 3])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    out = open(args.json, "w") if args.json and dist.get_rank() == 0 else None
    failed = sum(audit_stage(stage, out) for stage in args.stage)
    if out is not None:
        out.close()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
