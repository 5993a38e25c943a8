"""Launching ``mpirun`` from Python: found the same way everywhere, and never left running.

- :func:`find_mpirun`: the venv's mpirun (next to this Python: the ``mpich``
  wheel installs it there) first, else the one on PATH.
- :func:`child_env`: the environment for an mpirun started from inside
  another MPI job (the bench's ranks sweep, a test under ``mpirun``): without
  the parent job's process-manager variables, which would make the new job
  join the old one, and with Hydra's own watchdog set.
- :func:`run`: mpirun in its own process group, under a timeout that ends
  the whole job (mpirun's group, its proxies and every rank) with SIGKILL.
  No GNU ``timeout`` needed, so it works where coreutils is not (macOS).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping

__all__ = [
    "HYDRA_TIMEOUT_LINE",
    "KILL_GRACE",
    "TIMED_OUT",
    "MpirunNotFound",
    "child_env",
    "find_mpirun",
    "kill_job",
    "run",
]

TIMED_OUT = 124  # the status GNU timeout gives, so callers read both the same way
HYDRA_TIMEOUT_LINE = "APPLICATION TIMED OUT"  # Hydra's watchdog fired (it may still exit 0)
KILL_GRACE = 10.0  # seconds after the timeout for Hydra's watchdog to end the job cleanly
_PARENT_JOB = ("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_CH3", "OMPI_")


class MpirunNotFound(FileNotFoundError):
    """No mpirun next to this Python nor on PATH."""


def find_mpirun() -> str:
    """The path of mpirun: the one next to ``sys.executable`` first, else PATH."""
    here = os.path.dirname(sys.executable)
    exe = shutil.which("mpirun", path=here) or shutil.which("mpirun")
    if exe is None:
        raise MpirunNotFound(
            f"no mpirun next to {sys.executable} nor on PATH (on Linux and macOS: pip install mpich)"
        )
    return exe


def child_env(timeout: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) for a new mpirun job.

    The parent job's PMI_/PMIX_/HYDRA_/OMPI_ variables are dropped, and
    MPIEXEC_TIMEOUT (Hydra's watchdog) is set to ``timeout``, whole seconds.
    """
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith(_PARENT_JOB)}
    env["MPIEXEC_TIMEOUT"] = str(max(1, math.ceil(timeout)))
    return env


def run(
    n: int,
    *args: str,
    timeout: float,
    env: Mapping[str, str | None] | None = None,
    input: str | None = None,
    grace: float = KILL_GRACE,
) -> subprocess.CompletedProcess:
    """``mpirun -n N ARGS``, its text output captured; never outlives ``timeout`` (+ ``grace``).

    ``env`` adds variables to :func:`child_env` (a None value removes one).
    Hydra's watchdog ends the job at ``timeout``; if the job is still there
    ``grace`` seconds later, mpirun's process group and every process it
    started are killed. Either way the
    result has returncode 124 (``TIMED_OUT``), also when Hydra reported the
    timeout but exited 0 (it can).
    """
    full_env = child_env(timeout)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    cmd = [find_mpirun(), "-n", str(n), *args]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,  # its own group: one killpg ends mpirun and every rank it started
    )
    try:
        out, err = proc.communicate(input, timeout=timeout + grace)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, TIMED_OUT, out, err)
    code = proc.returncode
    if HYDRA_TIMEOUT_LINE in out + err:
        code = TIMED_OUT
    return subprocess.CompletedProcess(cmd, code, out, err)


def kill_job(leader: int) -> None:
    """SIGKILL mpirun's process group, and every process it started.

    The group alone is not enough: Hydra's proxy puts itself and each rank in
    a session of its own (setsid), so the ranks are found as descendants,
    before anything dies (then they would be orphans, hard to find).
    """
    tree = _descendants(leader)
    own = os.getpgrp()
    for pid in (leader, *tree):
        try:
            group = os.getpgid(pid)
            if group == pid and group != own:  # a group leader (mpirun, a proxy, a rank): its whole group
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # ended meanwhile
            pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``ps`` (Linux and macOS alike)."""
    try:
        ps = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    children: dict[int, list[int]] = {}
    for line in ps.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2 and all(f.isdigit() for f in fields):
            children.setdefault(int(fields[1]), []).append(int(fields[0]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
