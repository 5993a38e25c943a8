"""gclip.testing.assert_conforms inside ``mpirun -n 3 python -m pytest --with-mpi``, as a user runs it.

The suites are tests/judge_targets/*_suite.py (not collected by the plain
suite). Every rank must see the same verdict; a hanging clip must end the
job with a message naming the ranks, within the time limit, leaving no rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gclip._lab import mpirun

TARGETS = Path(__file__).resolve().parent / "judge_targets"


def _pytest_mpi(n: int, suite: str, timeout: float = 300) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi"]
    args += ["-W", "error:gclip.testing.assert_conforms on 1 rank"]  # never said on several ranks
    return mpirun.run(n, *args, str(TARGETS / suite), timeout=timeout)


def test_assert_conforms_passes_and_fails_alike_on_every_rank():
    proc = _pytest_mpi(3, "verdict_suite.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(re.findall(r"RANK (\d) PASSED", proc.stdout)) == ["0", "1", "2"]
    raised = re.findall(r"RANK (\d) RAISED (\w+) \| (.*?) \| (.*?) \|end", proc.stdout)
    assert sorted(r[0] for r in raised) == ["0", "1", "2"]
    assert len({r[1:] for r in raised}) == 1, "the ranks' messages differ"
    _, _, first, fingerprint = raised[0]
    assert first == "gclip.testing.assert_conforms: max_of_norms on 3 ranks"
    assert fingerprint.startswith("fingerprint: max-of-norms:")


def test_on_one_rank_a_per_rank_clip_passes_but_with_a_warning():
    import numpy as np
    import pytest
    from mpi4py import MPI

    from gclip.testing import assert_conforms

    def per_rank(grads, max_norm, comm):  # each rank by its own norm: the global one on 1 rank
        norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads)))
        return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]

    with pytest.warns(UserWarning) as caught:
        assert_conforms(per_rank, comm=MPI.COMM_SELF, random=3)
    (warning,) = caught
    assert str(warning.message).startswith("gclip.testing.assert_conforms on 1 rank: a per-rank clip")
    assert "\n" not in str(warning.message) and warning.filename == __file__
    # on 3 ranks it never warns: the suites run with this warning as an error (_pytest_mpi)


def test_a_hanging_clip_aborts_the_suite_with_the_ranks_named():
    proc = _pytest_mpi(3, "hang_suite.py", timeout=120)
    assert proc.returncode not in (0, mpirun.TIMED_OUT), proc.stdout[-4000:] + proc.stderr[-4000:]
    message = (
        "gclip.testing.assert_conforms(skips_when_empty): contract N=1: norm spans two shards: "
        "rank 2 returned without entering the collective; ranks 0, 1 waited in allreduce (ended after 3 s)"
    )
    assert message in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count(message) == 1  # said once, by rank 0
    # named as the command names it: the rank that skipped is the one with nothing to clip
    assert message + " (fingerprint: skip-collective" in proc.stderr
    left = subprocess.run(["pgrep", "-f", str(TARGETS / "hang_suite.py")], capture_output=True, text=True)
    assert left.stdout == ""


def test_a_collective_skipped_on_comm_world_is_named_too():
    proc = _pytest_mpi(3, "hang_world_suite.py", timeout=120)
    assert proc.returncode not in (0, mpirun.TIMED_OUT), proc.stdout[-4000:] + proc.stderr[-4000:]
    message = (
        "gclip.testing.assert_conforms(skips_on_world): contract N=1: norm spans two shards: "
        "rank 2 returned without entering the collective; ranks 0, 1 waited in allreduce (ended after 3 s)"
    )
    assert proc.stderr.count(message) == 1, proc.stderr[-4000:]
    left = subprocess.run(
        ["pgrep", "-f", str(TARGETS / "hang_world_suite.py")], capture_output=True, text=True
    )
    assert left.stdout == ""


def test_a_clip_that_holds_the_gil_still_ends_the_job():
    proc = _pytest_mpi(2, "gil_suite.py", timeout=180)
    assert proc.returncode not in (0, mpirun.TIMED_OUT), proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Timeout (0:00:11)!" in proc.stderr  # faulthandler, after the timeout (1 s) and its grace
    assert "in holds_the_gil" in proc.stderr  # where the rank was
    left = subprocess.run(["pgrep", "-f", str(TARGETS / "gil_suite.py")], capture_output=True, text=True)
    assert left.stdout == ""
