"""The fast lane's MPI smoke test: the clip on real ranks (2 in ``scripts/test --fast``, any
count in the full matrix) against math.fsum over every rank's gathered values."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gclip

pytestmark = pytest.mark.mpi(min_size=1)


def test_the_clip_on_real_ranks_matches_the_gathered_oracle_and_agrees_on_errors():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        mine = np.random.default_rng(rank).standard_normal(50 + 7 * rank)
        shared = np.array([2.0, -1.0])  # the same on every rank: it counts once
        result = gclip.clip_by_global_norm([mine, shared.copy()], 1.0, comm=comm, replicated=[False, True])
        values = [v for part in comm.allgather(mine.tolist()) for v in part] + shared.tolist()
        norm = math.sqrt(math.fsum(v * v for v in values))
        seen = comm.allgather((result.total_norm, result.scale))
        assert len(set(seen)) == 1, seen
        assert result.total_norm == pytest.approx(norm, rel=1e-14)
        assert np.allclose(result.grads[0], mine * min(1.0, 1.0 / norm), rtol=1e-15, atol=0)
        bits = comm.allgather(gclip.global_norm(mine, comm=comm, reproducible=True).hex())
        assert len(set(bits)) == 1, bits
        limit = -1.0 if rank == size - 1 else 1.0  # refused on one rank: every rank raises it
        try:
            gclip.clip_by_global_norm(mine, limit, comm=comm)
            raised = ""
        except gclip.GclipValueError as exc:
            raised = str(exc)
        every = comm.allgather(raised)
        assert len(set(every)) == 1 and f"rank {size - 1} of {size}" in every[0], every
    finally:
        comm.Free()
