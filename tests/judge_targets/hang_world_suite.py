"""A user's suite whose clip skips a collective on COMM_WORLD (run by test_judge_testing.py, never collected).

The clip ignores the communicator it is given and calls MPI.COMM_WORLD, as
much real code does; rank 2 holds no arrays in the first case and returns
before that all-reduce. The watchdog must name the ranks as for the comm given.
"""

import numpy as np
import pytest
from mpi4py import MPI

from gclip.testing import assert_conforms


def skips_on_world(grads, max_norm, comm):
    if not grads:
        return None
    norm = MPI.COMM_WORLD.allreduce(float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))) ** 0.5
    for g in grads:
        g *= min(1.0, max_norm / norm) if norm > 0 else 1.0


@pytest.mark.mpi(min_size=3)
def test_it_hangs():
    assert_conforms(skips_on_world, comm=MPI.COMM_WORLD, timeout=3)
