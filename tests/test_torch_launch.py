"""gclip.torch in real jobs, launched as subprocesses under a timeout (plain tests).

- torchrun with 2 processes and gloo, no MPI launcher: the core API refuses
  comm=None on both processes (MPI sees one rank, WORLD_SIZE says two), and
  gclip.torch.clip_grad_norm_ with comm=None clips by the norm over the torch group;
- the tensor-parallel example under mpirun -n 4 (mpi4py comm) and torchrun with
  4 processes (gloo): its losses match the single-process reference over 50 steps.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, assert_finished, job_env, mpirun_cmd, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

EXAMPLE = str(ROOT / "examples" / "torch_tensor_parallel.py")
STEPS = 50


def test_under_torchrun_comm_none_is_refused_by_the_core_and_global_in_gclip_torch(tmp_path):
    script = str(ROOT / "tests" / "torch_torchrun_check.py")
    job = run_job(torchrun_cmd(2, script, str(tmp_path)), env=job_env())
    assert_finished(job, [tmp_path / f"rank{r}.json" for r in range(2)])
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["core_none"].startswith(
            "GclipError: comm=None: MPI sees 1 rank, but this process is one of 2"
        )
        assert r["core_none_after_init"] == r["core_none"]
        assert r["torch_none_before_init"].startswith(
            "GclipError: comm=None: torch.distributed is not initialised"
        )
        assert r["core_world"].startswith("GclipTypeError: comm must be an mpi4py communicator")
        assert "gclip.torch" in r["core_world"]
        assert abs(r["norm"] - r["oracle"]) <= 1e-12 * r["oracle"]
        assert all(ok for ok, _ in r["scaled_once"]), r["scaled_once"]
    assert reports[0]["norm"] == reports[1]["norm"] and reports[0]["oracle"] == reports[1]["oracle"]


@pytest.mark.parametrize(("when", "accepted"), [("after", True), ("before", False), ("error", False)])
def test_only_the_teardown_abort_after_every_verdict_is_let_through(tmp_path, when, accepted):
    script = str(ROOT / "tests" / "torch_teardown_abort.py")
    job = run_job(torchrun_cmd(2, script, str(tmp_path), when), env=job_env())
    assert job.returncode != 0, job.stdout + job.stderr
    try:
        assert_finished(job, [tmp_path / f"rank{r}.json" for r in range(2)])
    except AssertionError:
        assert not accepted, job.stderr[-3000:]
    else:
        assert accepted, job.stderr[-3000:]


def example(cmd: list[str]) -> dict:
    job = run_job(cmd, env=job_env())
    assert_finished(job, stdout_verdict=True)
    lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, job.stdout  # rank 0 reports
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def reference() -> dict:

    return example([sys.executable, EXAMPLE, "--reference", "--json", "--steps", str(STEPS)])


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_tensor_parallel_example_matches_the_single_process_reference(reference, launcher):

    args = [EXAMPLE, "--json", "--steps", str(STEPS)]
    cmd = mpirun_cmd(4, sys.executable, *args) if launcher == "mpirun" else torchrun_cmd(4, *args)
    run = example(cmd)
    assert run["ranks"] == 4 and run["comm"] == {"mpirun": "mpi", "torchrun": "gloo"}[launcher]
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    assert worst <= 1e-6
    assert sum(n > 1.0 for n in reference["norms"]) >= STEPS // 2  # the clip is at work


def test_the_example_with_a_clip_bug_parts_from_the_reference(reference):

    args = [EXAMPLE, "--json", "--steps", str(STEPS), "--mode", "double-count"]
    run = example(mpirun_cmd(4, sys.executable, *args))
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    assert worst > 1e-4  # the biases and the head counted on 4 ranks: another scale, another run
