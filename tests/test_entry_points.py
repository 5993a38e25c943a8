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


def test_console_scripts_point_at_the_entry_points():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
