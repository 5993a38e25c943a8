"""The audit on gclip's own code, under torchrun on 4 CPU ranks (gloo).

tests/audit_scripts/own_clip.py clips step k with mode k: gclip.torch's clip (``global``), a
bug of the gallery installed with ``gclip.gallery.torch.clip_grad_norm_(mode=NAME)``, or
gclip's clip told the wrong layout. gclip's clip must pass on every layout of docs/torch.md
(DDP, FSDP2, HSDP, TP, FSDP x TP, PP x FSDP), and each bug be named as the gallery names it:
one launch per layout, the bugs of a family one per step.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, exited, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "audit_scripts"
PATH = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])  # this tree's gclip, not an installed one

ENGINE = ["per-rank", "sum-of-norms", "mean-of-norms", "rank0-norm", "max-of-norms"]
RUNS = {  # layout, max_norm, the modes step by step (step 0: gclip's own clip)
    "fsdp2-engine-bugs": ("fsdp2", 0.2, ["global", *ENGINE]),
    "fsdp2-rms": ("fsdp2", 0.05, ["global", "rms"]),  # the RMS is below 0.2 here: unscaled
    "ddp": ("ddp", 0.2, ["global", "dp-replicas-summed"]),
    "tp": ("tp", 0.2, ["global", "tp-duplicates-summed"]),
    "pp-fsdp": ("pp-fsdp", 0.2, ["global", "pp-stages-apart"]),
    "hsdp": ("hsdp", 0.2, ["global"]),
    "fsdp-tp": ("fsdp-tp", 0.2, ["global"]),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_gclips_clip_passes_and_each_bug_is_named(run, tmp_path):
    layout, limit, modes = RUNS[run]
    report = tmp_path / "audit.jsonl"
    cmd = torchrun_cmd(4, "-m", "gclip.audit", "--max-norm", str(limit), "--json", str(report), "--quiet")
    cmd += [str(SCRIPTS / "own_clip.py"), "--layout", layout, "--modes", ",".join(modes)]
    cmd += ["--max-norm", str(limit)]
    job = run_job(cmd, env=job_env(PYTHONPATH=PATH))
    steps = [json.loads(line) for line in report.read_text().splitlines()]
    assert exited(job, 1 if len(modes) > 1 else 0), job.stdout + job.stderr[-3000:]
    assert [s["step"] for s in steps] == list(range(len(modes)))
    for mode, step in zip(modes, steps):
        assert step["clipped"], (mode, step)
        if mode == "global":
            assert (step["grade"], step["fingerprint"]) == ("pass", None), step
        else:
            assert (step["grade"], step["fingerprint"]) == ("fail", mode), step
