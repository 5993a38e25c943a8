"""torch.compile(fullgraph=True) of gclip.torch's clip in an FSDP2 job (run by test_torch_device.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/torch_compile_check.py OUTDIR

On 2 ranks (gloo), a model under FSDP2 runs one backward; its gradients are kept. The clip
``gclip.torch.clip_grad_norm_(model.parameters(), limit)`` then runs on copies of them:
eagerly on the device path (``gclip.torch._device.FORCE``), compiled with ``aot_eager`` and with
inductor (``fullgraph=True``), and counted by ``torch._dynamo.explain``. Each rank writes
OUTDIR/rank<R>.json: the norms, whether each compiled run's gradients equal the eager run's
bit for bit, the graph and break counts, and the fsum oracle over ``full_tensor()``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import gclip.torch as gt
import gclip.torch._device as device_path
from torch_jobs import watchdog
from torch_layouts_check import Net, batch, full, gathered_norm, loss_of


def main(outdir: str) -> None:
    watchdog()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    loss_of(model(batch(rank))).backward()
    params = list(model.parameters())
    grads = [p.grad.to_local().clone() for p in params]
    oracle = gathered_norm([full(p.grad) for p in params], rank == 0)
    limit = oracle / 3

    def reset() -> None:
        for p, g in zip(params, grads):
            p.grad.to_local().copy_(g)

    def clip() -> torch.Tensor:
        return gt.clip_grad_norm_(model.parameters(), limit)

    report: dict = {"rank": rank, "oracle": oracle}
    reset()
    report["host"] = clip().item()
    device_path.FORCE = True
    reset()
    report["eager"] = clip().item()
    eager = [p.grad.to_local().clone() for p in params]
    device_path.FORCE = False  # compiled: the device path by itself
    for backend in ("aot_eager", "inductor"):
        reset()
        torch._dynamo.reset()
        try:
            report[backend] = torch.compile(clip, backend=backend, fullgraph=True)().item()
        except Exception as exc:  # noqa: BLE001 - reported
            report[backend] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        report[f"{backend}_same_grads"] = all(
            torch.equal(a, p.grad.to_local()) for a, p in zip(eager, params)
        )
    reset()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(clip)()
    report["graphs"], report["breaks"] = explained.graph_count, explained.graph_break_count
    report["reasons"] = [
        f"{' '.join(str(b.reason).split())[:200]} @ {Path(b.user_stack[-1].filename).name}:"
        f"{b.user_stack[-1].lineno}"
        for b in explained.break_reasons
        if b.user_stack
    ]
    dist.barrier()
    dist.destroy_process_group()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
