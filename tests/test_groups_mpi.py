"""gclip.clip_groups on real ranks (pytest-mpi, 2 to 4): each group's global norm (fsum
over the gathered shards, a replicated array once) and its own limit, from one header;
ranks that pass different numbers of groups or limits get one agreed error, none hangs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import gclip
from conftest import agree

pytestmark = pytest.mark.mpi(min_size=2)


def test_each_groups_global_norm_and_limit_on_every_rank():
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    shared = np.random.default_rng(99).normal(size=5)  # the same on every rank: counted once
    mine = [[rng.normal(size=30), shared.copy()], [rng.normal(size=(4, 4)).astype(np.float32) * 20]]
    got = gclip.clip_groups(mine, [0.5, None], comm=comm, replicated=[[False, True], [False]])
    every = comm.allgather(mine)
    norms = [
        math.sqrt(
            math.fsum(
                float(x) ** 2 for theirs in every for x in np.asarray(theirs[0][0], dtype=float).ravel()
            )
            + math.fsum(float(x) ** 2 for x in shared)
        ),
        math.sqrt(
            math.fsum(
                float(x) ** 2 for theirs in every for x in np.asarray(theirs[1][0], dtype=float).ravel()
            )
        ),
    ]
    ok = all(math.isclose(a, b, rel_tol=1e-14) for a, b in zip(got.norms, norms))
    agree(comm, ok, f"{got.norms} against {norms}")
    agree(comm, got.scales[0] == min(1.0, 0.5 / got.norms[0]) < 1.0 and got.scales[1] == 1.0, str(got.scales))
    agree(comm, comm.allgather(got.norms) == [got.norms] * comm.size, "ranks apart")


@pytest.mark.parametrize("where", ["groups", "limits"])
def test_ranks_that_disagree_get_one_error_on_every_rank(where):
    comm = MPI.COMM_WORLD
    odd = comm.rank == comm.size - 1
    groups = [[np.ones(3)], [np.ones(2)]] + ([[np.ones(1)]] if odd and where == "groups" else [])
    limits = [1.0] * len(groups) if where == "groups" else [1.0, 2.0 if odd else 3.0]
    try:
        gclip.clip_groups(groups, limits, comm=comm)
        message = ""
    except gclip.GclipValueError as exc:
        message = str(exc)
    agree(comm, "ranks disagree on the arguments" in message, message or "no error")
    agree(comm, len(set(comm.allgather(message))) == 1, "different messages")
