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
from pathlib import Path

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

def by_attributes(grads, max_norm, comm, mesh, replicated):
    # as Megatron-LM chooses: not shared, and sharded over tp or on tp rank 0 (no replicated=)
    tp_rank = mesh.coords.get("tp", 0)
    local = sum(
        float(np.sum(np.square(g, dtype=np.float64)))
        for g in grads
        if not getattr(g, "shared", False) and (g.tensor_model_parallel or tp_rank == 0)
    )
    _apply(grads, max_norm, comm.allreduce(local) ** 0.5)

def by_names(grads, max_norm, comm, mesh, replicated):
    # by the tensors' names: layer norms once per tp group, the tied embedding on the first stage
    first, tp0 = mesh.coords.get("pp", 0) == 0, mesh.coords.get("tp", 0) == 0
    def counted(g):
        if g.name == "embed":
            return first
        return tp0 or not g.name.endswith(("ln1", "ln2", "final_ln"))
    local = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads if counted(g))
    _apply(grads, max_norm, comm.allreduce(local) ** 0.5)

def ignores_shared(grads, max_norm, comm, mesh, replicated):
    tp_rank = mesh.coords.get("tp", 0)
    local = sum(
        float(np.sum(np.square(g, dtype=np.float64)))
        for g in grads
        if g.tensor_model_parallel or tp_rank == 0
    )
    _apply(grads, max_norm, comm.allreduce(local) ** 0.5)
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


@pytest.mark.parametrize("func", ["by_attributes", "by_names"])
def test_layout_arrays_carry_their_names_and_megatron_attributes(tmp_path, func):
    # counting by the attributes (or the names) alone, never replicated=, is right on every case
    code, out = judge(tmp_path, LAYOUT, func, *LAYOUT_ARGS)
    assert code == 0 and out["checks"] == 6 + 1 + 3


def test_layout_attributes_without_the_shared_filter_count_the_tied_embedding_twice(tmp_path):
    code, out = judge(tmp_path, LAYOUT, "ignores_shared", *LAYOUT_ARGS)
    assert code == 1 and out["fingerprint"] == "tied-counted-twice"


# ---------------------------------------------------------------------------
# --layout --torch: Megatron-LM's optimizer clip (tests/corpus), and the same with a filter dropped

MEGATRON = Path(__file__).resolve().parent / "corpus" / "megatron_optimizer_layout.py"
TORCH_LAYOUT_ARGS = ("--layout", "pp=2,tp=2", "--torch", "--random", "3", "--timeout", "30")
MEGATRON_FAMILY = ("--dtype", "float32", "--positive-max-norm")  # it asserts float32; 0 is "off"


def _megatron(tmp_path, replace: tuple[str, str] | None = None) -> str:
    """Megatron-LM's clip (the corpus file, beside its clip_grads transcription), a line replaced."""
    source = MEGATRON.read_text()
    if replace is not None:
        assert replace[0] in source
        source = source.replace(*replace)
    (tmp_path / "megatron_clip_grads.py").write_text((MEGATRON.parent / "megatron_clip_grads.py").read_text())
    return source


@pytest.mark.parametrize(
    "replace,bug",
    [
        (None, None),
        (("param_is_not_tensor_parallel_duplicate(param, layout)", "True"), "tp-duplicates-summed"),
        (("is_not_shared = param_is_not_shared(param)", "is_not_shared = True"), "tied-counted-twice"),
    ],
    ids=["as-is", "no-tp-duplicate-filter", "no-shared-filter"],
)
def test_torch_layout_megatron_clip_is_graded_by_its_filters(tmp_path, replace, bug):
    code, out = judge(tmp_path, _megatron(tmp_path, replace), "clip", *TORCH_LAYOUT_ARGS, *MEGATRON_FAMILY)
    assert out["mode"] == "torch-layout" and out["ranks"] == 4 and out["stopped"] is None
    if bug is None:  # float32 and the epsilon of a norm of hundreds: within float32's tolerance
        assert code == 0 and out["grade"] == "pass" and out["checks"] == 3 + 3
        return
    assert code == 1 and out["grade"] == "fail" and out["fingerprint"] == bug


def test_torch_layout_a_family_that_raises_is_reported_and_the_others_judged(tmp_path):
    # Megatron-LM asserts float32 gradients: every float64 case raises on every rank
    code, out = judge(tmp_path, _megatron(tmp_path), "clip", *TORCH_LAYOUT_ARGS, "--positive-max-norm")
    assert code == 1 and out["stopped"] is None
    rows = {line.split("  ")[0]: line for line in out["families"]}
    assert rows["float64"].endswith("raised on every case")
    float32 = [f for f in out["failures"] if "float32" in f["check"]]
    passed, _, run, _ = rows["float32"].split()[-4:]
    assert float32 == [] and passed == run and int(run) >= 2
    assert all(" raised AssertionError" in f["reason"] for f in out["failures"])  # float64, all
    assert rows["float64, a rank with nothing"].endswith("raised on every case")  # the frozen stage


def test_torch_layout_hands_each_parameter_its_attributes_and_the_groups(tmp_path):
    # the function fails a case (raises) when what it is handed is not what the mesh says
    source = """
import torch
import torch.distributed as dist

def clip(parameters, max_norm, layout):
    names = [n for n, _ in layout.named_parameters()]
    assert [p.param_name for p in parameters] == names
    stage, tp = layout.coords["pp"], layout.coords["tp"]
    assert layout.get_tensor_model_parallel_rank() == tp
    assert layout.get_pipeline_model_parallel_rank() == stage
    assert dist.get_world_size(layout.get_model_parallel_group()) == 4
    assert dist.get_world_size(layout.get_data_parallel_group()) == 1
    ranks = dist.get_process_group_ranks
    assert ranks(layout.get_tensor_model_parallel_group()) == [2 * stage, 2 * stage + 1]
    assert ranks(layout.get_pipeline_model_parallel_group()) == [tp, tp + 2]
    for n, p in layout.named_parameters():
        duplicate = n.endswith(("ln1", "ln2", "final_ln"))
        assert p.tensor_model_parallel is not duplicate, n
        assert p.partition_dim == (-1 if duplicate else 1 if n.endswith(("proj", "fc2")) else 0), n
        assert getattr(p, "shared", False) is (n == "embed" and stage == 1), n
        assert p.allreduce is True, n
    if parameters:
        assert ("embed" in names) and (("final_ln" in names) is (stage == 1))
    total = torch.zeros(1, dtype=torch.float64)
    for p in parameters:
        if (p.tensor_model_parallel or tp == 0) and not getattr(p, "shared", False):
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total)
    norm = total.sqrt().item()
    for p in parameters:
        p.grad.mul_(min(1.0, max_norm / norm) if norm > 0 else 1.0)
"""
    code, out = judge(tmp_path, source, "clip", *TORCH_LAYOUT_ARGS)
    assert code == 0 and out["checks"] == 6 + 1 + 3, [f["reason"] for f in out["failures"]][:2]


def test_torch_layout_with_a_numpy_layout_function_is_a_usage_error(tmp_path):
    path = tmp_path / "impl.py"
    path.write_text(textwrap.dedent(LAYOUT))
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:good", "--layout", "pp=2", "--torch"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert "good takes 5 positional arguments, not the 3 of (parameters, max_norm, layout)" in line
    assert line.endswith(f"run python -m gclip.conformance {path}:good --layout dp=2")
