"""gclip.ZClip, AutoClip and AGC over MPI ranks (pytest-mpi, 2 to 4 ranks): the same
decisions on every rank, and on a sharded gradient those of one process over the whole.

The oracle for ZClip and AutoClip: the same clipper on each rank over the gathered whole
gradient on COMM_SELF (reproducible=True: the same bits for any layout); for AGC,
the reference rule (timm's, tests/unit/test_adaptive.py) over the gathered whole rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import gclip
from conftest import agree
from unit.test_limits import timm_agc

pytestmark = pytest.mark.mpi(min_size=2)


def shards(rng, size: int, n: int, step: int):
    """A global vector of ``n`` values (spiking on some steps), cut into ``size`` shards."""
    whole = rng.normal(size=n) * (40.0 if step % 23 == 17 else 1.0)
    cuts = np.linspace(0, n, size + 1).astype(int)
    return whole, [whole[cuts[r] : cuts[r + 1]] for r in range(size)]


@pytest.mark.parametrize(
    "make", [lambda: gclip.ZClip(max_grad_norm=None), lambda: gclip.AutoClip(25.0, window=40)]
)
def test_adaptive_clippers_decide_on_shards_as_on_the_whole(make):
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)  # the same stream on every rank
    sharded, whole_run, seen, clipped = make(), make(), [], 0
    for step in range(120):
        whole, parts = shards(rng, comm.size, 1000, step)
        mine = sharded.step(parts[comm.rank], comm=comm, reproducible=True)
        alone = whole_run.step(whole, comm=MPI.COMM_SELF, reproducible=True)
        seen.append((mine.total_norm, mine.limit, mine.scale))
        ok = (mine.total_norm, mine.limit, mine.scale) == (alone.total_norm, alone.limit, alone.scale)
        agree(comm, ok, f"step {step}: {mine[1:]} against one process {alone[1:]}")
        clipped += mine.clipped
    every = comm.allgather(seen)
    agree(comm, all(theirs == every[0] for theirs in every), "ranks apart")
    agree(comm, 0 < clipped < 120, f"{clipped} clipped steps")
    state = comm.allgather(sharded.state_dict())
    agree(comm, all(s == state[0] for s in state), "states differ across ranks")


def test_agc_on_row_split_units_sums_each_unit_over_the_ranks():
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(1)
    weight, grad = rng.normal(size=(6, 4 * comm.size)), rng.normal(size=(6, 4 * comm.size))
    grad[::2] *= 1e-3  # half the units within their limit
    cols = slice(4 * comm.rank, 4 * comm.rank + 4)  # a row-parallel Linear: every row split over the ranks
    mine = gclip.AGC(0.05).step([weight[:, cols]], [grad[:, cols].copy()], split=[comm])[0]
    want = timm_agc([weight], [grad], 0.05)[0][:, cols]
    agree(comm, np.allclose(mine, want, rtol=1e-14, atol=0), "not the whole rows' rule")
    agree(
        comm,
        bool((mine != grad[:, cols]).any() and (mine == grad[:, cols]).any()),
        "nothing or everything clipped",
    )
    alone = gclip.AGC(0.05).step([weight[:, cols]], [grad[:, cols].copy()])[
        0
    ]  # the bug: each shard its own norm
    agree(comm, not np.allclose(alone, want, rtol=1e-6), "a shard's own norm happened to give the rule")
