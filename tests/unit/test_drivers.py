"""gclip.drivers: the one loop on a real rank (drive, Mpi on COMM_SELF) and R simulated ranks
in lockstep, checked against the tests' own lockstep driver and math.fsum."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gclip import GclipValueError, drivers, engine
from unit.test_engine import lockstep, programs


def _shards(size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(int(rng.integers(0, 9))) * 10.0 ** rng.integers(-3, 4) for _ in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_simulated_ranks_give_what_ranks_in_lockstep_give(size, p):
    shards = _shards(size, seed=size)
    got = drivers.run_simulated(programs(shards, p))
    want, _ = lockstep(programs(shards, p))
    assert got == want
    if p == 2.0:  # and the norm is the global one: fsum of every rank's squares
        exact = math.sqrt(math.fsum(float(v) ** 2 for s in shards for v in s))
        assert all(norm == pytest.approx(exact, rel=1e-14) for norm, _ in got)


def test_drive_answers_each_collective_with_the_functions_given():
    shards = _shards(1)
    asked = []

    def all_reduce(data, op):
        asked.append(("reduce", data.size, op))
        return data.copy()

    def all_gather(item):  # pragma: no cover - the default L2 path gathers nothing
        asked.append(("gather", item))
        return [item]

    norm, _ = drivers.drive(programs(shards)[0], all_reduce, all_gather)
    assert asked == [("reduce", engine.HEADER_SIZE, engine.NormOp.SUM)]  # the header: the one collective
    assert norm == pytest.approx(math.sqrt(math.fsum(float(v) ** 2 for v in shards[0])), rel=1e-14)


def test_mpi_on_one_rank_is_the_simulated_rank():
    from mpi4py import MPI

    shards = _shards(1, seed=4)
    for p in (2.0, math.inf):
        assert [drivers.Mpi(MPI.COMM_SELF).run(programs(shards, p)[0])] == drivers.run_simulated(
            programs(shards, p)
        )


def test_simulated_ranks_raise_the_agreed_error():
    shards = _shards(3)
    refused = [None, GclipValueError("bad input here"), None]
    with pytest.raises(GclipValueError, match=r"^rank 1 of 3: bad input here$"):
        drivers.run_simulated(programs(shards, refused=refused))
