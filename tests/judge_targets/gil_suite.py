"""A user's suite whose clip holds the GIL forever on every rank (run under mpirun, never collected).

No watchdog thread can run: the last resort (faulthandler, which needs no
GIL) must end the job, printing where each rank was.
"""

import re

from mpi4py import MPI

from gclip.testing import assert_conforms


def holds_the_gil(grads, max_norm, comm):
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking, in C, with the GIL held
    return grads


def test_it_never_returns():
    assert_conforms(holds_the_gil, comm=MPI.COMM_WORLD, timeout=1)
