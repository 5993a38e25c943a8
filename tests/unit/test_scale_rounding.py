"""apply_scale and clip_with_norm round as docs/numerics.md says, checked against exact
arithmetic (fractions.Fraction), for every float32 factor: in float32's normal range, one
float32 multiply by the factor rounded toward zero (at most half an ulp above the exact
product, less than 2**-23 + 2**-24 below it); outside it (a factor above 3.4e38, which
apply_scale may take, or below 1.2e-38), in float64 and rounded once, as float16 is."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import gclip

TINY32 = float(np.finfo(np.float32).tiny)
MAX32 = float(np.finfo(np.float32).max)


def nearest_float32(exact: Fraction) -> Fraction:
    """The float32 nearest to ``exact`` (ties to even), from exact neighbours."""
    x = np.float32(float(exact))  # within an ulp of it: the answer is x or a neighbour
    candidates = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
    return min(
        (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1, Fraction(float(c))) for c in candidates
    )[2]


def check(values: np.ndarray, factor: float, got: np.ndarray) -> None:
    assert got.dtype == values.dtype
    for x, y in zip(values.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(factor)
        if values.dtype == np.float32 and (factor == 0 or TINY32 <= factor <= MAX32):
            y_, e = Fraction(y), exact
            assert y_ <= nearest_float32(e) if e >= 0 else y_ >= nearest_float32(e), (x, factor, y)
            assert abs(y_) >= abs(e) * (1 - Fraction(1, 2**23) - Fraction(1, 2**24)) or abs(e) < TINY32, (
                x,
                y,
            )
        else:  # rounded once from float64: the nearest, or (double rounding) one 2**-53 further
            assert abs(Fraction(y) - exact) <= abs(nearest_float32(exact) - exact) + abs(exact) / 2**53, (
                x,
                y,
            )


FLOAT32_CASES = [
    (1e-30, 1e40),  # the product 1e10 fits; the factor was clamped to 3.4e38 first (gave 3.4e8)
    (3e-39, 1e39),  # a subnormal value, a factor beyond float32
    (1.5, 1e-40),  # a subnormal float32 factor keeps few bits: off by 1e-5 relative before
    (3e38, 3.3e-79),  # the factor is 0 as a float32: the product 1e-40 is not
    (0.7, 0.3),  # in range: the float32 rule
    (-2.5, 1e-38),  # just below float32's normal range
    (0.75, MAX32),  # the largest factor float32 holds
]


@pytest.mark.parametrize(("value", "factor"), FLOAT32_CASES)
def test_apply_scale_rounds_float32_as_documented(value, factor):
    rng = np.random.default_rng(0)
    values = np.float32([value, -value, *(value * rng.uniform(0.5, 1.0, size=30))])
    check(values, factor, gclip.apply_scale(values, factor))
    inplace = values.copy()
    gclip.apply_scale(inplace, factor, inplace=True)
    assert np.array_equal(inplace, gclip.apply_scale(values, factor), equal_nan=False)


def test_apply_scale_of_a_tiny_float32_by_a_huge_factor():
    assert gclip.apply_scale(np.float32([1e-30]), 1e40).tolist() == [float(np.float32(1e10))]


def test_clip_with_norm_keeps_a_subnormal_float32_product():
    got = gclip.clip_with_norm(np.float32([3e38]), 1e-40, 3e38)
    check(np.float32([3e38]), gclip.clip_scale(3e38, 1e-40), got)
    assert got[0] > 0, "the float32 factor underflowed to zero"


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("factor", [1e-40, 0.3, 1e5])
def test_apply_scale_of_float16_and_float64(dtype, factor):
    values = np.array([0.75, -3.0, 1e-3], dtype=dtype)
    got = gclip.apply_scale(values, factor)
    for x, y in zip(values.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(factor)
        want = float(dtype(float(exact)))  # float16: one rounding from float64 (53 bits: exact here)
        assert y == want if dtype == np.float16 else abs(Fraction(y) - exact) <= abs(exact) / 2**53, (x, y)


def test_many_float32_arrays_in_place_take_the_same_rule():
    """300 arrays go through the compiled kernels' table when numba is there: a factor beyond
    float32 must not."""
    arrays = [np.full(4, 1e-30, np.float32) for _ in range(300)]
    gclip.apply_scale(arrays, 1e40, inplace=True)
    assert all(a.tolist() == [float(np.float32(1e10))] * 4 for a in arrays)
