"""Parallel layouts on simulated ranks: one exact norm for every layout of one model.

The oracle (layout_oracle) gathers every rank's pieces, keeps one per tensor
shard and sums with math.fsum; it never reads the groups declared to gclip.
The same checks run on real ranks in test_layout_mpi.py (1..4 ranks) and in
layouts_8.py (8 ranks, launched from here).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

import gclip
import layout_oracle
from conftest import ROOT, mpirun, venv_env
from gclip import Group, Mesh, replicas
from gclip._lab import transformer

# the 3-D layouts of 8 ranks, and MoE layouts (their own model: experts included)
DENSE_8 = [
    dict(pp=1, dp=8, tp=1),
    dict(pp=2, dp=2, tp=2),
    dict(pp=2, dp=1, tp=4),
    dict(pp=1, dp=2, tp=4),
    dict(pp=2, dp=4, tp=1),
]
MOE_8 = [dict(pp=2, dp=2, ep=2), dict(dp=2, ep=2, tp=2), dict(ep=4, tp=2), dict(pp=2, ep=4)]


def simulate(size: int, axes: dict, dtype=np.float64):
    """Every rank's clip arguments and pieces under a simulated mesh."""
    ranks, entries, names, pieces = [], [], [], []
    for r in range(size):
        arrays, reps, labels, mine = transformer.clip_arguments(Mesh((r, size), **axes), dtype)
        ranks.append(arrays)
        entries.append(reps)
        names.append(labels)
        pieces += mine
    return ranks, entries, names, pieces


@pytest.mark.parametrize("layouts", [DENSE_8, MOE_8], ids=["dense", "moe"])
def test_every_layout_of_one_model_has_the_same_norm(layouts):
    bits = set()
    for axes in layouts:
        ranks, entries, _, pieces = simulate(8, axes)
        ref = layout_oracle.norm(pieces)
        got = gclip.clip_simulated(ranks, 1.0, replicated=entries)
        assert len({r.total_norm for r in got}) == 1
        assert math.isclose(got[0].total_norm, ref, rel_tol=1e-12), axes
        exact = gclip.clip_simulated(ranks, 1.0, replicated=entries, reproducible=True)
        assert math.isclose(exact[0].total_norm, ref, rel_tol=2.3e-16), axes
        bits.add(exact[0].total_norm.hex())
    assert len(bits) == 1, bits


@pytest.mark.parametrize("p", [1.0, 3.0, math.inf])
def test_p_norms_count_every_element_once(p):
    for axes in (dict(pp=2, dp=2, tp=2), dict(dp=2, ep=2, tp=2)):
        ranks, entries, _, pieces = simulate(8, axes)
        got = gclip.clip_simulated(ranks, 1.0, replicated=entries, norm_type=p)[0].total_norm
        assert math.isclose(got, layout_oracle.norm(pieces, p), rel_tol=1e-12), (axes, p)


def test_the_overflow_rescue_works_with_groups():
    ranks, entries, _, pieces = simulate(8, dict(pp=2, dp=2, tp=2))
    for arrays in ranks:
        for a in arrays:
            a *= 1e300  # squares overflow: the scaled two-pass route
    for p in pieces:
        assert np.isfinite(p.array).all()
    ref = layout_oracle.norm([p._replace(array=p.array / 1e300) for p in pieces]) * 1e300
    got = gclip.clip_simulated(ranks, 1.0, replicated=entries)[0].total_norm
    assert math.isclose(got, ref, rel_tol=1e-12)


def test_every_array_is_scaled_exactly_once():
    """In place, with the tied embedding passed twice on one stage: each value times the scale, once."""
    for axes in (dict(pp=1, dp=2, tp=4), dict(pp=2, dp=2, tp=2)):
        ranks, entries, _, pieces = simulate(8, axes)
        before = [np.array(p.array) for p in pieces]
        results = gclip.clip_simulated(ranks, 0.5, replicated=entries, inplace=True)
        scale = results[0].scale
        assert 0 < scale < 1 and len({r.scale for r in results}) == 1
        for p, old in zip(pieces, before):
            assert np.array_equal(p.array, old * scale), p.name


def test_float32_and_bfloat_free_dtypes_follow_the_same_rule():
    ranks, entries, _, pieces = simulate(8, dict(pp=2, dp=2, tp=2), np.float32)
    got = gclip.clip_simulated(ranks, 1.0, replicated=entries)[0].total_norm
    assert math.isclose(got, layout_oracle.norm(pieces), rel_tol=1e-12)


def test_a_group_member_that_declares_differently_is_an_error_on_every_rank():
    ranks, entries, _, _ = simulate(8, dict(pp=2, dp=2, tp=2))
    entries[5][1] = False  # rank 5 calls its layer norm a shard
    with pytest.raises(gclip.GclipValueError, match=r"disagree on the copies they hold: rank 5 declare"):
        gclip.clip_simulated(ranks, 1.0, replicated=entries)
    ranks, entries, _, _ = simulate(4, dict(dp=2, tp=2))
    ranks[3][2] = ranks[3][2][:-1]  # rank 3's copy of a replicated shard is shorter
    with pytest.raises(gclip.GclipValueError, match=r"rank 3 declare"):
        gclip.clip_simulated(ranks, 1.0, replicated=entries)


def test_a_group_must_hold_this_rank():
    arrays = [[np.ones(3)], [np.ones(3)]]
    with pytest.raises(gclip.GclipValueError, match="is not member"):
        gclip.clip_simulated(arrays, 1.0, replicated=[[Group((0, 1), 0)], [Group((0, 1), 0)]])
    with pytest.raises(gclip.GclipValueError, match="not a set of ranks"):
        gclip.clip_simulated(arrays, 1.0, replicated=[[Group((0, 5), 0)], [Group((0, 5), 1)]])


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (dict(dp=3, tp=2), "dp=3 x tp=2 = 6 ranks, but the world has 8"),
        (dict(dp=2, xp=4), "unknown axis 'xp'"),
        (dict(dp=0), "whole number >= 1"),
        ({}, "at least one axis"),
    ],
)
def test_a_bad_mesh_is_one_line(axes, message):
    with pytest.raises(gclip.GclipValueError, match=message):
        Mesh((0, 8), **axes)


def test_mesh_coordinates_put_the_last_axis_fastest():
    coords = [Mesh((r, 8), pp=2, dp=2, tp=2).coords for r in range(8)]
    assert coords[1] == {"pp": 0, "dp": 0, "tp": 1}
    assert coords[2] == {"pp": 0, "dp": 1, "tp": 0}
    assert coords[4] == {"pp": 1, "dp": 0, "tp": 0}
    assert all(Mesh((r, 8), pp=2, dp=2, tp=2).rank_of() == r for r in range(8))
    m = Mesh((5, 8), pp=2, dp=2, tp=2)
    assert m.replicated("dp") == Group((5, 7), 0)
    assert m.replicated("dp", "tp") == Group((4, 5, 6, 7), 1)
    assert m.tied("pp", replicated=("dp",)) == Group((1, 3, 5, 7), 2)
    assert m.replicated() is False


def test_explain_names_who_counts_what():
    ranks, entries, names, pieces = simulate(8, dict(pp=2, dp=2, tp=2))
    rows = replicas.explain_simulated(ranks, replicated=entries, names=names)
    assert math.isclose(math.fsum(r.share for r in rows), 1.0, rel_tol=1e-12)
    assert len(rows) == len(layout_oracle.unique_pieces(pieces))
    embed = [r for r in rows if r.name == "embed"]
    assert [r.ranks for r in embed] == [(0, 2, 4, 6), (1, 3, 5, 7)]  # tied: both stages, both dp
    assert all(r.counted_on == r.ranks[0] for r in rows)
    ln = next(r for r in rows if r.name == "layers.0.ln1")
    assert ln.copies == 4 and ln.ranks == (0, 1, 2, 3)  # duplicated over tp and dp, stage 0


def test_the_layout_check_rides_in_the_header():
    """No collective is added: the default clip over a layout is still one all-reduce."""
    from gclip import engine

    ranks, entries, _, _ = simulate(4, dict(dp=2, tp=2))
    requests = []
    progs = []
    for r, (arrays, reps) in enumerate(zip(ranks, entries)):
        progs.append(engine.program(engine.check(arrays, 1.0, rank=r, size=4, replicated=reps)))
    for prog in progs:
        requests.append(next(prog))
    assert all(type(q) is engine.Reduce for q in requests)
    total = np.sum([q.data for q in requests], axis=0)
    for prog in progs:
        with pytest.raises(StopIteration):
            prog.send(total.copy())  # the header answered: every program is done


@pytest.mark.slow
def test_three_d_layouts_on_eight_real_ranks():
    proc = mpirun(8, sys.executable, str(ROOT / "tests" / "layouts_8.py"), timeout=300, env=venv_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: 5 dense layouts and 3 MoE layouts" in proc.stdout, proc.stdout + proc.stderr


def test_error_if_nonfinite_and_agreed_errors_work_with_groups():
    ranks, entries, _, _ = simulate(4, dict(dp=2, tp=2))
    ranks[1][2][0] = np.nan  # a shard that rank 1 counts (tp-rank 1 of the first replica)
    with pytest.raises(gclip.NonFiniteNormError, match="non-finite values on rank 1"):
        gclip.clip_simulated(ranks, 1.0, replicated=entries, error_if_nonfinite=True)
    got = gclip.clip_simulated(ranks, 1.0, replicated=entries)
    assert all(math.isnan(r.total_norm) and r.scale == 1.0 and not r.finite for r in got)
    ranks, entries, _, _ = simulate(4, dict(dp=2, tp=2))
    ranks[2][0] = ranks[2][0].astype(np.int64)  # a bad array on one rank: the same error everywhere
    with pytest.raises(gclip.GclipTypeError, match="rank 2 of 4"):
        gclip.clip_simulated(ranks, 1.0, replicated=entries)
