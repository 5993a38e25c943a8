"""gclip.audit --agc and --max-norms: unit-wise and per-group clips in a real training step, 4 torchrun
CPU ranks (gloo).

tests/audit_scripts/scoped_clip.py clips every step: gclip.torch.AGC must pass on TP (a row-parallel
``Shard(1)`` Linear splits every row over the ranks) and FSDP2; timm's adaptive_clip_grad on each
rank's local slices must be named agc-shard-units. gclip.torch.clip_groups_ (the matrices not
clipped, the vectors by their own limit) must pass; one clip over every group must be named
muon-global-clip. The audit's oracle is the judge of the limits (gclip.conformance.limits) on the
recorded squares (math.fsum), not the clip under test.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, assert_audited, exited, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "audit_scripts"
GROUPS = ["--max-norms", "none,0.05"]  # scoped_clip.py's LIMIT on its second group
RUNS = {  # layout, clip, the audit's options, the bug it must name (None: every step passes)
    "tp-agc-gclip": ("tp", "agc-gclip", ["--agc"], None),
    "tp-agc-timm": ("tp", "agc-timm", ["--agc", "--agc-clipping", "0.01"], "agc-shard-units"),
    "fsdp2-agc-gclip": ("fsdp2", "agc-gclip", ["--agc"], None),
    "fsdp2-groups-gclip": ("fsdp2", "groups-gclip", GROUPS, None),
    "fsdp2-groups-global": ("fsdp2", "groups-global", GROUPS, "muon-global-clip"),
}


def audit(tmp_path, layout: str, clip: str, options: list[str]):
    report = tmp_path / "audit.jsonl"
    cmd = torchrun_cmd(4, "-m", "gclip.audit", *options, "--json", str(report))
    cmd += [str(SCRIPTS / "scoped_clip.py"), "--layout", layout, "--clip", clip]
    path = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])
    job = run_job(cmd, env=job_env(PYTHONPATH=path))
    steps = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return job, steps


@pytest.mark.parametrize("run", list(RUNS))
def test_gclips_scoped_clips_pass_and_the_wrong_scopes_are_named(run, tmp_path):
    layout, clip, options, bug = RUNS[run]
    job, steps = audit(tmp_path, layout, clip, options)
    text = job.stdout + job.stderr
    assert exited(job, 0 if bug is None else 1), text[-3000:]
    assert [s["step"] for s in steps] == list(range(4)), text[-3000:]
    assert_audited(steps, bug)  # the limits bind on 2 steps at least: not a vacuous pass
    assert bug is None or f"verdict: wrong: {bug}" in text


def test_a_limit_per_group_that_the_optimizer_does_not_have_is_one_line_on_every_rank(tmp_path):
    job, steps = audit(tmp_path, "fsdp2", "groups-gclip", ["--max-norms", "0.05"])
    text = job.stdout + job.stderr
    line = "gclip.audit: --max-norms gives 1 limit, the optimizer has 2 parameter groups"
    assert job.returncode != 0 and text.count(line) == 4, text[-3000:]
    assert "AuditError" not in text and steps == []  # no rank's traceback (torchrun prints its own)
