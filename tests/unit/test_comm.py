"""gclip.drivers.Comm: the Comm protocol is what the core needs of a communicator, and no more."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import gclip
from gclip.drivers import Comm


class Recording:
    """One rank, written against the protocol alone, recording what the core asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: Any = None) -> None:
        self.calls.append("Allreduce")
        recvbuf[...] = sendbuf

    def allgather(self, sendobj: Any) -> list[Any]:
        self.calls.append("allgather")
        return [sendobj]


def test_mpi4pys_communicator_is_a_comm():
    from mpi4py import MPI

    assert isinstance(MPI.COMM_SELF, Comm)
    assert not isinstance(object(), Comm)


def test_the_clip_runs_on_any_comm_with_one_collective():
    comm = Recording()
    values = np.array([3.0, 4.0, 12.0])
    result = gclip.clip_by_global_norm(values, 1.0, comm=comm)
    assert comm.calls == ["Allreduce"]
    assert result.total_norm == 13.0 and np.allclose(result.grads, values / 13.0, rtol=1e-15, atol=0)
    assert gclip.global_norm([values], comm=comm, norm_type=1) == math.fsum(values)
