"""Shared test helpers.

Under ``mpirun ... pytest --with-mpi``, a test that fails on one rank while the
others wait in a collective would hang the job. The hook below ends the whole
job at once instead (after printing the failure), so a failure is fast and
visible; every mpirun in the suite also runs under a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED_RECORD = ROOT / "tests" / "data" / "seed_000_adec46095326f7b8.json"
MPIRUN_TIMEOUT = int(os.environ.get("GCLIP_TEST_TIMEOUT", "180"))


def _world():
    if "--with-mpi" not in sys.argv:
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def pytest_runtest_logreport(report):
    comm = _world()
    if comm is not None and report.failed:
        sys.stderr.write(f"\n[rank {comm.Get_rank()}] {report.nodeid} FAILED:\n{report.longreprtext}\n")
        sys.stderr.write(f"[rank {comm.Get_rank()}] aborting the job so no rank waits forever\n")
        sys.stderr.flush()
        comm.Abort(1)


def mpirun(
    n: int,
    *args: str,
    timeout: int = MPIRUN_TIMEOUT,
    env: dict | None = None,
    check: bool = False,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mpirun -n N <args>`` under a timeout, with Hydra's own watchdog too."""
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpirun on PATH")
    full_env = {**os.environ, "MPIEXEC_TIMEOUT": str(timeout), **(env or {})}
    cmd = [exe, "-n", str(n), *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout + 15, env=full_env, input=input
    )
    if "APPLICATION TIMED OUT" in proc.stdout + proc.stderr:
        proc.returncode = proc.returncode or 124  # Hydra's watchdog fired but may have exited 0
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def venv_env() -> dict:
    """The environment of this interpreter's venv (its mpirun, mpi4py), with src/ importable."""
    env = os.environ.copy()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class OneRankComm:
    """The slice of the mpi4py communicator API gclip uses, for one rank, without MPI."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Allreduce(self, send, recv, op=None):
        recv[...] = send

    def allgather(self, item):
        return [item]


@pytest.fixture(scope="session")
def seed_record() -> dict:
    import json

    return json.loads(SEED_RECORD.read_text())
