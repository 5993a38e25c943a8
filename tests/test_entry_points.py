"""Every ``python -m gclip.X`` answers --help and refuses an unknown flag, without mpirun.

Plain subprocesses (no launcher), each under a timeout: the commands must
parse their flags before they need MPI, or start MPI as a single process.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ENTRY_POINTS = ["demo", "train", "conformance", "bench", "classroom"]
ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_exits_0_with_usage(name):
    proc = _run(f"gclip.{name}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout
    assert "--help" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_an_unknown_flag_exits_2_in_one_line(name):
    proc = _run(f"gclip.{name}", "--no-such-flag")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gclip.{name}: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """``args`` run with a stdout nobody reads (as ``| head`` leaves it once it has its lines):
    the reader is gone before the first write, so every write fails."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, "", err.decode())


CLOSED_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a tool ended by a closed pipe
WITH_OUTPUT = {  # a run that prints -> its exit code with stdout closed
    "demo": (["--ranks", "4"], CLOSED_PIPE),
    "demo-bugs": (["--list-bugs"], CLOSED_PIPE),
    "train": (["--ranks", "2", "--steps", "5"], CLOSED_PIPE),
    "conformance": (["lab/my_clip.py:clip_shards", "--random", "2"], 1),  # the verdict: the starter fails
}


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_into_a_closed_pipe_is_quiet(name):
    proc = closed_stdout(f"gclip.{name}", "--help")
    assert (proc.returncode, proc.stderr) == (0, ""), proc  # argparse drops a help it cannot write


@pytest.mark.parametrize("name", list(WITH_OUTPUT))
def test_a_closed_pipe_ends_a_run_quietly(name):
    argv, code = WITH_OUTPUT[name]
    proc = closed_stdout(f"gclip.{name.split('-')[0]}", *argv)
    assert (proc.returncode, proc.stderr) == (code, ""), proc


def test_a_broken_pipe_not_of_stdout_is_still_a_fault():
    """A pipe of the command's own (a worker's) breaking is no reader's choice: a fault, said."""
    code = (
        "import sys; from gclip._lab.cli import entry\n"
        "def main(argv): raise BrokenPipeError(32, 'a worker pipe')\n"
        "entry('gclip.x', main)([])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "BrokenPipeError" in proc.stderr, proc


def test_console_scripts_point_at_the_entry_points():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
