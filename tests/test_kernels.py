"""The optional compiled kernels (gclip[fast]) give what the numpy code gives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gclip import _kernels, partials


@pytest.fixture
def kernels():
    k = _kernels.get()
    if k is None:
        pytest.skip("numba is not installed (pip install 'gclip[fast]'), or GCLIP_KERNELS=0")
    return k


@pytest.fixture
def numpy_only(monkeypatch):
    """Run a block with the kernels switched off, then back on."""

    def run(fn):
        monkeypatch.setenv("GCLIP_KERNELS", "0")
        _kernels.get.cache_clear()
        try:
            return fn()
        finally:
            monkeypatch.delenv("GCLIP_KERNELS")
            _kernels.get.cache_clear()

    return run


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30, 1e-150, 1e150, 1e300, 1e-300])
def test_reproducible_digits_are_the_same_integers(kernels, numpy_only, p, dtype, magnitude):
    if dtype is np.float32 and not 1e-30 <= magnitude <= 1e30:
        magnitude = 1.0
    rng = np.random.default_rng(int(p * 1000 + math.log10(magnitude) + 400))
    x = (rng.normal(size=3 * _kernels.MIN_SIZE + 17) * magnitude).astype(dtype)
    x[::5] *= 1e-7  # values far below the top bin too
    binned = partials.BinnedPowerSum(p)
    compiled = binned.local([x])
    plain = numpy_only(lambda: binned.local([x]))
    assert np.array_equal(compiled, plain)


def test_float32_sum_of_squares_is_float64_accurate(kernels, numpy_only):
    x = np.random.default_rng(9).normal(size=2_000_000).astype(np.float32)
    exact = math.fsum(np.square(x.astype(np.float64)).tolist())
    compiled = partials.power_sum([x], 2.0)[0]
    plain = numpy_only(lambda: partials.power_sum([x], 2.0)[0])
    assert abs(compiled - exact) / exact < 1e-13
    assert abs(plain - exact) / exact < 1e-13
    assert compiled == pytest.approx(float(kernels.sumsq_f32(x)), rel=0, abs=0)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 255, 256, 257, 4095, 4096, 4097, 4352, 4353, 9000])
def test_float32_kernel_counts_every_element_once(kernels, n):
    # the kernel walks blocks and hints ahead: sizes around both edges, with
    # powers of two whose sum is exact, so one lost or doubled element shows
    x = np.ldexp(1.0, np.arange(n) % 20).astype(np.float32)
    exact = math.fsum(np.square(x.astype(np.float64)).tolist())
    assert float(kernels.sumsq_f32(x)) == exact


def test_kernels_can_be_switched_off(numpy_only):
    assert numpy_only(_kernels.get) is None
