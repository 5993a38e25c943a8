"""The compiled kernels' tests again, compiled with numba's bounds checks on (NUMBA_BOUNDSCHECK=1):
any read past an array's end, even one whose value goes unused, raises IndexError there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_kernel_tests_pass_with_numba_bounds_checks(kernels, tmp_path):
    if os.environ.get("NUMBA_BOUNDSCHECK") == "1":
        pytest.skip("already running with NUMBA_BOUNDSCHECK=1")
    env = dict(
        os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path / "numba")
    )  # no cached code without checks
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        str(HERE / "test_kernels.py"),
    ]
    done = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
