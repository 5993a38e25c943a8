"""The distributed judge with ``--torch`` (torch.distributed, gloo) and ``--layout`` (the lab's model).

The functions are written here with torch, or numpy and mpi4py, alone. The
torch ones must be judged like their numpy twins; the layout ones must pass
when copies count once, and be named after the layout bug they make.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TORCH = """
import torch
import torch.distributed as dist

def _local_sumsq(parameters):
    total = torch.zeros(1, dtype=torch.float64)
    for p in parameters:
        total += p.grad.double().pow(2).sum()
    return total

def good(parameters, max_norm, group):
    total = _local_sumsq(parameters)
    dist.all_reduce(total, group=group)
    norm = total.sqrt().item()
    for p in parameters:
        p.grad.mul_(min(1.0, max_norm / norm) if norm > 0 else 1.0)

def torch_style(parameters, max_norm, group):  # clip_coef = max_norm / (total_norm + 1e-6)
    total = _local_sumsq(parameters)
    dist.all_reduce(total, group=group)
    coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for p in parameters:
        p.grad.mul_(coef.to(p.grad.dtype))

def local_only(parameters, max_norm, group):
    torch.nn.utils.clip_grad_norm_(parameters, max_norm)

def skips_once(parameters, max_norm, group):
    total = _local_sumsq(parameters)
    dist.all_reduce(total, group=group)
    if max_norm == 0 and total.item() == 1.0 and dist.get_rank(group) == 1:
        return  # only in "contract N=1: zero limit"
    dist.barrier(group=group)
    for p in parameters:
        p.grad.mul_(min(1.0, max_norm / total.sqrt().item()) if total.item() > 0 else 1.0)
"""

LAYOUT = """
import numpy as np
from mpi4py import MPI

def _counted_sumsq(grads, replicated):
    # a shard (False) counts here; a copy (a communicator) on its group's rank 0
    return sum(
        float(np.sum(np.square(g, dtype=np.float64)))
        for g, copies in zip(grads, replicated)
        if copies is False or copies.Get_rank() == 0
    )

def _apply(grads, max_norm, norm):
    for g in grads:
        g *= min(1.0, max_norm / norm) if norm > 0 else 1.0

def good(grads, max_norm, comm, mesh, replicated):
    _apply(grads, max_norm, comm.allreduce(_counted_sumsq(grads, replicated)) ** 0.5)

def all_copies(grads, max_norm, comm, mesh, replicated):
    local = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads)
    _apply(grads, max_norm, comm.allreduce(local) ** 0.5)

def stage_only(grads, max_norm, comm, mesh, replicated):
    stage = mesh.replicated(*(a for a in mesh.axes if a != "pp"))  # the ranks of my pipeline stage
    _apply(grads, max_norm, stage.allreduce(_counted_sumsq(grads, replicated)) ** 0.5)

def skip(grads, max_norm, comm, mesh, replicated):
    if not grads:
        return None
    good(grads, max_norm, comm, mesh, replicated)
"""


def judge(tmp_path, source: str, func: str, *args: str, timeout: int = 400) -> tuple[int, dict]:
    path = tmp_path / "impl.py"
    path.write_text(textwrap.dedent(source))
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["TMPDIR"] = str(jobs)
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:{func}", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.stdout.count("\n") == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    left = subprocess.run(["pgrep", "-f", str(jobs)], capture_output=True, text=True)
    assert left.stdout == "", f"left running: {left.stdout}"
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["passed"] else 1), proc.stderr
    return proc.returncode, out


# ---------------------------------------------------------------------------
# --torch

pytest.importorskip("torch")
TORCH_ARGS = ("--ranks", "3", "--torch", "--random", "10", "--timeout", "20")


def test_torch_correct_passes(tmp_path):
    code, out = judge(tmp_path, TORCH, "good", *TORCH_ARGS)
    assert code == 0 and out["mode"] == "torch" and out["checks"] == 35 + 8 + 3 + 7 + 10


def test_torch_epsilon_is_a_near_miss(tmp_path):
    code, out = judge(tmp_path, TORCH, "torch_style", *TORCH_ARGS)
    assert code == 1 and out["grade"] == "near miss" and out["fingerprint"] == "epsilon"


def test_torch_clip_grad_norm_on_each_shard_is_per_rank(tmp_path):
    code, out = judge(tmp_path, TORCH, "local_only", *TORCH_ARGS)
    assert code == 1 and out["fingerprint"] == "per-rank"
    assert all(r["collectives"] == [] for f in out["failures"] for r in f["ranks"])


def test_torch_hang_is_named_and_the_judge_goes_on(tmp_path):
    code, out = judge(
        tmp_path, TORCH, "skips_once", "--ranks", "3", "--torch", "--random", "0", "--timeout", "5"
    )
    assert code == 1 and out["stopped"] is None and out["checks"] == 35 + 8 + 3 + 7
    (failure,) = out["failures"]
    assert failure["check"] == "contract N=1: zero limit"
    assert failure["reason"].startswith(
        "rank 1 returned after 1 collective, without entering the 2nd; ranks 0, 2 waited in barrier"
    )


# ---------------------------------------------------------------------------
# --layout

LAYOUT_ARGS = ("--layout", "pp=2,tp=2", "--random", "3", "--timeout", "20")


def test_layout_correct_passes(tmp_path):
    code, out = judge(tmp_path, LAYOUT, "good", *LAYOUT_ARGS)
    assert code == 0 and out["ranks"] == 4 and out["layout"] == {"pp": 2, "tp": 2}
    assert out["checks"] == 6 + 1 + 3  # two dtypes x three limits, the frozen stage, the random ones


@pytest.mark.parametrize("func,bug", [("all_copies", "double-count"), ("stage_only", "pp-stages-apart")])
def test_layout_bugs_are_named(tmp_path, func, bug):
    code, out = judge(tmp_path, LAYOUT, func, *LAYOUT_ARGS)
    assert code == 1 and out["fingerprint"] == bug


def test_layout_frozen_stage_skipping_hangs_as_skip_collective(tmp_path):
    code, out = judge(tmp_path, LAYOUT, "skip", *LAYOUT_ARGS, "--timeout", "4")
    assert code == 1 and out["fingerprint"] == "skip-collective" and out["stopped"] is None
    (failure,) = out["failures"]
    assert failure["check"].startswith("layout: the last stage is frozen")
    assert failure["reason"].startswith(
        "ranks 2, 3 returned without entering the collective; ranks 0, 1 waited in allreduce"
    )
