"""gclip.audit on unmodified training scripts under torchrun, 4 CPU processes (gloo).

tests/audit_scripts/train.py trains a small model on DDP, FSDP2, HSDP (2 x 2) or two
pipeline stages x FSDP, and clips as real code did (torch's clip, gclip's, per rank, per
stage, the replicas summed, never scaled). The oracle is the script's own, outside the
audit: math.fsum over every full gradient's squares (full_tensor(), each parameter once)
and, per rank, the factor its gradients got, by least squares over real copies taken
before the clip. The audit must report that norm and those factors, and name the bug.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, exited, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "tests" / "audit_scripts" / "train.py")
RANKS = 4


def audit(tmp_path, layout: str, how: str, *flags: str) -> tuple[list[dict], list[list[dict]], str]:
    """The audit's JSON lines, each rank's oracle lines, and rank 0's text."""
    report = tmp_path / "audit.jsonl"
    cmd = torchrun_cmd(RANKS, "-m", "gclip.audit", "--json", str(report), *flags, SCRIPT)
    job = run_job([*cmd, "--layout", layout, "--clip", how], env=job_env(TRAIN_ORACLE=str(tmp_path)))
    steps = [json.loads(line) for line in report.read_text().splitlines()]
    lines = [(tmp_path / f"rank{r}.jsonl").read_text().splitlines() for r in range(RANKS)]
    oracle = [[json.loads(x) for x in mine] for mine in lines]
    failed = any(s["grade"] == "fail" for s in steps)
    assert exited(job, 1 if failed else 0), job.stdout + job.stderr[-3000:]
    return steps, oracle, job.stdout


def check_numbers(steps: list[dict], oracle: list[list[dict]]) -> None:
    assert len(steps) == 2 and all(len(o) == 2 for o in oracle)
    for k, step in enumerate(steps):
        norm = oracle[0][k]["norm"]
        assert all(o[k]["norm"] == norm for o in oracle)
        assert abs(step["global_norm"] - norm) <= 1e-9 * norm, (step["global_norm"], norm)
        for r in range(RANKS):
            want, got = oracle[r][k]["scale"], step["scales"][r]
            assert (want is None) == (got is None)
            if want is not None:
                assert abs(got - want) <= 1e-6 * want, (r, got, want)


CORRECT = [("ddp", "torch"), ("fsdp2", "torch"), ("hsdp", "gclip"), ("pp-fsdp", "gclip")]


@pytest.mark.parametrize(("layout", "how"), CORRECT)
def test_a_correct_clip_passes(tmp_path, layout, how):
    steps, oracle, text = audit(tmp_path, layout, how)
    check_numbers(steps, oracle)
    for step in steps:
        assert step["grade"] == "pass" and step["fingerprint"] is None
        assert step["clipped"] and step["max_norm"] == 0.2 and step["max_norm_from"] == "the clip call"
    assert "verdict: correct: the global-norm clip" in text
    assert "gclip.audit: 2 steps audited (2 clipped): 2 pass" in text


BUGGY = [
    ("fsdp2", "per-rank", "per-rank"),
    ("hsdp", "per-rank", "per-rank"),
    ("pp-fsdp", "per-stage", "pp-stages-apart"),
    ("ddp", "replicas-summed", "dp-replicas-summed"),
    ("fsdp2", "never-scaled", "never-scaled"),
]


@pytest.mark.parametrize(("layout", "how", "bug"), BUGGY)
def test_a_wrong_clip_is_named(tmp_path, layout, how, bug):
    steps, oracle, text = audit(tmp_path, layout, how, "--max-norm", "0.2")
    check_numbers(steps, oracle)
    for step in steps:
        assert step["grade"] == "fail" and step["fingerprint"] == bug
        assert step["clipped"] and step["max_norm_from"] == "--max-norm"
    assert f"verdict: wrong: {bug}" in text
    if bug == "dp-replicas-summed":  # the norm of 4 replicas: twice the true one (torch adds 1e-6)
        assert all(abs(n / s["global_norm"] - 2.0) <= 1e-5 for s in steps for n in s["implied_norms"])


def test_a_dtensor_norm_read_with_item_is_per_rank_and_said_so(tmp_path):
    """pytorch #144054: .item() of a DTensor's Partial norm is the local shard's (torch 2.13 too),
    so a clip by it is per-rank; the audit says how code gets there on DTensors."""
    steps, oracle, text = audit(tmp_path, "fsdp2", "shard-item", "--max-norm", "0.2")
    check_numbers(steps, oracle)
    assert all(s["grade"] == "fail" and s["fingerprint"] == "per-rank" for s in steps)
    assert "verdict: wrong: per-rank" in text and "pytorch #144054" in text


def test_steps_limits_the_audit_and_an_unclipped_step_says_so(tmp_path):
    steps, oracle, text = audit(tmp_path, "ddp", "none", "--steps", "1")
    assert len(steps) == 1 and steps[0]["grade"] == "pass" and not steps[0]["clipped"]
    assert steps[0]["max_norm"] is None
    assert abs(steps[0]["global_norm"] - oracle[0][0]["norm"]) <= 1e-9 * oracle[0][0]["norm"]
    assert "verdict: not clipped" in text


def test_gclip_testing_audit_around_a_tests_own_steps(tmp_path):
    script = str(ROOT / "tests" / "audit_scripts" / "block_audit.py")
    job = run_job(torchrun_cmd(RANKS, script, str(tmp_path)), env=job_env())
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    every = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert all(e == every[0] for e in every)  # the same reports, the same error, on every rank
    (right,) = every[0]["right"]
    assert right["grade"] == "pass" and right["clipped"] and right["max_norm"] == 0.2
    wrong = every[0]["wrong"]
    assert wrong.startswith("2 of 2 audited steps failed:")
    assert "verdict: wrong: per-rank" in wrong
