"""A user's suite: one clip that conforms and one that does not (run under mpirun, never collected).

Each test prints one line per rank past pytest's capture, so the caller can
check that every rank saw the same verdict and the same message.
"""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from gclip.testing import assert_conforms


def _sumsq(grads):
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))


def global_clip(grads, max_norm, comm):
    norm = comm.allreduce(_sumsq(grads)) ** 0.5
    return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]


def max_of_norms(grads, max_norm, comm):
    norm = max(comm.allgather(_sumsq(grads) ** 0.5))
    return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]


@pytest.mark.mpi(min_size=2)
def test_conforming(capsys):
    assert_conforms(global_clip, comm=MPI.COMM_WORLD, random=10)
    with capsys.disabled():
        print(f"\nRANK {MPI.COMM_WORLD.Get_rank()} PASSED", flush=True)


@pytest.mark.mpi(min_size=2)
def test_not_conforming(capsys):
    with pytest.raises(AssertionError) as info:
        assert_conforms(max_of_norms, comm=MPI.COMM_WORLD, random=10)
    digest = hashlib.sha256(str(info.value).encode()).hexdigest()[:16]
    first = str(info.value).splitlines()[0]
    fingerprint = next(line for line in str(info.value).splitlines() if line.startswith("fingerprint:"))
    with capsys.disabled():
        # "|end" closes the line: the ranks share one stdout, and pytest's progress dots can land on it
        print(
            f"\nRANK {MPI.COMM_WORLD.Get_rank()} RAISED {digest} | {first} | {fingerprint} |end", flush=True
        )
