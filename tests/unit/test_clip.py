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
