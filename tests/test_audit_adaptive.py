"""gclip.audit --adaptive on an adaptive clip in a real training step, 4 torchrun CPU ranks (gloo).

tests/audit_scripts/adaptive_clip.py clips every step with ZClip (warmup 5, a spike on steps 8
and 11): gclip.torch.ZClip must pass every step on FSDP2 and HSDP 2x2; the reference's rule on
its non-distributed branch (each rank's local norm, FSDP2) must be named adaptive-local-norm,
on its FSDP branch (the world sum under HSDP, the replicas counted) zclip-world-sum. The
audit's oracle is the rule on the true global norm (math.fsum of the pieces' squares), not
the clip under test.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, assert_audited, exited, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "audit_scripts"
CAP = 2.8  # between the true norm (2.4 down to 1.2 here) and the world sum's (sqrt(2) x) in the warmup
RUNS = {  # layout, clip, ZClip's max_grad_norm, the bug the audit must name (None: every step passes)
    "fsdp2-gclip": ("fsdp2", "gclip", None, None),
    "fsdp2-local": ("fsdp2", "local", None, "adaptive-local-norm"),
    "hsdp-gclip": ("hsdp", "gclip", CAP, None),
    "hsdp-world": ("hsdp", "world", CAP, "zclip-world-sum"),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_gclips_zclip_passes_and_the_references_wrong_norms_are_named(run, tmp_path):
    layout, clip, cap, bug = RUNS[run]
    report = tmp_path / "audit.jsonl"
    spec = f"zclip:warmup_steps=5,max_grad_norm={cap}"
    cmd = torchrun_cmd(4, "-m", "gclip.audit", "--adaptive", spec, "--json", str(report), "--quiet")
    cmd += [str(SCRIPTS / "adaptive_clip.py"), "--layout", layout, "--clip", clip]
    if cap is not None:
        cmd += ["--cap", str(cap)]
    path = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])
    job = run_job(cmd, env=job_env(PYTHONPATH=path))
    steps = [json.loads(line) for line in report.read_text().splitlines()]
    assert exited(job, 0 if bug is None else 1), job.stdout + job.stderr[-3000:]
    assert [s["step"] for s in steps] == list(range(14))
    assert_audited(steps, bug)  # the spikes clipped, at least: not a vacuous pass
