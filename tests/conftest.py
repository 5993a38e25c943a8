"""Shared test helpers.

Under ``mpirun ... pytest --with-mpi``, a test that fails on one rank while the
others wait in a collective would hang the job. The hook below ends the whole
job at once instead (after printing the failure), so a failure is fast and
visible; every mpirun in the suite also runs under a timeout.

Every test has a time limit (pytest-timeout, ``timeout`` in pyproject.toml):
SIGALRM fails a test that runs too long, by name. A hang the signal cannot
interrupt (a rank blocked inside an MPI collective, C code holding on) meets
the backstop here: a thread that names the test, dumps every thread's stack
and ends the process (under mpirun, Hydra then ends the other ranks).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import os
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED_RECORD = ROOT / "tests" / "data" / "seed_000_adec46095326f7b8.json"
MPIRUN_TIMEOUT = int(os.environ.get("GCLIP_TEST_TIMEOUT", "180"))
# seconds after the per-test timeout before the backstop ends a hung process
TIMEOUT_GRACE = float(os.environ.get("GCLIP_TEST_TIMEOUT_GRACE", "30"))


# --------------------------------------------------------------------------- Hypothesis

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis comes with the test extra
    settings = None
else:
    # One profile for every run, the README's and CI's alike. Left alone, Hypothesis loads
    # its derandomized "ci" profile when CI=true, so CI would never meet the examples a
    # user's run meets. Here: random examples from one seed per run, printed at the end of
    # the run (--hypothesis-seed=N replays it); no example database (no run depends on what
    # an earlier one found, a failure is reported with its example and its reproduce blob);
    # no deadline (a loaded machine's timing is not a failure; pytest-timeout catches hangs).
    settings.register_profile(
        "gclip",
        derandomize=False,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("gclip")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Choose this run's Hypothesis seed (before Hypothesis' own plugin reads it)."""
    if settings is None or not hasattr(config.option, "hypothesis_seed"):
        return
    if config.option.hypothesis_seed is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def pytest_terminal_summary(terminalreporter, config):
    seed = getattr(config.option, "hypothesis_seed", None)
    if seed is not None and _world() is None:
        terminalreporter.write_line(
            f"hypothesis: seed {seed} (replay this run's examples: --hypothesis-seed={seed})"
        )


# --------------------------------------------------------------------------- MPI runs


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


# --------------------------------------------------------------------------- the timeout backstop


_BACKSTOP = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Arm the backstop; returning None lets pytest-timeout arm its own timer too."""
    limit = settings.timeout + TIMEOUT_GRACE
    timer = threading.Timer(limit, _hung, (item, limit))
    timer.daemon = True
    timer.name = f"gclip timeout backstop {item.nodeid}"
    item.stash[_BACKSTOP] = timer
    timer.start()


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_BACKSTOP, None)
    if timer is not None:
        timer.cancel()


def _hung(item, seconds: float) -> None:
    """Name the test, dump every thread's stack, end the process (from the timer thread)."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)  # so that what follows reaches the terminal
    comm = _world()
    who = f"[rank {comm.Get_rank()}] " if comm is not None else ""
    sys.stderr.write(
        f"\n{who}TIMEOUT: {item.nodeid} still running after {seconds:g} s, beyond the reach of "
        "SIGALRM; the stacks of every thread follow, then this process exits\n"
    )
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


# --------------------------------------------------------------------------- subprocesses


def mpirun(
    n: int,
    *args: str,
    timeout: int = MPIRUN_TIMEOUT,
    env: dict | None = None,
    check: bool = False,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mpirun -n N <args>`` under a timeout, with Hydra's own watchdog too.

    The package's own launcher (``gclip._lab.mpirun.run``): the venv's mpirun,
    started in a process group of its own; if it is still running
    ``timeout + 15`` s later, the whole job (launcher, proxies, ranks) is
    ended and the result has exit status 124, with a line saying so in stderr.
    """
    from gclip._lab import mpirun as launcher

    try:
        result = launcher.run(n, *args, timeout=timeout, env=env, input=input, grace=15)
    except launcher.MpirunNotFound:
        pytest.skip("no mpirun next to this Python nor on PATH")
    if (
        result.returncode == launcher.TIMED_OUT
        and launcher.HYDRA_TIMEOUT_LINE not in result.stdout + result.stderr
    ):
        result.stderr += (
            f"\nconftest.mpirun: still running after {timeout + 15} s; ended its whole process group\n"
        )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(result.args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def end_group(proc: subprocess.Popen, grace: float = 5.0) -> tuple[str, str]:
    """End a process started with ``start_new_session=True`` and everything in its group:
    SIGTERM (Hydra forwards it and cleans up), then SIGKILL for whatever is left.
    Returns what it wrote."""
    out = err = None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal_group(proc, sig)
        try:
            out, err = proc.communicate(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    _signal_group(proc, signal.SIGKILL)  # members that outlived the leader
    if out is None:  # the pipes are held open by a process outside the group
        proc.kill()
        proc.wait()
        return "", "(output lost: a process outside the group kept the pipes open)"
    return out or "", err or ""


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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


# --------------------------------------------------------------------------- the pytest-mpi tests' helpers


@pytest.fixture(scope="session")
def comm():
    """MPI's world, in the tests that run under mpirun (pytest-mpi)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def agree(comm, ok: bool, detail: str = "") -> None:
    """Assert on every rank that every rank's ``ok`` holds: all ranks pass or fail together,
    and the message names the ranks that failed."""
    verdicts = comm.allgather((bool(ok), detail))
    bad = [f"rank {r}: {d}" for r, (good, d) in enumerate(verdicts) if not good]
    assert not bad, "; ".join(bad)


# --------------------------------------------------------------------------- the compiled kernels


@pytest.fixture
def kernels():
    """The compiled kernels, or a skip where numba is missing (or GCLIP_KERNELS=0)."""
    from gclip import _kernels

    k = _kernels.get()
    if k is None:
        pytest.skip("numba is not installed here, or GCLIP_KERNELS=0")
    return k


@pytest.fixture
def numpy_only(monkeypatch):
    """Run a function with the kernels switched off (GCLIP_KERNELS=0), then back on."""
    from gclip import _kernels

    def run(fn):
        monkeypatch.setenv("GCLIP_KERNELS", "0")
        _kernels.get.cache_clear()
        try:
            return fn()
        finally:
            monkeypatch.delenv("GCLIP_KERNELS")
            _kernels.get.cache_clear()

    return run


# --------------------------------------------------------------------------- PyTorch

HAS_TORCH = importlib.util.find_spec("torch") is not None
NO_TORCH = "needs PyTorch, not installed (pip install '.[test,torch]')"
# a module that imports torch, or asks for it at its top level, needs it in every test
_MODULE_TORCH = re.compile(r"^(?:import torch\b|from torch\b|\S.*importorskip\(\s*[\"']torch[\"'])", re.M)
_FUNCTION_TORCH = re.compile(r"importorskip\(\s*[\"']torch[\"']")


def needs_torch(item: pytest.Item) -> bool:
    """Marked ``torch``, in a module that needs torch, or a test function that asks for it.

    Derived from the tests' own code, so the torch run (``scripts/test --torch``) finds
    every such test without a list to keep. A test that needs torch some other way (a
    subprocess, say) says so with ``@pytest.mark.torch``: without torch it skips, and the
    README's run (no torch) fails on it until it does."""
    if item.get_closest_marker("torch") is not None:
        return True
    return _mentions(getattr(item, "module", None), _MODULE_TORCH) or _mentions(
        getattr(item, "function", None), _FUNCTION_TORCH
    )


def _mentions(obj: object, pattern: re.Pattern) -> bool:
    if obj is None:
        return False
    try:
        source = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return pattern.search(source) is not None


def pytest_collection_modifyitems(config, items):
    """Mark every test that needs torch (``-m torch`` selects them); without torch they skip."""
    for item in items:
        if needs_torch(item):
            item.add_marker(pytest.mark.torch)
            if not HAS_TORCH:
                item.add_marker(pytest.mark.skip(reason=NO_TORCH))
