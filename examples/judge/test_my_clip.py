"""Check your own distributed clip inside your own test suite (copy this file).

    mpirun -n 3 python -m pytest --with-mpi examples/judge/test_my_clip.py

Replace the import with your clip: a function (grads, max_norm, comm) that
returns the clipped list, or None after clipping in place.
"""

import pytest
from dist_good import clip  # your clip here
from mpi4py import MPI

from gclip.testing import assert_conforms


@pytest.mark.mpi(min_size=2)
def test_my_clip_conforms():
    assert_conforms(clip, comm=MPI.COMM_WORLD)
