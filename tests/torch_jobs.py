"""Launch mpirun and torchrun jobs from plain tests, under a timeout that ends them all.

A launcher runs in a session of its own; on timeout its whole process group
gets SIGTERM (torchrun passes it on to its workers, which run in sessions of
their own), then SIGKILL. The scripts also arm ``watchdog()``, so a worker
that outlives its launcher ends itself.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT = int(os.environ.get("GCLIP_TEST_TIMEOUT", "180"))
# variables by which a launcher tells a process it is one of several (MPI's and torchrun's)
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALNRANKS", "SLURM_")
LAUNCHER_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def job_env(**extra: str) -> dict:
    """This interpreter's venv on PATH, src/ importable, no launcher's variables inherited."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES
    }
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GCLIP_JOB_TIMEOUT"] = str(JOB_TIMEOUT)
    env["OMP_NUM_THREADS"] = "1"  # several ranks share few cores
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun_cmd(n: int, *args: str) -> list[str]:
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpirun on PATH")
    return [exe, "-n", str(n), *args]


def torchrun_cmd(n: int, *args: str) -> list[str]:
    port = str(free_port())
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        *args,
    ]


def run_job(cmd: list[str], *, env: dict, timeout: int = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout end its process group and fail the test."""
    env = {**env, "MPIEXEC_TIMEOUT": str(timeout)}  # Hydra's own watchdog, a backstop
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _end(proc)
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s and was ended\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _end(proc: subprocess.Popen) -> tuple[str, str]:
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()  # pragma: no cover - SIGKILL always ends it


# gloo under load, now and then: one rank's process aborts in C++ at teardown, after its work
# (std::terminate from a thread still joinable as the group goes: pytorch/pytorch#190489 gets the
# same line from a group left undestroyed; every job here destroys it, after a barrier). torchrun
# then ends the other ranks (SIGTERM). The scripts write their verdicts before teardown, so the
# work is judged by them; only this exact abort, after every verdict, is let through.
TEARDOWN_ABORT = "terminate called without an active exception"
_FAILED_RANK = re.compile(r"exitcode\s*:\s*(-?\d+)")


def assert_finished(
    job: subprocess.CompletedProcess, verdicts: Sequence[Path] = (), stdout_verdict: bool = False
) -> None:
    """The job did its work: exit 0; or every verdict was written (the files ``verdicts``, or a
    JSON line on stdout: rank 0's, printed once every rank's work is in it) and what failed is
    the teardown abort alone (one rank ended by SIGABRT with that line; the rest, if any, ended
    by torchrun's SIGTERM after it)."""
    output = job.stdout + job.stderr[-4000:]
    if job.returncode == 0:
        return
    written = all(Path(v).exists() for v in verdicts) and (
        not stdout_verdict or any(line.startswith("{") for line in job.stdout.splitlines())
    )
    codes = [int(c) for c in _FAILED_RANK.findall(job.stderr)]
    teardown = TEARDOWN_ABORT in job.stderr and -6 in codes and set(codes) <= {-6, -15}
    assert written and (verdicts or stdout_verdict) and teardown, f"exit {job.returncode}\n{output}"


def exited(job: subprocess.CompletedProcess, status: int) -> bool:
    """The job ended with ``status``, or every rank had done its work and the one failure is
    gloo's teardown abort (see :func:`assert_finished`): for a launcher whose status is a verdict."""
    if job.returncode == status:
        return True
    codes = [int(c) for c in _FAILED_RANK.findall(job.stderr)]
    return TEARDOWN_ABORT in job.stderr and -6 in codes and set(codes) <= {-6, -15, status}


BATCH = str(ROOT / "tests" / "torch_batch.py")


class Batch:
    """Several check cases in one torchrun job (tests/torch_batch.py), for a module's tests to share.

    ``cases`` maps a name to (script, *args): the script's ``case(outdir, *args)`` runs with
    outdir ``base/<name>``, in the order given. Each test reads its own case's verdicts; a case
    that failed, or never ran because an earlier one failed, fails its test with the traceback."""

    def __init__(self, ranks: int, cases: dict[str, tuple[str, ...]], base: Path) -> None:
        self.ranks, self.errors = ranks, base / "errors.txt"
        self.dirs = {name: base / name for name in cases}
        specs = []
        for name, (script, *args) in cases.items():
            self.dirs[name].mkdir(parents=True)
            specs.append(":".join([script, str(self.dirs[name]), *args]))
        timeout = JOB_TIMEOUT + 20 * len(cases)  # the cases run one after the other
        env = job_env(BATCH_ERRORS=str(self.errors), GCLIP_JOB_TIMEOUT=str(timeout))
        self.job = run_job(torchrun_cmd(ranks, BATCH, *specs), env=env, timeout=timeout)

    def verdicts(self, name: str) -> list[Path]:
        return [self.dirs[name] / f"rank{r}.json" for r in range(self.ranks)]

    def reports(self, name: str) -> list[dict]:
        """Every rank's verdict on the case, or the test fails saying why there is none."""
        files = self.verdicts(name)
        if not all(f.exists() for f in files):
            errors = self.errors.read_text()[-4000:] if self.errors.exists() else "(no case raised)"
            pytest.fail(
                f"case {name}: no verdict from every rank (exit {self.job.returncode})\n{errors}\n"
                f"{self.job.stdout[-2000:]}\n{self.job.stderr[-4000:]}"
            )
        return [json.loads(f.read_text()) for f in files]

    def assert_finished(self) -> None:
        """The job as a whole: every case's verdicts, and a clean end (see :func:`assert_finished`)."""
        assert_finished(self.job, [f for name in self.dirs for f in self.verdicts(name)])


def run_case(case: Any, *args: Any) -> None:
    """A check script's own command line: one case in a job of its own."""
    import torch.distributed as dist

    watchdog()
    dist.init_process_group("gloo")
    case(*args)
    teardown(dist)  # after the verdict: an abort at teardown cannot take it away


def assert_audited(steps: list[dict], bug: str | None) -> None:
    """gclip.audit's JSON steps: some clipped (not a vacuous pass); every step passes where
    ``bug`` is None, else ``bug`` is named on some step, failed there, and nothing else is."""
    assert sum(s["clipped"] for s in steps) >= 2, steps
    if bug is None:
        assert all((s["grade"], s["fingerprint"]) == ("pass", None) for s in steps), steps
        return
    named = [s["step"] for s in steps if s["fingerprint"] == bug]
    assert named and all(s["fingerprint"] in (None, bug) for s in steps), steps
    assert all(s["grade"] == "fail" for s in steps if s["step"] in named), steps


def teardown(dist: Any) -> None:
    """End the job's torch.distributed groups together: no rank closes its gloo pairs while a
    peer still works on them."""
    dist.barrier()
    dist.destroy_process_group()


def watchdog() -> None:
    """In a job's script: exit (with a traceback) if the job outlives its timeout."""
    faulthandler.dump_traceback_later(int(os.environ.get("GCLIP_JOB_TIMEOUT", "180")) + 30, exit=True)
