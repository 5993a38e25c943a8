"""gclip.call: one rank's call as a pipeline (checks -> norm -> scale), on simulated ranks.

The programs are run by the test's own lockstep driver (tests/unit/test_engine.py), so each
rank's outcome is seen; the norm and the scale are checked against exact arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from gclip import GclipTypeError, call, drivers, engine
from unit.test_engine import lockstep


class FakeDriver:
    """A driver of one rank that answers each collective with this rank's own data."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.collectives: list[object] = []

    def run(self, program):
        return drivers.drive(program, self._reduce, lambda item: [item])

    def _reduce(self, data, op):
        self.collectives.append(op)
        return data.copy()


def exact_clip(shards, limit):
    """(norm, scale) of the shards' global L2 norm, from fractions: the oracle."""
    power = sum(Fraction(float(v)) ** 2 for s in shards for v in np.ravel(s))
    norm = math.sqrt(power)  # correctly rounded from the exact sum (< 2**53 here)
    return norm, min(Fraction(1), Fraction(limit) / Fraction(norm))


def test_the_pipeline_checks_reduces_and_scales_on_every_rank():
    shards = [np.array([3.0, 4.0]), np.array([12.0])]
    programs = [call.program(s, 1.0, rank=r, size=2) for r, s in enumerate(shards)]
    done, seen = lockstep(programs)
    norm, scale = exact_clip(shards, 1.0)
    assert len(seen) == 1  # the header is the one collective: the scale needs none
    for d, s in zip(done, shards):
        assert isinstance(d, call.Done)
        assert d.info.norm == norm == 13.0
        assert d.scale == float(scale)  # the exact quotient, rounded once
        assert np.array_equal(d.grads, s * d.scale)  # new arrays, in the layout given (one array)
        assert d.grads is not s


def test_a_norm_alone_scales_nothing():
    x = np.array([3.0, 4.0])
    (done,), _ = lockstep([call.program(x, call.NO_LIMIT, rank=0, size=1)])
    assert done.info.norm == 5.0 and done.scale == 1.0 and done.grads is None
    assert np.array_equal(x, [3.0, 4.0])


def test_a_refused_argument_is_raised_on_every_rank_together():
    shards = [np.ones(2), np.ones(2, dtype=np.int64)]  # rank 1's array is not a float array
    done, _ = lockstep([call.program(s, 1.0, rank=r, size=2) for r, s in enumerate(shards)])
    assert all(isinstance(d, GclipTypeError) for d in done), done
    assert len({str(d) for d in done}) == 1 and "rank 1" in str(done[0])


def test_run_hands_the_program_to_the_driver_and_scales_in_place():
    given = [np.array([6.0, 8.0], dtype=np.float32), np.array([0.0])]
    driver = FakeDriver()
    done = call.run(given, 5.0, driver, inplace=True)
    assert driver.collectives == [engine.NormOp.SUM]  # the header alone
    assert done.grads is given  # in place: the very list given
    assert done.info.norm == 10.0 and done.scale == 0.5
    assert np.array_equal(given[0], np.array([3.0, 4.0], dtype=np.float32))


def test_the_hook_replaces_the_scale_rule_and_nothing_else():
    hook = engine.Steps("halved", scale=lambda norm, limit: 0.5)
    (done,), _ = lockstep([call.program(np.array([3.0, 4.0]), 100.0, rank=0, size=1, steps=hook)])
    assert done.info.norm == 5.0 and done.scale == 0.5
    assert np.array_equal(done.grads, [1.5, 2.0])


@pytest.mark.parametrize("bad", ["x", 3])
def test_replicated_must_be_a_list(bad):
    (done,), _ = lockstep([call.program([np.ones(2)], 1.0, rank=0, size=1, replicated=bad)])
    assert isinstance(done, GclipTypeError) and "replicated must be a list" in str(done)
