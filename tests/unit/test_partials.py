"""gclip.partials: each local reduction against exact arithmetic (fractions) or math.fsum."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from gclip import engine, partials


def exact_power(arrays, p: int) -> Fraction:
    return sum((abs(Fraction(float(v))) ** p for a in arrays for v in np.ravel(a)), Fraction(0))


def arrays_of(seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 7, 1000, 3 * partials.BLOCK + 5]
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4)).astype(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_power_sum_is_the_float64_sum_of_powers(dtype, p):
    arrays = arrays_of(p, dtype)
    total, rescue = partials.power_sum(arrays, float(p))
    assert not rescue
    assert total == pytest.approx(float(exact_power(arrays, p)), rel=1e-12)


def test_power_sum_flags_what_it_cannot_trust():
    assert partials.power_sum([np.array([1e200, 1.0])], 2.0)[1] is True  # overflow
    assert partials.power_sum([np.array([1e-200])], 2.0)[1] is True  # underflow
    total, rescue = partials.power_sum([np.array([1.0, math.inf])], 2.0)
    assert total == math.inf and rescue is False  # the norm IS inf: nothing to rescue
    total, rescue = partials.power_sum([np.array([math.nan, 1.0])], 2.0)
    assert math.isnan(total) and rescue is False
    assert partials.power_sum([], 2.0) == (0.0, False)


def test_max_abs_and_the_nan_flag():
    arrays = [np.array([-7.5, 2.0]), np.array([], dtype=np.float32), np.array([3.0], dtype=np.float16)]
    assert partials.max_abs(arrays) == (7.5, False)
    assert partials.max_abs([np.array([1.0, math.nan, -9.0])])[1] is True  # NaN travels as a flag
    assert partials.max_abs([np.array([2.0]), np.array([math.nan])]) == (2.0, True)
    assert partials.max_abs([]) == (0.0, False)


@pytest.mark.parametrize("scale", [1e200, 1e-200, 1.0])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_scaled_power_sum_is_exact_relative_to_the_top(scale, p):
    arrays = [np.array([3.0, -4.0]) * scale, np.array([0.5]) * scale]
    top = partials.max_abs(arrays)[0]
    got = partials.scaled_power_sum(arrays, float(p), top)
    want = exact_power([[v / Fraction(top) for v in map(Fraction, np.concatenate(arrays))]], p)
    assert got == pytest.approx(float(want), rel=1e-15)


def test_count_and_chunks_cover_every_element_once():
    arrays = arrays_of(9)
    assert partials.count(arrays) == sum(a.size for a in arrays)
    big = np.arange(2.5 * partials.CHUNK)
    chunks = list(partials.iter_chunks(big))
    assert sum(c.size for c in chunks) == big.size
    assert np.array_equal(np.concatenate(chunks), big)


@pytest.mark.parametrize("p", [1, 2])
def test_binned_digits_give_the_exact_sum_for_any_split(p):
    values = np.concatenate(arrays_of(3 + p))
    binned = partials.BinnedPowerSum(float(p))
    want = exact_power([values], p)
    sums = set()
    for cuts in ([values], [values[:10], values[10:]], np.array_split(values, 7)):
        digits = sum(binned.local([c]) for c in cuts)
        mant, exp = binned.power(digits)
        sums.add(mant.hex() + f" {exp}")
        power = Fraction(mant) * Fraction(2) ** (p * exp)  # rounded once, from digits exact to ~2**-76
        assert abs(power - want) <= want * Fraction(2) ** -52
    assert len(sums) == 1  # every split: the same bits
    assert engine.root(mant, exp, float(p)) == pytest.approx(float(want) ** (1.0 / p), rel=2.3e-16)


def test_binned_digits_carry_inf_and_nan():
    binned = partials.BinnedPowerSum(2.0)
    assert binned.power(binned.local([np.array([1.0, math.inf])])) == (math.inf, 0)
    assert math.isnan(binned.power(binned.local([np.array([math.nan])]))[0])
    with pytest.raises(ValueError, match="reproducible"):
        partials.BinnedPowerSum(3.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_scale_never_lifts_a_value_above_the_exact_product(dtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(40) * 100).astype(dtype)
    factor = 1.0 / 3.0
    out = np.empty_like(x)
    partials.multiply_by([x], factor, [out])
    for v, got in zip(x.tolist(), out.tolist()):
        exact = Fraction(v) * Fraction(factor)
        half_ulp = Fraction(float(np.finfo(dtype).eps)) / 2  # the product's own rounding, no more
        assert abs(Fraction(got)) <= abs(exact) * (1 + half_ulp)
        if dtype == np.float64:
            assert got == float(exact)  # the plain product, rounded once


def test_scale_in_place_by_one_touches_nothing_and_a_copy_is_exact():
    x = np.array([0.1, np.nan, -0.0], dtype=np.float32)
    before = x.tobytes()
    partials.multiply_by([x], 1.0, [x])
    assert x.tobytes() == before
    copy = np.empty_like(x)
    partials.multiply_by([x], 1.0, [copy])
    assert copy.tobytes() == before


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_many_arrays_scale_in_place_as_one_array_would(kernels, monkeypatch):
    """The compiled path (>= MANY arrays, through the checks' table) and numpy's, with a float16
    array and a strided one left to numpy among them: each value as _multiply_one gives it alone."""
    from gclip import _kernels, reader

    monkeypatch.setenv("GCLIP_KERNELS", kernels)
    _kernels.get.cache_clear()
    try:
        rng = np.random.default_rng(3)
        many = [rng.standard_normal(5).astype(np.float32 if i % 2 else np.float64) for i in range(40)]
        many[7] = many[7].astype(np.float16)
        many[9] = rng.standard_normal(10)[::2]
        alone = []
        for a in many:
            b = a.copy()
            partials.multiply_by([b], 1 / 3, [b])  # one array: never the compiled path
            alone.append(b)
        given = reader.grads(many, inplace=True)
        assert (type(given.arrays) is _kernels.Checked) == (kernels == "1")
        given.scaled(1 / 3, inplace=True)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(many, alone))
    finally:
        _kernels.get.cache_clear()


@pytest.mark.parametrize("factor", [1.0, 0.5, 0.1, 1 / 3, 0.3, 2.0**-130, 1e-45, 3e38, 1e300, 0.0])
def test_the_float32_factor_is_the_largest_float32_not_above_the_factor(factor):
    f32 = partials.float32_toward_zero(factor)
    assert type(f32) is np.float32
    assert Fraction(float(f32)) <= Fraction(factor)
    if f32 < np.finfo(np.float32).max:
        assert Fraction(float(np.nextafter(f32, np.float32(np.inf)))) > Fraction(factor)


def test_small_float32_arrays_are_added_after_the_float64_ones():
    """The one-chunk float32/float16 sum keeps the chunked route's place in the order: the
    float64 arrays' dots first, then the rest (a different order rounds 2**54 + ... apart)."""
    arrays = [np.ones(2, np.float32), np.array([2.0**27]), np.ones(3), np.ones(5, np.float16)]
    total, rescue = partials.power_sum(arrays, 2.0)
    assert not rescue and total == ((2.0**54 + 3.0) + 2.0) + 5.0
    for a in (np.ones(4096, np.float32) * 3, np.ones((64, 64), np.float16)):  # at the one-chunk edge
        assert partials.power_sum([a], 2.0)[0] == math.fsum(float(v) ** 2 for v in a.ravel())
