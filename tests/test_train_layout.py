"""The trainer with --layout: the MLP laid out over pp x dp x tp, each rank updating its own pieces.

The oracle is the trainer's single-rank run (every parameter on one rank, the
plain global clip): under --reproducible every layout of any world must give
the very same loss bits, since each element of the gradient counts once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import mpirun, venv_env

STEPS = ["--steps", "25", "--reproducible", "--json"]


def run(n: int, *args: str) -> dict:
    proc = mpirun(n, sys.executable, "-m", "gclip.train", *STEPS, *args, env=venv_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone() -> dict:
    return run(1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "layout"),
    [(4, "pp=2,tp=2"), (4, "dp=2,tp=2"), (4, "pp=2,dp=2"), (4, "tp=4"), (8, "pp=2,dp=2,tp=2")],
)
def test_losses_are_bit_identical_across_layouts(alone, n, layout):
    got = run(n, "--layout", layout)
    assert got["layout"] == layout
    assert got["losses"] == alone["losses"]  # floats from JSON: the same bits
    assert got["digest"] == alone["digest"]
    assert got["steps_any_rank_scaled_down"] == alone["steps_any_rank_scaled_down"] > 0


@pytest.mark.slow
def test_a_bug_on_a_layout_departs_from_the_correct_run(alone):
    got = run(4, "--layout", "dp=2,tp=2", "--buggy", "per-rank")
    assert got["correct"]["digest"] == alone["digest"]
    assert got["departs_at"] is not None
    assert max(got["update_norms"]) > 1.01 * got["max_norm"]  # per-rank lets the update past the limit


def simulated(n: int, *args: str) -> dict:
    """The trainer on ``n`` simulated ranks in one process (``--ranks``): no mpirun."""
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.train", *STEPS, "--ranks", str(n), *args],
        capture_output=True, text=True, env=venv_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("n", "layout"), [(4, "pp=2,tp=2"), (8, "pp=2,dp=2,tp=2")])
def test_simulated_ranks_take_a_layout_with_the_bits_of_one_rank(alone, n, layout):
    got = simulated(n, "--layout", layout)
    assert (got["layout"], got["ranks"]) == (layout, n)
    assert got["losses"] == alone["losses"] and got["digest"] == alone["digest"]


@pytest.mark.slow
def test_a_bug_on_a_simulated_layout_is_the_bug_on_real_ranks():
    """The simulated mesh is the real one's: a per-rank bug (the replicas drift apart) gives
    the real ranks' very bits."""
    args = ("--layout", "dp=2,tp=2", "--buggy", "per-rank")
    real, fake = run(4, *args), simulated(4, *args)
    assert fake["departs_at"] is not None
    for key in ("losses", "digest", "update_norms", "departs_at"):
        assert fake[key] == real[key], key
    assert fake["correct"]["digest"] == real["correct"]["digest"]


@pytest.mark.parametrize(
    ("layout", "message"),
    [("pp=3", "pp must be 1 or 2"), ("ep=1", "has no experts"), ("tp=2,dp=1", "but the world has 1")],
)
def test_a_layout_the_mlp_cannot_take_is_one_line_on_every_rank(layout, message):
    n = 3 if layout == "pp=3" else 1
    proc = mpirun(
        n,
        sys.executable,
        "-m",
        "gclip.train",
        "--steps",
        "1",
        "--layout",
        layout,
        env=venv_env(),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
