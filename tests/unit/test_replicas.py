"""gclip.replicas: explain's rows and shares, check_replicas' verdicts, on simulated ranks.

The oracle for a share is exact rational arithmetic over the values (fractions): the
sum of x**p of one row over that of every row counted once."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from gclip import GclipTypeError, GclipValueError, Group, replicas


def exact_shares(rows_values, p: int = 2) -> list[float]:
    powers = [sum(abs(Fraction(float(v))) ** p for v in vals) for vals in rows_values]
    total = sum(powers)
    return [float(w / total) for w in powers]


@pytest.mark.parametrize("scale", [1.0, 1e200, 1e-200, 1e-310], ids=["plain", "huge", "tiny", "subnormal"])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_shares_are_exact_at_any_magnitude(scale, p):
    """Squares of 1e200 overflow and of 1e-200 underflow; the shares must not care."""
    a, b, c = np.array([3.0, 4.0]) * scale, np.array([1.0]) * scale, np.array([2.0, 2.0, 1.0]) * scale
    rows = replicas.explain_simulated([[a, b], [c]], norm_type=p)
    assert [r.name for r in rows] == ["grads[0]", "grads[1]", "grads[0]"]
    want = exact_shares([a, b, c], p)
    for row, share in zip(rows, want):
        assert math.isfinite(row.share)
        assert row.share == pytest.approx(share, rel=1e-13, abs=0), (row, share)
    assert math.fsum(r.share for r in rows) == pytest.approx(1.0, rel=1e-14)


def test_a_copy_counts_once_in_the_shares():
    copy, shard = np.array([1e200, 1e200]), np.array([2e200])
    group = [Group((0, 1), 0), Group((0, 1), 1)]
    rows = replicas.explain_simulated(
        [[copy.copy(), shard], [copy.copy(), shard * 0]], replicated=[[group[0], False], [group[1], False]]
    )
    assert [(r.ranks, r.counted_on) for r in rows] == [((0, 1), 0), ((0,), 0), ((1,), 1)]
    assert [r.share for r in rows] == pytest.approx(exact_shares([copy, shard, shard * 0]), rel=1e-14)


def test_inf_norm_share_goes_to_the_largest():
    rows = replicas.explain_simulated([[np.array([1e-300, -2e-300])], [np.array([1e-301])]], norm_type="inf")
    assert [r.share for r in rows] == [1.0, 0.0]
    assert rows[0].power == 2e-300


def test_a_nan_makes_every_share_nan_and_an_inf_only_its_own():
    rows = replicas.explain_simulated([[np.array([1.0, math.nan])], [np.array([1.0])]])
    assert all(math.isnan(r.share) for r in rows)
    rows = replicas.explain_simulated([[np.array([1.0, math.inf])], [np.array([1.0])]])
    assert math.isnan(rows[0].share) and rows[1].share == 0.0


def test_all_zero_gives_zero_shares():
    rows = replicas.explain_simulated([[np.zeros(3)], [np.zeros(2)]])
    assert [r.share for r in rows] == [0.0, 0.0]


def test_names_count_and_aliases():
    a = np.ones(2)
    rows = replicas.explain_simulated([[a, a]], names=[["embed", "head"]])
    assert [r.name for r in rows] == ["embed = head"]
    with pytest.raises(GclipValueError, match="names has 1 entries for 2 arrays"):
        replicas.explain_simulated([[a, np.ones(3)]], names=[["w"]])


def test_diverged_names_the_odd_rank():
    members = (0, 1, 2)
    same = [("w", members, 0, 7), ("b", (0,), 0, 1)]
    assert replicas.diverged([same, [("w", members, 0, 7)], [("w", members, 0, 7)]]) is None
    line = replicas.diverged([same, [("w", members, 0, 7)], [("w", members, 0, 8)]])
    assert line == "replicas of 'w' differ: rank 2 hold other values than rank 0 (group 0-2)"


def test_bad_norm_type_is_refused_with_its_type():
    with pytest.raises(GclipValueError, match="norm_type"):
        replicas.explain_simulated([[np.ones(2)]], norm_type=0)
    with pytest.raises(GclipTypeError, match="norm_type"):
        replicas.explain_simulated([[np.ones(2)]], norm_type=[2])
