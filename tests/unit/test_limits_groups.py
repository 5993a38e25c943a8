"""gclip.clip_groups: each group's global norm from the one header all-reduce, each group
scaled by its own limit. Oracles: math.fsum over each group's squares (gathered over the
simulated ranks), the collectives counted as the program yields them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import gclip
from gclip import drivers, engine
from gclip.limits import groups


def fsum_norm(arrays) -> float:
    return math.sqrt(
        math.fsum(float(x) ** 2 for a in arrays for x in np.asarray(a, dtype=np.float64).ravel())
    )


def data(rng):
    return [
        [rng.normal(size=40), rng.normal(size=(3, 5)).astype(np.float32)],  # an AdamW-like group
        [rng.normal(size=200) * 30.0],  # a large-norm group (Muon's matrices)
        [rng.normal(size=7) * 1e-3],
    ]


def test_each_group_is_scaled_by_its_own_limit_and_norm():
    rng = np.random.default_rng(0)
    given = data(rng)
    limits = [1.0, None, 10.0]
    got = gclip.clip_groups(given, limits, comm=MPI.COMM_SELF)
    for g, (arrays, limit) in enumerate(zip(given, limits)):
        norm = fsum_norm(arrays)
        assert math.isclose(got.norms[g], norm, rel_tol=1e-15)
        want = 1.0 if limit is None else min(1.0, limit / norm)
        assert math.isclose(got.scales[g], want, rel_tol=2e-16)
        for before, after in zip(arrays, got.grads[g]):
            assert after.dtype == before.dtype
            np.testing.assert_allclose(
                after, before.astype(np.float64) * want, rtol=1e-7 if before.dtype == np.float32 else 1e-15
            )
    assert got.scales[0] < 1.0 and got.scales[1] == 1.0 and got.scales[2] == 1.0  # clipped, reported, within


@pytest.mark.parametrize("settings", [{}, {"reproducible": True}, {"norm_type": "inf"}, {"norm_type": 1.0}])
def test_every_groups_norm_from_one_collective_on_simulated_ranks(settings):
    """R=3 simulated ranks, each holding a shard of every group: one collective (two for the
    inf-norm and the reproducible mode, as for one group), and each group's norm that of
    the gathered group."""
    rng = np.random.default_rng(1)
    ranks = [data(rng) for _ in range(3)]
    limits = [1.0, None, 0.5]
    programs, yielded = [], []

    def counted(program):
        got = None
        while True:
            try:
                step = program.send(got)
            except StopIteration as done:
                return done.value
            yielded.append(type(step).__name__)
            got = yield step

    calls_by_rank = []
    for r, theirs in enumerate(ranks):
        calls = [
            engine.check(g, engine.NO_LIMIT if lim is None else lim, rank=r, size=3, **settings)
            for g, lim in zip(theirs, limits)
        ]
        calls_by_rank.append(calls)
        programs.append(
            counted(
                groups.program(calls, [c.limit if lim is not None else None for c, lim in zip(calls, limits)])
            )
        )
    results = drivers.run_simulated(programs)
    second = settings.get("reproducible") or settings.get("norm_type") == "inf"  # as for one group's clip
    assert yielded.count("Reduce") == 3 * (2 if second else 1), yielded  # 3 ranks, each its own
    p = settings.get("norm_type", 2.0)
    for g in range(3):
        values = np.concatenate(
            [np.asarray(a, dtype=np.float64).ravel() for theirs in ranks for a in theirs[g]]
        )
        if p == "inf":
            want = float(np.max(np.abs(values)))
        elif p == 1.0:
            want = math.fsum(np.abs(values).tolist())
        else:
            want = math.sqrt(math.fsum((values * values).tolist()))
        for r in range(3):
            assert math.isclose(results[r][g][0], want, rel_tol=1e-14), (g, r, results[r][g][0], want)
    assert results[0] == results[1] == results[2]


def test_one_group_gives_clip_by_global_norms_bits():
    rng = np.random.default_rng(2)
    arrays = [rng.normal(size=1000) * 7.0, rng.normal(size=33).astype(np.float32)]
    one = gclip.clip_by_global_norm(arrays, 2.0, comm=MPI.COMM_SELF)
    both = gclip.clip_groups([arrays], [2.0], comm=MPI.COMM_SELF)
    assert (both.norms[0], both.scales[0]) == (one.total_norm, one.scale)
    for a, b in zip(one.grads, both.grads[0]):
        assert a.tobytes() == b.tobytes()


def test_a_group_that_overflows_is_rescued_alone():
    big = [np.array([1e200, 1e200])]
    got = gclip.clip_groups([big, [np.array([3.0, 4.0])]], [None, 1.0], comm=MPI.COMM_SELF)
    assert math.isclose(got.norms[0], math.sqrt(2) * 1e200, rel_tol=1e-15) and got.norms[1] == 5.0


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: gclip.clip_groups([[np.ones(2)]], [1.0, 2.0], comm=MPI.COMM_SELF), "one entry per group"),
        (lambda: gclip.clip_groups([[np.ones(2)]] * 65, [1.0] * 65, comm=MPI.COMM_SELF), "at most 64 groups"),
        (lambda: gclip.clip_groups([[np.ones(2)], ["x"]], [1.0, 1.0], comm=MPI.COMM_SELF), "rank 0 of 1"),
        (lambda: gclip.clip_groups([[np.ones(2)]], [-1.0], comm=MPI.COMM_SELF), "max_norm"),
    ],
)
def test_bad_groups_get_one_line(call, needle):
    with pytest.raises(gclip.GclipError) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_clipper_per_group_decides_from_its_groups_norm_as_it_would_alone():
    """ZClip on one group, AutoClip on another, none on the third (Muon's): 40 steps with
    spikes. Oracle: the same clippers stepped alone on their group (each checked against its
    reference rule in tests/unit/test_limits.py), bit for bit, state included."""
    rng = np.random.default_rng(3)
    zclip, autoclip = gclip.ZClip(warmup_steps=5), gclip.AutoClip(25.0)
    lone_z, lone_a = gclip.ZClip(warmup_steps=5), gclip.AutoClip(25.0)
    clipped = 0
    for step in range(40):
        given = data(rng)
        if step in (12, 30):
            given[0] = [a * 40.0 for a in given[0]]  # a spike in the AdamW-like group
        got = gclip.clip_groups(given, [zclip, None, autoclip], comm=MPI.COMM_SELF)
        want_z = lone_z.step(given[0], comm=MPI.COMM_SELF)
        want_a = lone_a.step(given[2], comm=MPI.COMM_SELF)
        assert (got.norms[0], got.scales[0]) == (want_z.total_norm, want_z.scale)
        assert (got.norms[2], got.scales[2]) == (want_a.total_norm, want_a.scale)
        assert got.scales[1] == 1.0 and got.norms[1] == gclip.global_norm(given[1], comm=MPI.COMM_SELF)
        for a, b in zip(got.grads[0] + got.grads[2], list(want_z.grads) + list(want_a.grads)):
            assert a.tobytes() == b.tobytes()
        clipped += want_z.clipped
    assert clipped >= 2  # the spikes, at least: not a vacuous agreement
    assert zclip.state_dict() == lone_z.state_dict() and autoclip.state_dict() == lone_a.state_dict()


def test_ranks_passing_a_clipper_and_a_number_for_one_group_get_one_agreed_error():
    """A clipper's limit is decided after the collective: the ranks agree in the header on
    which groups have one (by name), so a rank passing 1.0 where another passes ZClip fails
    on every rank instead of scaling the group differently."""
    rng = np.random.default_rng(4)
    programs = []
    for r, limits in enumerate((["ZClip", None], [1.0, None])):
        theirs = data(rng)[:2]
        calls = [
            engine.check(g, engine.NO_LIMIT if isinstance(m, str) or m is None else m, rank=r, size=2)
            for g, m in zip(theirs, limits)
        ]
        programs.append(
            groups.program(
                calls, [m if isinstance(m, str) or m is None else c.limit for c, m in zip(calls, limits)]
            )
        )
    with pytest.raises(gclip.GclipError) as err:
        drivers.run_simulated(programs)
    assert "max_norms" in str(err.value) and "\n" not in str(err.value)
