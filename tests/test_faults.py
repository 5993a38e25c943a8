"""Faults of whole jobs: a rank killed, a job that hangs, an entry point that crashes on one rank.

Each test launches a small script of ``tests/faults/`` under mpirun and checks
that the job ENDS (non-zero, within a liveness bound) and that its output says
what went wrong where. Every launch has a timeout; on expiry the launcher gets
SIGINT, which Hydra forwards to the ranks, so no rank outlives the test.

The messages checked are Hydra's (MPICH's launcher, which the ``mpich`` wheel
provides); with another launcher these tests skip.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.slow

FAULTS = Path(__file__).parent / "faults"
LIVENESS = 30.0  # seconds: a job that is not over by then is hung, not slow
LAUNCH_TIMEOUT = 90  # the subprocess timeout: well above LIVENESS, so a hang is reported as one


class Job(NamedTuple):
    code: int
    out: str
    err: str
    elapsed: float


def _launcher() -> str | None:
    """mpiexec next to this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        if (here / name).exists():
            return str(here / name)
    return shutil.which("mpiexec") or shutil.which("mpirun")


@pytest.fixture(scope="module")
def mpiexec() -> str:
    launcher = _launcher()
    if launcher is None:
        pytest.skip("no mpiexec found")
    try:
        version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"mpiexec --version failed: {exc}")
    if "HYDRA" not in version.stdout.upper():
        pytest.skip("these checks read the messages of MPICH's Hydra launcher")
    return launcher


def run_job(mpiexec: str, n: int, script: str, *args: str, watchdog: int = 60) -> Job:
    """Run ``script`` on n ranks; Hydra's own MPIEXEC_TIMEOUT is a second line of defence."""
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(watchdog), PYTHONUNBUFFERED="1")
    cmd = [mpiexec, "-n", str(n), sys.executable, str(FAULTS / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # Hydra forwards it and cleans up every rank
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=15)
        pytest.fail(f"{script} {' '.join(args)} still running after {LAUNCH_TIMEOUT} s:\n{out}\n{err}")
    return Job(proc.returncode, out, err, time.monotonic() - start)


# --------------------------------------------------------------------------- (a) a rank killed


def _deaths(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("killed_rank:")]


@pytest.mark.parametrize(("n", "victim"), [(2, 1), (3, 1), (4, 1), (3, 0)])
def test_killed_rank_ends_the_job_and_is_named(mpiexec, n, victim):
    job = run_job(mpiexec, n, "killed_rank.py", "--victim", str(victim), "--after", "5")
    log = job.out + job.err
    assert job.code != 0, log
    assert job.elapsed < LIVENESS, f"the job took {job.elapsed:.1f} s to end"
    assert "finished" not in job.out, log  # the survivors never completed their clips
    assert "BAD TERMINATION" in log, log  # Hydra noticed and cleaned up
    deaths = _deaths(job.err)
    assert len(deaths) == 1, log  # the victim only: the survivors were ended, not killed mid-run
    assert re.search(rf"\brank {victim}\b", deaths[0]) and "SIGKILL" in deaths[0], deaths[0]


def test_killed_rank_script_runs_clean_without_the_kill(mpiexec):
    job = run_job(mpiexec, 3, "killed_rank.py", "--victim", "-1", "--clips", "200")
    assert job.code == 0, job.out + job.err
    assert "finished 200 clips" in job.out
    assert not _deaths(job.err)


# --------------------------------------------------------------------------- (b) the watchdog


# Hydra 5.0.2 sometimes exits 0 after MPIEXEC_TIMEOUT fired (seen ~1 run in 7 on a loaded
# machine): its proxy fails this assertion while the job is torn down. The job does end, but its
# status lies, which is why every mpirun here also runs under an outer timeout.
HYDRA_TIMEOUT_RACE = "assert (!closed) failed"


def _pids(out: str) -> dict[int, int]:
    """{rank: pid} from the ``pids: 0=123 1=456`` line of skipped_collective.py."""
    line = next(line for line in out.splitlines() if line.startswith("pids: "))
    return {int(r): int(pid) for r, pid in (item.split("=") for item in line.split()[1:])}


def _alive(pids: dict[int, int], grace: float = 5.0) -> list[int]:
    """Ranks whose process still exists after a short grace period (for the reaper)."""
    deadline = time.monotonic() + grace
    while True:
        left = [r for r, pid in pids.items() if _exists(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process reused the pid
        return False
    return True


def test_watchdog_ends_a_hung_job(mpiexec):
    job = run_job(mpiexec, 3, "skipped_collective.py", "--skipper", "1", watchdog=5)
    log = job.out + job.err
    assert job.elapsed < LIVENESS, f"the job took {job.elapsed:.1f} s to end"
    assert "finished" not in job.out, log  # rank 0 really was stuck
    assert re.search(r"TIMED OUT", log, re.I), log
    assert not _alive(_pids(job.out)), log  # nobody left spinning in the all-reduce
    if job.code == 0 and HYDRA_TIMEOUT_RACE in job.err:
        pytest.xfail("Hydra exited 0 after MPIEXEC_TIMEOUT fired (a launcher race, not gclip's)")
    assert job.code != 0, log


def _scripts_test():
    """scripts/test as a module (it has no .py suffix): its watchdog is tested here."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "test"
    loader = importlib.machinery.SourceFileLoader("gclip_scripts_test", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_outer_watchdog_ends_a_hung_job(mpiexec, tmp_path):
    """The rule for every mpirun of scripts/test: a watchdog that ends the whole process group
    (no GNU timeout needed), Hydra's own MPIEXEC_TIMEOUT only as a backstop; nobody left."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MPIEXEC_TIMEOUT", None)
    cmd = [mpiexec, "-n", "3", sys.executable, str(FAULTS / "skipped_collective.py")]
    out = tmp_path / "out"
    start = time.monotonic()
    with open(out, "w") as sink:
        code = _scripts_test().watched(cmd, 5, env, stdout=sink)
    elapsed = time.monotonic() - start
    log = out.read_text()
    assert code == "timeout", log  # the job was ended, not finished
    assert elapsed < LIVENESS, f"the job took {elapsed:.1f} s to end"
    assert "finished" not in log, log
    assert not _alive(_pids(log)), log


def test_watchdog_leaves_a_healthy_job_alone(mpiexec):
    job = run_job(mpiexec, 3, "skipped_collective.py", "--skipper", "-1", watchdog=5)
    assert job.code == 0, job.out + job.err
    assert "finished" in job.out
    assert not _alive(_pids(job.out))


# --------------------------------------------------------------------------- (c) entry points


def _entry_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("entry_fault:")]


@pytest.mark.parametrize("n", [2, 3])
def test_exception_on_one_rank_aborts_the_job_in_one_line(mpiexec, n):
    job = run_job(mpiexec, n, "entry_fault.py", "raise", "--rank", "1")
    log = job.out + job.err
    assert job.code != 0, log
    assert job.elapsed < LIVENESS, f"the job took {job.elapsed:.1f} s to end"
    assert "Traceback" not in log, log
    assert "norm" not in job.out, log  # rank 0 never finished its clip
    lines = _entry_lines(job.err)
    assert len(lines) == 1, log  # one line, from the faulty rank only
    assert re.search(r"\brank 1\b", lines[0]) and "RuntimeError" in lines[0], lines[0]
    assert "injected fault" in lines[0], lines[0]


def test_bad_input_on_one_rank_exits_2_everywhere_in_one_line(mpiexec):
    job = run_job(mpiexec, 3, "entry_fault.py", "bad-input", "--rank", "2")
    log = job.out + job.err
    assert job.code == 2, log
    assert "Traceback" not in log, log
    lines = _entry_lines(job.err)
    assert len(lines) == 1, log  # printed by rank 0 only
    assert re.search(r"\brank 2\b", lines[0]) and re.search(r"\bint\d+", lines[0]), lines[0]


def test_usage_error_exits_2_in_one_line(mpiexec):
    job = run_job(mpiexec, 2, "entry_fault.py", "--no-such-flag")
    assert job.code == 2, job.out + job.err
    assert "Traceback" not in job.err
    assert len(_entry_lines(job.err)) == 1, job.err


def test_entry_fault_script_runs_clean_without_a_fault(mpiexec):
    job = run_job(mpiexec, 3, "entry_fault.py", "none")
    assert job.code == 0, job.out + job.err
    assert job.out.count("norm ") == 1  # printed by rank 0 only
