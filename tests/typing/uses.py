"""Checked by mypy (scripts/test's type check), never run: the types a user's code sees.

The clip functions give back the layout given (an array, a list, a tuple), and the
communicator any object with the Comm protocol's methods."""

from __future__ import annotations

from typing import Any

import numpy as np
from typing_extensions import assert_type

import gclip
from gclip import drivers, engine
from gclip.comm import Comm

a = np.ones(3)
assert_type(gclip.apply_scale(a, 0.5), np.ndarray)
assert_type(gclip.apply_scale([a, a], 0.5), list[np.ndarray])
assert_type(gclip.apply_scale((a, a), 0.5), tuple[np.ndarray, ...])
assert_type(gclip.clip_with_norm([a], 1.0, 2.0), list[np.ndarray])
assert_type(gclip.clip_with_norm((a,), 1.0, 2.0, inplace=True), tuple[np.ndarray, ...])
assert_type(gclip.global_norm([a]), float)


class OneRank:
    """A communicator of one rank, written against the protocol alone."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: Any = None) -> None:
        recvbuf[...] = sendbuf

    def allgather(self, sendobj: Any) -> list[Any]:
        return [sendobj]


comm: Comm = OneRank()
program = engine.program(engine.check([a], 1.0, rank=0, size=1))
assert_type(drivers.Mpi(comm).run(program), tuple[float, float])
assert_type(gclip.global_norm([a], comm=comm), float)
assert_type(gclip.replicas.explain([a], comm=comm), list[gclip.replicas.Row])
