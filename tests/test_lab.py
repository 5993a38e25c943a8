"""The lab's shared helpers (gclip._lab): each written once, each checked here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import ROOT, venv_env
from gclip._lab import cli, jsonout, mpirun, vectors

# ---------------------------------------------------------------------------
# flags


def test_parse_max_norm_is_the_librarys_check_as_a_usage_error():
    assert cli.parse_max_norm("2.5") == 2.5
    assert cli.parse_max_norm("0") == 0.0
    for bad, why in [("-1", "finite and >= 0"), ("inf", "finite"), ("nan", "finite"), ("one", "a number")]:
        with pytest.raises(cli.UsageError, match=why) as info:
            cli.parse_max_norm(bad)
        assert str(info.value).startswith("--max-norm ")
    with pytest.raises(cli.UsageError, match=r"^--limit must"):
        cli.parse_max_norm("x", "--limit")


def test_check_writable(tmp_path):
    cli.check_writable("--json", str(tmp_path / "out.json"))
    with pytest.raises(cli.UsageError, match=r"^--plot: cannot write .*no such writable folder"):
        cli.check_writable("--plot", str(tmp_path / "missing" / "x.png"))


# ---------------------------------------------------------------------------
# the entry point: exit codes and one line each

ENTRY = """
import sys
from gclip._lab import cli
from gclip.errors import GclipValueError

def main(argv):
    what = argv[0]
    if what == "usage":
        raise cli.UsageError("bad\\n  flag")
    if what == "agreed":
        raise GclipValueError("")
    if what == "fault":
        raise RuntimeError("broken\\nthing")
    if what == "interrupt":
        raise KeyboardInterrupt
    return int(what)

on_fault = cli.internal_error if sys.argv[1] == "judge" else cli.abort_job
cli.entry("prog", main, on_fault=on_fault)(sys.argv[2:])
"""


@pytest.mark.parametrize(
    "kind,what,code,line",
    [
        ("mpi", "0", 0, None),
        ("mpi", "1", 1, None),
        ("mpi", "usage", 2, "prog: error: bad flag"),
        ("mpi", "agreed", 2, "prog: error: GclipValueError"),
        ("mpi", "fault", 1, "prog: rank 0 of 1: RuntimeError: broken thing; aborting the job"),
        ("mpi", "interrupt", 130, "prog: rank 0 of 1: interrupted; aborting the job"),
        ("judge", "1", 1, None),  # the judge's "fails"
        ("judge", "usage", 2, "prog: error: bad flag"),
        ("judge", "fault", 3, "prog: internal error: RuntimeError: broken thing"),
        ("judge", "interrupt", 130, "prog: interrupted"),
    ],
)
def test_entry_exit_codes_and_one_line(kind, what, code, line):
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY, kind, what], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.splitlines() == ([line] if line else []), proc.stderr


# ---------------------------------------------------------------------------
# no MPI on the machine: a stub mpi4py that cannot be imported, first on the path

NO_MPI = "libmpi.so.12: cannot open shared object file"


@pytest.fixture
def no_mpi(tmp_path) -> dict:
    """The environment of a machine where mpi4py cannot be loaded (e.g. Windows without MPI)."""
    stub = tmp_path / "stub" / "mpi4py"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(f"raise ImportError({NO_MPI!r})\n")
    env = venv_env()
    env["PYTHONPATH"] = str(stub.parent) + os.pathsep + env["PYTHONPATH"]
    env["NO_COLOR"] = "1"
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    return env


def _run(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def test_the_stub_hides_mpi(no_mpi):
    proc = _run(no_mpi, "-c", "from mpi4py import MPI")
    assert proc.returncode == 1 and NO_MPI in proc.stderr


@pytest.mark.parametrize(
    "argv,shows",
    [
        (["gclip.demo", "--ranks", "4", "--seed", "7", "--buggy"], "simulated in this one process"),
        (["gclip.demo", "--ranks", "2", "--mystery", "3", "--json"], '"mystery":3'),
        (["gclip.demo", "--help"], "--ranks R"),
        (["gclip.demo", "--list-bugs"], "gclip bug gallery"),
        (["gclip.train", "--ranks", "2", "--steps", "3", "--buggy"], "final loss"),
        (["gclip.train", "--help"], "--ranks R"),
    ],
)
def test_simulated_ranks_help_and_the_gallery_need_no_mpi(no_mpi, argv, shows):
    proc = _run(no_mpi, "-m", *argv)
    assert proc.returncode == 0, proc.stderr
    assert shows in proc.stdout and proc.stderr == ""


@pytest.mark.parametrize("prog", ["gclip.demo", "gclip.train"])
def test_real_ranks_without_mpi_say_so_in_one_line(no_mpi, prog):
    proc = _run(no_mpi, "-m", prog)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: MPI cannot be loaded") and NO_MPI in lines[0]
    assert f"python -m {prog} ... --ranks 4" in lines[0]


CANNOT_LOAD = (
    "cannot load MPI library"  # mpi4py's error where its library will not load (Windows without MS-MPI)
)


@pytest.fixture
def mpi_will_not_load(tmp_path) -> dict:
    """mpi4py is there, but its MPI library will not load: ``from mpi4py import MPI`` raises
    RuntimeError, as mpi4py's own wheel does on a machine without an MPI library."""
    stub = tmp_path / "stub" / "mpi4py"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "MPI.py").write_text(f"raise RuntimeError({CANNOT_LOAD!r} + ': msmpi.dll')\n")
    env = venv_env()
    env["PYTHONPATH"] = str(stub.parent) + os.pathsep + env["PYTHONPATH"]
    env["NO_COLOR"] = "1"
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    return env


@pytest.mark.parametrize("prog", ["gclip.demo", "gclip.train"])
def test_an_mpi_library_that_will_not_load_suggests_ranks_in_one_line(mpi_will_not_load, prog):
    proc = _run(mpi_will_not_load, "-m", prog)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{prog}: error: MPI cannot be loaded (RuntimeError: {CANNOT_LOAD}: msmpi.dll); without MPI, "
        f"simulate the ranks in this one process: python -m {prog} ... --ranks 4"
    ]
    simulated = _run(
        mpi_will_not_load, "-m", prog, "--ranks", "2", *(["--steps", "2"] if "train" in prog else [])
    )
    assert simulated.returncode == 0 and simulated.stderr == "", simulated.stderr  # and the hint works


NO_LAUNCHER = """
import sys
import gclip._lab.mpirun as m
m.shutil.which = lambda *args, **kwargs: None  # no mpirun next to this Python, nor on PATH
from gclip.conformance.command import main
main(sys.argv[1:])
"""


def test_the_distributed_judge_without_mpirun_says_how_to_judge_without_mpi(no_mpi):
    """No launcher is no internal error: one line, exit 2, and the way without MPI, which works."""
    proc = _run(no_mpi, "-c", NO_LAUNCHER, "lab/distributed/my_clip.py:clip", "--ranks", "4")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0], proc.stderr
    assert lines[0].startswith("gclip.conformance: error: no mpirun next to ")
    assert "pip install mpich" in lines[0] and "Linux and macOS" in lines[0]
    advised = lines[0].split("without MPI, judge a single-process function (no --ranks), e.g. ")[1]
    assert advised == "python -m gclip.conformance lab/my_clip.py:clip_shards"
    judged = _run(no_mpi, *advised.split()[1:], "--random", "5")
    assert judged.returncode == 1 and "fingerprint: per-rank" in judged.stdout  # the starter: judged


def test_the_single_process_judge_needs_no_mpi(no_mpi):
    proc = _run(no_mpi, "-m", "gclip.conformance", "lab/my_clip.py:clip_shards", "--random", "5")
    assert proc.returncode == 1 and proc.stderr == ""  # 1: the starter file fails, as it should
    assert "fingerprint: per-rank" in proc.stdout


def test_a_fault_without_mpi_is_one_line(no_mpi):
    proc = _run(no_mpi, "-c", ENTRY, "mpi", "fault")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["prog: rank 0 of 1: RuntimeError: broken thing; aborting the job"]


# ---------------------------------------------------------------------------
# JSON


def test_jsonable_writes_non_finite_floats_as_strings_at_any_depth():
    data = {
        "a": [1.0, math.inf, (-math.inf, np.float32("nan"))],
        "b": {"c": np.float64(2.5), "d": np.bool_(True), "e": np.int64(3)},
        "f": None,
    }
    assert jsonout.jsonable(data) == {
        "a": [1.0, "inf", ["-inf", "nan"]],
        "b": {"c": 2.5, "d": True, "e": 3},
        "f": None,
    }
    text = jsonout.dumps(data, separators=(",", ":"))
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert float(back["a"][1]) == math.inf and math.isnan(float(back["a"][2][1]))


def test_dumps_passes_options_through():
    assert jsonout.dumps({"x": [1, 2]}, indent=1) == '{\n "x": [\n  1,\n  2\n ]\n}'


# ---------------------------------------------------------------------------
# vectors


def test_vector_norm():
    assert vectors.vector_norm(np.array([3.0, -4.0]), 2.0) == 5.0
    assert vectors.vector_norm(np.array([3.0, -4.0]), 1.0) == 7.0
    assert vectors.vector_norm(np.array([3.0, -4.0]), math.inf) == 4.0
    assert vectors.vector_norm(np.zeros(0), 2.0) == 0.0
    assert vectors.vector_norm(np.zeros(3), 2.0) == 0.0
    # a plain sum of squares overflows (1e400) or underflows to 0 (1e-400): scaled first, neither does
    assert vectors.vector_norm(np.array([3e200, 4e200]), 2.0) == pytest.approx(5e200, rel=1e-15)
    assert vectors.vector_norm(np.array([3e-200, 4e-200]), 2.0) == pytest.approx(5e-200, rel=1e-15)
    assert vectors.vector_norm(np.array([1.0, math.inf]), 2.0) == math.inf
    assert math.isnan(vectors.vector_norm(np.array([1.0, math.nan]), 2.0))


def test_cosine_one_rule_none_when_undefined():
    a = np.array([1.0, 2.0, 3.0])
    assert vectors.cosine(a, 2.5 * a) == 1.0
    assert vectors.cosine(a, -a) == -1.0
    assert vectors.cosine(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == 0.0
    assert vectors.cosine(np.array([1e300, 1e300]), np.array([1e300, 0.0])) == pytest.approx(math.sqrt(0.5))
    for zero_or_bad in (np.zeros(3), np.array([1.0, math.inf, 0.0]), np.array([math.nan, 1.0, 0.0])):
        assert vectors.cosine(zero_or_bad, a) is None
        assert vectors.cosine(a, zero_or_bad) is None
    assert vectors.cosine(np.zeros(0), np.zeros(0)) is None


# ---------------------------------------------------------------------------
# mpirun


def test_find_mpirun_prefers_the_one_next_to_this_python():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(here):
        pytest.skip("no mpirun next to this Python")
    assert mpirun.find_mpirun() == here


def test_find_mpirun_says_so_when_there_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mpirun.MpirunNotFound, match="no mpirun"):
        mpirun.find_mpirun()


def test_child_env_leaves_the_parent_job_behind():
    parent = {"PMI_RANK": "1", "PMIX_RANK": "1", "HYDRA_X": "y", "OMPI_COMM_WORLD_SIZE": "2", "HOME": "/h"}
    env = mpirun.child_env(30, {**parent, "MPIEXEC_TIMEOUT": "999"})
    assert env == {"HOME": "/h", "MPIEXEC_TIMEOUT": "30"}
    assert mpirun.child_env(2.5, {})["MPIEXEC_TIMEOUT"] == "3"  # whole seconds, never less


def _need_mpirun() -> None:
    try:
        mpirun.find_mpirun()
    except mpirun.MpirunNotFound:
        pytest.skip("no mpirun")


@pytest.mark.slow
def test_run_returns_the_output_and_passes_input_and_env():
    _need_mpirun()
    code = "import os, sys; print(sys.stdin.read().upper(), os.environ.get('X'), os.environ.get('PMI_X'))"
    proc = mpirun.run(1, sys.executable, "-c", code, timeout=60, input="hello", env={"X": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["HELLO", "1", "None"]


@pytest.mark.slow
def test_run_reports_hydras_timeout_line_as_a_timeout():
    _need_mpirun()
    proc = mpirun.run(1, sys.executable, "-c", "print('APPLICATION TIMED OUT')", timeout=60)
    assert proc.returncode == mpirun.TIMED_OUT


@pytest.mark.slow
def test_run_kills_a_hung_job_and_every_rank(tmp_path):
    """Hydra's own watchdog switched off: the kill after the grace period must end mpirun and the ranks."""
    _need_mpirun()
    code = textwrap.dedent(
        f"""
        import os, time
        open(os.path.join({str(tmp_path)!r}, str(os.getpid())), "w").close()  # a file, not stdout:
        time.sleep(300)                                                        # the kill may cut output
        """
    )
    start = time.monotonic()
    proc = mpirun.run(2, sys.executable, "-c", code, timeout=15, grace=1, env={"MPIEXEC_TIMEOUT": "600"})
    assert proc.returncode == mpirun.TIMED_OUT
    assert time.monotonic() - start < 60
    pids = [int(f.name) for f in tmp_path.iterdir()]
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 10
    while [p for p in pids if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)], "a rank outlived the timeout"


def _running(pid: int) -> bool:
    """True if the process exists and is not a zombie (killed, waiting for its parent to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = subprocess.run(
            ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return True
    return bool(stat.stdout.strip()) and not stat.stdout.strip().startswith("Z")
