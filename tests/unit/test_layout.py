"""gclip.layout: who counts which array, on simulated ranks, against norms summed by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import gclip
from gclip import GclipTypeError, Group, Mesh, replicas


def exact_l2(values) -> float:
    """sqrt of the exact sum of squares (fractions), correctly rounded enough for rel 1e-15."""
    total = sum(Fraction(float(v)) ** 2 for v in values)
    return math.sqrt(float(total))


def test_a_none_entry_is_refused_not_counted_as_a_shard():
    """None is what Mesh.tied / Mesh.entry give on a rank without a copy; counting such an
    array as a shard would count it once per rank (2 ranks: 2.83 instead of 2)."""
    ranks = [[np.ones(4)], [np.ones(4)]]
    with pytest.raises(GclipTypeError, match=r"replicated\[0\] is None \(no copy") as caught:
        gclip.clip_simulated(ranks, 1.0, replicated=[None])
    assert "\n" not in str(caught.value)
    with pytest.raises(GclipTypeError, match=r"replicated\[1\] is None"):
        two = [[np.ones(4), np.ones(2)], [np.ones(4), np.ones(2)]]
        gclip.clip_simulated(two, 1.0, replicated=[[False, None], [False, None]])


def test_a_none_entry_is_refused_by_explain_too():
    with pytest.raises(GclipTypeError, match=r"replicated\[0\] is None"):
        replicas.explain_simulated([[np.ones(4)], [np.ones(4)]], replicated=[[None], [None]])


def test_tied_gives_none_off_its_stages_and_the_clip_without_that_array_counts_once():
    size = 4
    meshes = [Mesh((r, size), pp=4) for r in range(size)]
    entries = [m.tied("pp") for m in meshes]
    assert entries[1] is None and entries[2] is None
    assert entries[0] == Group((0, 3), 0) and entries[3] == Group((0, 3), 1)
    embed = np.arange(1.0, 5.0)
    ranks = [[embed.copy()] if e is not None else [] for e in entries]
    reps = [[e] if e is not None else [] for e in entries]
    got = gclip.clip_simulated(ranks, 1.0, replicated=reps)
    assert len({r.total_norm for r in got}) == 1
    assert got[0].total_norm == pytest.approx(exact_l2(embed), rel=1e-15)


@pytest.mark.parametrize("flag", [False, np.bool_(False)])
def test_false_is_a_shard_counted_on_its_rank(flag):
    shards = [np.full(3, 1.0), np.full(5, 2.0)]
    got = gclip.clip_simulated([[s] for s in shards], 1.0, replicated=[flag])
    assert got[0].total_norm == pytest.approx(exact_l2(np.concatenate(shards)), rel=1e-15)


def test_true_counts_once_for_any_rank_count():
    copy = np.array([3.0, 4.0])
    for size in (1, 2, 3, 5):
        got = gclip.clip_simulated([[copy.copy()] for _ in range(size)], 100.0, replicated=[True])
        assert got[0].total_norm == 5.0
