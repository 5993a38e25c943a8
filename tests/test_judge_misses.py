"""The judge's misses of issue 31, each judged as a user runs the command, and the gallery bugs they add.

The functions judged are written here with numpy and mpi4py alone (never gclip), each transcribing
the arithmetic of the thread or file it cites:

- torch before pytorch #149768's fix: ``max_norm / (total_norm + 1e-6)`` on a Partial norm DTensor
  adds 1e-6 to every rank's local norm before the reduction (``epsilon-per-rank``, a near miss);
- ColossalAI's HybridParallelNaiveOptimizer: squares summed in float64, each rank's total rounded once
  to float32 and all-reduced in float32, then torch's epsilon: the correct norm within the float32
  model, so the near miss ``epsilon``, on the ``--layout`` form too;
- DeepSpeed's fp16 optimizer before PR #5411, computed in float32 on the ``--layout`` form's float64
  arrays: ``tp-rank0-only`` through float32 rounding and the epsilon, as the ``--torch`` form names it.

The oracles are math.fsum over the cases' own values.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import mpirun

HEAD = """
import numpy as np
from mpi4py import MPI

def _sumsq(grads):
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
"""

# torch before #149768's fix: the Partial norm's local value + 1e-6 on each rank, then the reduction
EPSILON_PER_RANK = """
def clip(grads, max_norm, comm):
    mine = _sumsq(grads) ** 0.5 + 1e-6
    coef = min(1.0, max_norm / comm.allreduce(mine * mine, op=MPI.SUM) ** 0.5)
    return [g * coef for g in grads]
"""

# ColossalAI HybridParallelNaiveOptimizer._compute_grad_norm and _clip_grad_norm, in the layout form
COLOSSAL = """
def clip(grads, max_norm, comm, mesh, replicated):
    local = 0.0
    for g, copies in zip(grads, replicated):
        if copies is False or copies.Get_rank() == 0:
            local += _sumsq([g])
    total = np.float32(comm.allreduce(np.float32(local), op=MPI.SUM))  # rounded once, then float32
    norm = float(total) ** (1.0 / 2)
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g *= coef
"""

# DeepSpeed's fp16 optimizer before PR #5411, in float32: the flat gradient on tp-rank 0 only
DEEPSPEED_5411 = """
def clip(grads, max_norm, comm, mesh, replicated):
    flat = np.concatenate([np.ravel(g).astype(np.float32) for g in grads] or [np.zeros(0, np.float32)])
    mine = float(np.dot(flat, flat)) if mesh.coords.get("tp", 0) == 0 else 0.0
    norm = float(np.sqrt(np.float32(comm.allreduce(np.float32(mine), op=MPI.SUM))))
    coef = (norm + 1e-6) / max_norm
    scale = 1.0 / coef if coef > 1 else 1.0
    for g in grads:
        g *= scale
"""


def judge(tmp_path, code: str, *args: str) -> dict:
    path = tmp_path / "target.py"
    path.write_text(HEAD + textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--json", "--timeout", "30", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(proc.stdout)


def test_the_gallerys_epsilon_per_rank_is_the_p_norm_of_each_ranks_norm_plus_the_epsilon():
    from gclip.gallery import STRATEGIES, clip_simulated

    ranks = [[np.array([3e-6, 0.0])], [np.array([0.0, 4e-6]), np.array([1e-6])], []]
    out = clip_simulated([[a.copy() for a in r] for r in ranks], 1e-7, mode="epsilon-per-rank")
    own = [math.sqrt(math.fsum(float(v) ** 2 for a in r for v in a)) for r in ranks]
    want = 1e-7 / math.sqrt(math.fsum((n + 1e-6) ** 2 for n in own))  # the empty rank adds 1e-6 too
    assert [r.scale for r in out] == pytest.approx([want] * 3, rel=1e-12)
    once = 1e-7 / (math.sqrt(math.fsum(n * n for n in own)) + 1e-6)  # torch's epsilon, added once
    assert abs(want / once - 1) > 0.05  # far apart on tiny norms: the two are told apart
    bug = STRATEGIES["epsilon-per-rank"]
    assert "pytorch #149768" in bug.incident and bug.has_epsilon


def test_an_epsilon_added_on_every_rank_is_the_near_miss_epsilon_per_rank(tmp_path):
    out = judge(tmp_path, EPSILON_PER_RANK, "--ranks", "3", "--random", "12")
    assert out["grade"] == "near miss" and out["fingerprint"] == "epsilon-per-rank", out["near_miss"]
    size = float(out["near_miss"].split("off by at most ")[1].split()[0])
    assert 1e-9 < size < 1e-4  # sqrt(R) x 1e-6 over the norms of the cases, far off only on tiny ones


def test_a_float64_sum_rounded_once_to_float32_is_the_float32_near_miss_on_a_layout(tmp_path):
    out = judge(tmp_path, COLOSSAL, "--layout", "pp=2,tp=2", "--positive-max-norm")
    assert out["grade"] == "near miss" and out["fingerprint"] == "epsilon"
    assert set(out["fingerprint_benign"]) == {"float32 rounding"}
    size = float(out["near_miss"].split("off by at most ")[1].split()[0])
    assert 1e-9 < size < 1e-6  # one float32 rounding of the total, not more


def test_the_numpy_layout_form_names_a_bug_through_float32_rounding(tmp_path):
    out = judge(tmp_path, DEEPSPEED_5411, "--layout", "tp=2", "--positive-max-norm")
    assert out["grade"] == "fail" and out["fingerprint"] == "tp-rank0-only"
    assert set(out["fingerprint_benign"]) <= {"float32 rounding", "epsilon 1e-6"}
    assert "float32 rounding" in out["fingerprint_benign"]


DIAGNOSE = """
import math, sys
import numpy as np
from mpi4py import MPI
from gclip.testing import diagnose

comm = MPI.COMM_WORLD
before = [np.array([3e-6, 4e-6]) * (comm.rank + 1)]
own = math.sqrt(float(np.sum(np.square(before[0]))))
norms = comm.allgather(own)
coef = min(1.0, 1e-7 / math.sqrt(math.fsum((n + 1e-6) ** 2 for n in norms)))
d = diagnose(before, [before[0] * coef], 1e-7, comm=comm)
if comm.rank == 0:
    print(d.grade, d.bug)
    print(d)
"""


def test_diagnose_names_an_epsilon_added_on_every_rank(tmp_path):
    path = tmp_path / "diag.py"
    path.write_text(DIAGNOSE)
    proc = mpirun(3, sys.executable, str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, *rest = proc.stdout.splitlines()
    assert first == "near miss epsilon-per-rank", proc.stdout
    assert any(line.startswith("verdict: near miss: epsilon-per-rank") for line in rest)


# a student's all-reduce, entered on rank 0 only: the other ranks return, rank 0 waits forever
ROOT_ONLY = """
def clip(grads, max_norm, comm):
    total = np.array([_sumsq(grads)])
    if comm.Get_rank() == 0:
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    norm = float(np.sqrt(total[0]))
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [g * scale for g in grads]
"""


def test_a_collective_entered_on_rank_0_only_is_skip_collective(tmp_path):
    out = judge(tmp_path, ROOT_ONLY, "--ranks", "3", "--random", "0", "--timeout", "3")
    assert out["fingerprint"] == "skip-collective" and out["stopped"] is not None
    first = out["failures"][0]
    assert first["reason"].startswith("ranks 1, 2 returned without entering the collective; rank 0 waited")
