"""gclip.torch's adaptive clippers on PyTorch's layouts (run by test_adaptive_layouts.py).

    python -m torch.distributed.run --nproc-per-node 4 tests/torch_adaptive_check.py LAYOUT OUTDIR [STATE]

LAYOUT is one of fsdp, hsdp, tp, pp_fsdp (the model of tests/torch_layouts_check.py).
One backward, then STEPS steps in which every gradient is the backward's times a factor
f_t, the same on every rank (log-normal, with spikes of 10-80x). On each step:

- ZClip and AutoClip (``reproducible=True``) clip the layout's gradients, and the same
  clippers clip the whole model's full gradients on ONE process (a one-rank group of its
  own, plain tensors): both runs' limits are recorded, to be equal bit for bit;
- the oracle's norm: math.fsum over the squares of the full gradients, for the test's
  transcription of the reference rules;
- AGC clips the layout's gradients and, on one process, the full parameters' and
  gradients'; the full clipped gradients are recorded for the test to compare.

ZClip also runs without ``reproducible`` (its limits, within 1e-12 relative of one process's).
With STATE (a file or a torch.distributed.checkpoint directory a previous job wrote), the
ZClips start from it: a state saved on one layout continues on another. Rank 0 writes
OUTDIR/zclip_state.pt (the final state), every rank takes part in OUTDIR/zclip_dcp (the same
state through DCP) and writes OUTDIR/rank<R>.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import gclip.torch as gt
from torch_jobs import run_case
from torch_layouts_check import COMM, build, full

STEPS = 100


def factors() -> list[float]:
    g = torch.Generator().manual_seed(11)
    f = torch.exp(torch.randn(STEPS, generator=g, dtype=torch.float64) * 0.2)
    spikes = torch.randperm(STEPS - 30, generator=g)[:10] + 30
    f[spikes] *= 10 + 70 * torch.rand(10, generator=g, dtype=torch.float64)
    return f.tolist()


def whole_model(pieces: list, leader: bool) -> list[torch.Tensor]:
    """Every rank gets the whole model's tensors, each once (one rank per stage gives its stage's)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, [t.float() for t in pieces] if leader else [])
    return [t for theirs in every for t in theirs]


def limit_of(clipper) -> float:
    limit = getattr(clipper, "last_limit", None)
    return float(limit) if limit is not None else math.nan


def group_norms(params: list, leader: bool, groups: list[range]) -> list[float]:
    """math.fsum's norm of each group's full gradients, every tensor once."""
    every: list = [None] * dist.get_world_size()
    fulls = [full(p.grad) for p in params]  # a collective over each DTensor's mesh: on every rank
    mine = [[float(x) ** 2 for i in g for x in fulls[i].tolist()] for g in groups] if leader else []
    dist.all_gather_object(every, mine)
    return [
        math.sqrt(math.fsum(x for theirs in every if theirs for x in theirs[k])) for k in range(len(groups))
    ]


def per_group(params: list, leader: bool, declared, on: dict) -> dict:
    """clip_groups_ over two groups (the first clipped to a third of its norm, the second
    reported), its all-reduces counted."""
    groups = [range(len(params) // 2), range(len(params) // 2, len(params))]
    before = group_norms(params, leader, groups)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        norms = gt.clip_groups_(
            [[params[i] for i in g] for g in groups], [before[0] / 3, None], replicated=declared, **on
        )
    finally:
        dist.all_reduce = real
    return {
        "oracle": before,
        "norms": norms.tolist(),
        "after": group_norms(params, leader, groups),
        "all_reduces": len(calls),
    }


def load(state: str) -> dict:
    """A ZClip state from torch.save's file, or from a torch.distributed.checkpoint directory
    (loaded in place into a template of the state's shape, on every rank)."""
    if not Path(state).is_dir():
        return torch.load(state)
    zero = torch.zeros((), dtype=torch.float64)
    template = {"zclip": {"step": 0, "warmup": [], "mean": zero.clone(), "var": zero.clone()}}
    dcp.load(template, checkpoint_id=state)
    return template["zclip"]


def case(outdir: str, layout: str, state: str | None = None) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    selves = [dist.new_group([r]) for r in range(size)]  # every rank makes every group
    alone = selves[rank]
    model, leader, backward = build(layout, rank)
    backward()
    params = [p for p in model.parameters() if p.grad is not None]
    base = [p.grad.detach().clone() for p in params]
    declared = {"tp": True}.get(layout)  # TP leaves embed, norms and head plain: copies on every rank
    # pipeline stages are named by the DeviceMesh given as comm= (torch's recorded root may be stale)
    on = {"comm": COMM[layout]} if layout in COMM else {}
    weights_full = whole_model([full(p.data).reshape(p.shape) for p in params], leader)
    base_full = whole_model([full(b).reshape(p.shape) for p, b in zip(params, base)], leader)

    report: dict = {
        "rank": rank,
        "layout": layout,
        "steps": [],
        "groups": per_group(params, leader, declared, on),
    }
    for p, b in zip(params, base):
        p.grad.copy_(b)
    zclip, zclip_one = gt.ZClip(max_grad_norm=None), gt.ZClip(max_grad_norm=None)
    fast, fast_one = gt.ZClip(max_grad_norm=None), gt.ZClip(max_grad_norm=None)  # reproducible=False
    if state:
        saved = load(state)
        report["loaded"] = {k: float(saved[k]) for k in ("step", "mean", "var")}
        for clipper in (zclip, zclip_one, fast, fast_one):
            clipper.load_state_dict(saved)
    auto, auto_one = gt.AutoClip(20.0), gt.AutoClip(20.0)
    agc, agc_one = gt.AGC(0.05), gt.AGC(0.05)
    for f in factors():
        row: dict = {}
        for name, ours, one in (
            ("zclip", zclip, zclip_one),
            ("autoclip", auto, auto_one),
            ("agc", agc, agc_one),
        ):
            for p, b in zip(params, base):
                p.grad.copy_(b * f)
            grads_full = [g * f for g in base_full]  # elementwise, rounded as the layout's pieces are
            if name == "zclip":
                row["oracle"] = math.sqrt(
                    math.fsum(float(x) ** 2 for g in grads_full for x in g.double().reshape(-1))
                )
            alone_params = [torch.nn.Parameter(w.clone()) for w in weights_full]
            for q, g in zip(alone_params, grads_full):
                q.grad = g.clone()
            if name == "agc":
                ours.step(model)
                one.step(alone_params)
                after = whole_model([full(p.grad).reshape(p.shape) for p in params], leader)
                row["agc_layout"] = [x for g in after for x in g.double().reshape(-1).tolist()]
                row["agc_one"] = [x for q in alone_params for x in q.grad.double().reshape(-1).tolist()]
                row["agc_changed"] = sum(int((q.grad != g).sum()) for q, g in zip(alone_params, grads_full))
                continue
            norm = ours.step(model, replicated=declared, reproducible=True, **on)
            norm_one = one.step(alone_params, comm=alone, reproducible=True)
            row[name] = {"norm": float(norm), "norm_one": float(norm_one)}
            if name == "zclip":
                row[name].update(limit=limit_of(ours), limit_one=limit_of(one))
                for p, b in zip(params, base):  # the same step, not reproducible: within rounding
                    p.grad.copy_(b * f)
                for q, g in zip(alone_params, grads_full):
                    q.grad = g.clone()
                row["zclip_fast"] = {
                    "norm": float(fast.step(model, replicated=declared, **on)),
                    "norm_one": float(fast_one.step(alone_params, comm=alone)),
                    "limit": limit_of(fast),
                    "limit_one": limit_of(fast_one),
                }
            else:
                live = ours._window()
                live_one = one._window()
                row[name].update(
                    limit=float(torch.nanquantile(live, 0.2)),
                    limit_one=float(torch.nanquantile(live_one, 0.2)),
                )
        report["steps"].append(row)
    report["mean"], report["var"] = float(zclip.rule.mean), float(zclip.rule.var)
    report["mean_one"], report["var_one"] = float(zclip_one.rule.mean), float(zclip_one.rule.var)
    if rank == 0:
        torch.save(zclip.state_dict(), Path(outdir, "zclip_state.pt"))
    # the same state through torch.distributed.checkpoint: every rank holds it (replicated)
    dcp.save({"zclip": zclip.state_dict()}, checkpoint_id=Path(outdir, "zclip_dcp"))
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    layout, outdir, *state = sys.argv[1:]
    run_case(case, outdir, layout, *state)
