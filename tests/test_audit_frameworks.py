"""The real frameworks through gclip.audit, on 4 CPU ranks (gloo): each row of docs/frameworks.md.

Each framework is the pinned release of the ``frameworks`` extra (pyproject.toml); without
it these tests skip, naming the missing package. A row runs a script of tests/audit_scripts/
unmodified under ``torchrun -m gclip.audit --json`` and checks the audit's grade and
fingerprint on every step, or, where the framework refuses or crashes, its one error line
(on every rank). The audit's own numbers are checked against an oracle outside it in
tests/test_audit.py.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, exited, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "audit_scripts"
PATH = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])  # this tree's gclip, not an installed one
RANKS = 4
EXTRA = "not installed: the frameworks extra brings it (pip install '.[frameworks]')"

# (framework module, script, its arguments, what the audit must say):
# ("grade", fingerprint) on every step, or ("error", a line every rank raised)
ROWS = {
    "accelerate-ddp": ("accelerate", "fw_accelerate.py", ["--layout", "ddp"], ("pass", None)),
    "accelerate-fsdp-tp": ("accelerate", "fw_accelerate.py", ["--layout", "fsdp-tp"], ("pass", None)),
    "accelerate-tp-gclip": (
        "accelerate",
        "fw_accelerate.py",
        ["--layout", "tp", "--clip", "gclip"],
        ("pass", None),
    ),
    "lightning-ddp": ("lightning", "fw_lightning.py", ["--strategy", "ddp"], ("pass", None)),
    "lightning-fsdp": (
        "lightning",
        "fw_lightning.py",
        ["--strategy", "fsdp"],
        (
            "error",
            "ValueError: The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`",
        ),
    ),
    "lightning-fsdp2": ("lightning", "fw_lightning.py", ["--strategy", "model-parallel"], ("pass", None)),
    "lightning-fsdp2-tp": (
        "lightning",
        "fw_lightning.py",
        ["--strategy", "model-parallel-tp"],
        ("error", "All operands in aten.stack.default must have the same mesh"),
    ),
    "lightning-fsdp2-tp-gclip": (
        "lightning",
        "fw_lightning.py",
        ["--strategy", "model-parallel-tp", "--clip", "gclip"],
        ("pass", None),
    ),
    "transformers-ddp": ("transformers", "fw_transformers.py", ["{tmp}"], ("near miss", "epsilon")),
    "transformers-ddp-gclip": (
        "transformers",
        "fw_transformers.py",
        ["{tmp}", "--clip", "gclip"],
        ("pass", None),
    ),
    "transformers-tp": ("transformers", "fw_transformers.py", ["{tmp}", "--tp"], ("pass", None)),
    "torchtitan-pp-fsdp": ("torchtitan", "fw_torchtitan.py", ["--layout", "pp-fsdp"], ("pass", None)),
    "torchtitan-pp-fsdp-before-649": (
        "torchtitan",
        "fw_torchtitan.py",
        ["--layout", "pp-fsdp", "--clip", "titan-no-pp"],
        ("fail", "pp-stages-apart"),
    ),
    "torchtitan-fsdp-tp-plain-modules": (
        "torchtitan",
        "fw_torchtitan.py",
        ["--layout", "fsdp-tp"],
        ("error", "All operands in aten.stack.default must have the same mesh"),
    ),
    "torchtitan-fsdp-tp-gclip": (
        "torchtitan",
        "fw_torchtitan.py",
        ["--layout", "fsdp-tp", "--clip", "gclip"],
        ("pass", None),
    ),
    # Megatron-core's clip hard-codes CUDA: its norm allocates on "cuda" (the error below),
    # its scaling asserts torch.cuda.FloatTensor gradients (checked too, in the test)
    "megatron-tp-dp": (
        "megatron.core",
        "fw_megatron.py",
        [],
        ("error", "AssertionError: Torch not compiled with CUDA enabled"),
    ),
}

# Optimizers that clip inside their own step, read from the update of plain SGD (lr 1):
# the script runs under torchrun itself and writes the reports (gclip.audit.update)
# (one process group for no ZeRO and ZeRO 1, 2, 3: most of a row's time is starting it)
UPDATE_ROWS = {
    "deepspeed-zero0123": ("deepspeed", "fw_deepspeed.py", ["--stage", "0", "1", "2", "3"], [0, 1, 2, 3])
}


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a dotted name whose parent is absent
        return True


def _check_steps(job, report, kind: str, expected: str | None, runs: int = 1) -> list[dict]:
    text = job.stdout + job.stderr
    assert exited(job, 1 if kind == "fail" else 0), text[-3000:]
    steps = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(steps) == 2 * runs, text[-3000:]
    for step in steps:
        assert step["clipped"] and step["max_norm"] == 0.2 and step["max_norm_from"] == "the clip call"
        assert (step["grade"], step["fingerprint"]) == (kind, expected), text[-3000:]
    return steps


@pytest.mark.parametrize("row", list(ROWS))
def test_framework_row(row, tmp_path):
    module, script, args, (kind, expected) = ROWS[row]
    if _missing(module):
        pytest.skip(f"{module} {EXTRA}")
    report = tmp_path / "audit.jsonl"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    cmd = torchrun_cmd(RANKS, "-m", "gclip.audit", "--json", str(report), str(SCRIPTS / script), *args)
    job = run_job(cmd, env=job_env(PYTHONPATH=PATH))
    text = job.stdout + job.stderr
    if kind == "error":
        assert job.returncode != 0
        # each rank raised it (counted in the text: ranks' prints to one pipe can share a line)
        assert text.count(expected) >= RANKS, text[-3000:]
        if module == "megatron.core":
            refused = "megatron scaling refused: assert param.grad.type() == 'torch.cuda.FloatTensor'"
            assert text.count(refused) == RANKS, text[-3000:]
        return
    _check_steps(job, report, kind, expected)


@pytest.mark.parametrize("row", list(UPDATE_ROWS))
def test_update_row(row, tmp_path):
    module, script, args, stages = UPDATE_ROWS[row]
    if _missing(module):
        pytest.skip(f"{module} {EXTRA}")
    report = tmp_path / "audit.jsonl"
    cmd = torchrun_cmd(RANKS, str(SCRIPTS / script), *args, "--json", str(report))
    job = run_job(cmd, env=job_env(PYTHONPATH=PATH, DS_ACCELERATOR="cpu"))
    steps = _check_steps(job, report, "pass", None, runs=len(stages))
    assert [s["zero_stage"] for s in steps] == [stage for stage in stages for _ in range(2)]


def test_the_hooks_say_they_cannot_see_inside_zero(tmp_path):
    """Under ZeRO the hooked optimizer is DeepSpeed's inner one, on flat partitions no backward
    left: the audit must say it audited nothing (exit 1), not pass the steps as unclipped."""
    if _missing("deepspeed"):
        pytest.skip(f"deepspeed {EXTRA}")
    from gclip.audit.auditor import UNSEEN

    report = tmp_path / "audit.jsonl"
    cmd = torchrun_cmd(RANKS, "-m", "gclip.audit", "--json", str(report), str(SCRIPTS / "fw_deepspeed.py"))
    job = run_job([*cmd, "--stage", "1"], env=job_env(PYTHONPATH=PATH, DS_ACCELERATOR="cpu"))
    text = job.stdout + job.stderr
    assert exited(job, 1), text[-3000:]
    assert text.count(UNSEEN) == 2, text[-3000:]  # each step, on rank 0
    assert report.read_text() == "", text[-3000:]  # no step graded
