"""gclip.clip: the scale rule and its application, on simulated ranks, against exact arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import gclip
from gclip import GclipValueError


def exact_scale(norm: float, limit: float) -> Fraction:
    return min(Fraction(1), Fraction(limit) / Fraction(norm)) if norm else Fraction(1)


@pytest.mark.parametrize("limit", [0.0, -0.0])
def test_a_limit_of_zero_gives_plus_zero_whatever_its_sign(limit):
    scale = gclip.clip_scale(5.0, limit)
    assert scale == 0.0 and math.copysign(1.0, scale) == 1.0
    values = np.array([3.0, -4.0])
    out = gclip.clip_with_norm(values, limit, 5.0)  # each zero keeps its value's sign, as x * +0.0
    assert np.array_equal(np.signbit(out), np.signbit(values)), out
    got = gclip.clip_simulated([values[:1], values[1:]], limit)
    assert [math.copysign(1.0, r.scale) for r in got] == [1.0, 1.0]
    assert [bool(np.signbit(r.grads[0])) for r in got] == [False, True]


@pytest.mark.parametrize(
    "norm, limit", [(5.0, 1.0), (5.0, 5.0), (1.0, 5.0), (0.0, 1.0), (3.0, 1e-300), (7e300, 1e-10)]
)
def test_clip_scale_is_the_rounded_exact_quotient(norm, limit):
    want = exact_scale(norm, limit)
    got = gclip.clip_scale(norm, limit)
    assert got == float(want) or (Fraction(got) <= want and float(want) - got <= math.ulp(float(want)))


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_clip_scale_refuses_a_bad_limit(bad):
    with pytest.raises(GclipValueError, match="max_norm"):
        gclip.clip_scale(1.0, bad)


def test_clipped_norm_never_exceeds_the_limit_exactly():
    rng = np.random.default_rng(5)
    shards = [rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3) for n in (7, 1, 30)]
    limit = 0.75
    got = gclip.clip_simulated(shards, limit)
    exact = sum(Fraction(float(v)) ** 2 for r in got for v in r.grads)
    assert exact <= Fraction(limit) ** 2
    values = np.concatenate(shards)
    norm = math.sqrt(math.fsum(v * v for v in values))
    assert got[0].total_norm == pytest.approx(norm, rel=1e-15)
    assert {r.scale for r in got} == {got[0].scale}


# ---------------------------------------------------------------------------
# how deep a default call goes: a newcomer follows it down in a few steps


class _OneRank:
    """A communicator of one rank (mpi4py's methods): the header comes back as sent."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        recvbuf[...] = sendbuf

    def allgather(self, item):
        return [item]


def gclip_depth(call) -> int:
    """The deepest nest of gclip's own Python frames while ``call()`` runs (sys.setprofile)."""
    import os
    import sys

    root = os.path.dirname(gclip.__file__) + os.sep
    stack: list[bool] = []
    depth = deepest = 0

    def profile(frame, event, arg) -> None:
        nonlocal depth, deepest
        if event == "call":
            mine = frame.f_code.co_filename.startswith(root)
            stack.append(mine)
            depth += mine
            deepest = max(deepest, depth)
        elif event == "return" and stack:
            depth -= stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return deepest


@pytest.mark.parametrize(
    "grads",
    [np.ones(1000), [np.ones(1000), np.ones(10)], [np.ones(100, np.float32), np.ones(10, np.float32)]],
    ids=["one array", "a list", "float32"],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_a_default_clip_is_at_most_6_gclip_frames_deep(grads, inplace):
    comm = _OneRank()
    gclip.clip_by_global_norm(grads, 0.5, comm=comm, inplace=inplace)  # the settings, checked once
    depth = gclip_depth(lambda: gclip.clip_by_global_norm(grads, 0.5, comm=comm, inplace=inplace))
    assert 3 <= depth <= 6, depth  # 3: the counter sees the API, its driver and the program


def gclip_calls(call) -> int:
    """gclip's own Python calls while ``call()`` runs (cProfile; C calls and other packages' aside)."""
    import cProfile
    import os
    import pstats

    root = os.path.dirname(gclip.__file__) + os.sep
    profiler = cProfile.Profile()
    profiler.runcall(call)
    return sum(v[1] for (path, _, _), v in pstats.Stats(profiler).stats.items() if path.startswith(root))


def test_a_default_clip_makes_half_the_calls_it_made_before_the_lean_core():
    grads, comm = np.ones(1000), _OneRank()
    gclip.clip_by_global_norm(grads, 0.5, comm=comm)  # the settings, checked (and cached) once
    calls = gclip_calls(lambda: gclip.clip_by_global_norm(grads, 0.5, comm=comm))
    assert 3 <= calls <= 17, calls  # 35 before: a call layer, Steps, the hook (docs/architecture.md)
    assert gclip_calls(lambda: gclip.clip_simulated([grads] * 2, 1.0)) > 17  # the counter counts


def test_the_depth_counter_sees_a_deeper_call():
    def nest(n: int) -> None:
        if n:
            nest(n - 1)

    assert gclip_depth(lambda: nest(8)) == 0  # frames outside gclip are not counted
    assert gclip_depth(lambda: gclip.clip_simulated([np.ones(2)] * 2, 1.0)) >= 4
