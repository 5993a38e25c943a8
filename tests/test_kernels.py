"""The optional compiled kernels (gclip[fast]) and the numpy code, each against an exact oracle
(integer mantissas, or math.fsum of exact float64 squares), never against each other."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import gclip
from binned_digits import kept_bins
from gclip import _kernels, partials
from oracles import exact_norm, exact_power_sum


def exact_sum(x: np.ndarray, p: int) -> Fraction:
    """The reproducible mode's sum of v = |x|**p, exactly (integer mantissas): the oracle.

    Each v is a float64: |x| exactly, or x*x in float64 (exact for float32 values, rounded
    once for float64 ones). The squares are taken after an exact power-of-two scaling so
    that none overflows or underflows, which leaves their rounding as it is."""
    x64 = x.astype(np.float64)
    if p == 1:
        return exact_power_sum(x64, 1)
    shift = int(np.frexp(np.max(np.abs(x64)))[1])
    y = np.ldexp(x64, -shift)
    return exact_power_sum(y * y, 1) * Fraction(2) ** (2 * shift)


def fsum_of_squares(x: np.ndarray) -> float:
    """math.fsum of float64 squares of float32 values: the squares are exact, the sum
    correctly rounded."""
    assert x.dtype == np.float32
    return math.fsum(np.square(x.astype(np.float64)).tolist())


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30, 1e-150, 1e150, 1e300, 1e-300])
def test_reproducible_digits_hold_the_exact_sum_on_both_paths(kernels, numpy_only, p, dtype, magnitude):
    """The digits of the compiled kernel and of the numpy folds, each decoded and compared with
    the exact sum: within the mode's bound, N * 2**(-W*(K-1)) relative."""
    if dtype is np.float32 and not 1e-30 <= magnitude <= 1e30:
        magnitude = 1.0
    rng = np.random.default_rng(int(p * 1000 + math.log10(magnitude) + 400))
    x = (rng.normal(size=3 * _kernels.MIN_SIZE + 17) * magnitude).astype(dtype)
    x[::5] *= 1e-7  # values far below the top bin too
    binned = partials.BinnedPowerSum(p)
    exact = exact_sum(x, p)
    bound = Fraction(x.size) * Fraction(2) ** (-binned.W * (binned.K - 1))
    for path, digits in (("compiled", binned.local([x])), ("numpy", numpy_only(lambda: binned.local([x])))):
        got = binned.exact(digits)
        assert abs(got - exact) <= bound * exact, f"{path}: {float(abs(got - exact) / exact):.3g} relative"


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30, 1e-150, 1e150, 1e300, 1e-300, 1e-310])
def test_compiled_blocks_keep_the_numpy_folds_integers(kernels, numpy_only, p, dtype, magnitude):
    """The kernels fold blocks of KERNEL_BLOCK_BYTES, numpy blocks of BLOCK values: the counts of the bins
    the result keeps are the same integers, so the result has the same bits (large and tiny
    magnitudes take the kernels' rescaled folds)."""
    block = _kernels.kernel_block(np.dtype(dtype).itemsize)
    assert block % partials.BLOCK == 0 and block > partials.BLOCK
    if dtype is np.float32 and not 1e-30 <= magnitude <= 1e30:
        magnitude = 1.0
    rng = np.random.default_rng(int(p * 1000 + math.log10(magnitude) + 500))
    x = (rng.normal(size=_kernels.MIN_SIZE + 5 * block + 77) * magnitude).astype(dtype)
    x[::5] *= 1e-7
    x[3 * block : 3 * block + 700] *= 1e-12  # a block far below the top
    binned = partials.BinnedPowerSum(p)
    compiled, plain = binned.local([x]), numpy_only(lambda: binned.local([x]))
    assert kept_bins(binned, compiled) == kept_bins(binned, plain)
    assert binned.power(compiled) == binned.power(plain)


@pytest.mark.parametrize("p", [1, 2])
def test_float32_runs_of_blocks_keep_the_numpy_folds_integers(kernels, numpy_only, p):
    """float32 folds runs of _jit._RUN blocks with the top bin of the run's first block, and goes
    block by block where a later block rises above it, the first block is zeros, or a block holds
    inf or NaN: each case against the numpy folds, in the bins the result keeps."""
    from gclip import _jit

    block = _kernels.kernel_block(4)
    run = _jit._RUN * block
    rng = np.random.default_rng(70 + p)
    x = rng.normal(size=5 * run + 100).astype(np.float32)
    x[2 * block : 3 * block] *= np.float32(1e-20)  # run 0: a block far below the first one's top
    x[5 * block : 6 * block] *= np.float32(1e15)  # run 0: a block above the first one's top
    x[run : run + block] = 0.0  # run 1 starts with a block of zeros
    x[3 * run : 3 * run + block] *= np.float32(1e-20)  # run 3 starts far below its other blocks
    binned = partials.BinnedPowerSum(p)
    for y in (x, x[run:], x[4 * run + 5 :], x[:-3]):  # the rise and the fallbacks, and runs at other starts
        compiled, plain = binned.local([y]), numpy_only(lambda y=y: binned.local([y]))
        assert kept_bins(binned, compiled) == kept_bins(binned, plain)
        assert binned.power(compiled) == binned.power(plain)
    for special, want in ((np.inf, math.isinf), (np.nan, math.isnan)):
        y = x.copy()
        y[2 * run + 3 * block + 7] = special  # a block of run 2
        compiled, plain = binned.local([y]), numpy_only(lambda y=y: binned.local([y]))
        assert want(compiled[1]) and want(plain[1])


@pytest.mark.parametrize("p", [1, 2])
def test_rescaled_folds_add_digit_sums_beyond_2_to_the_53_exactly(kernels, p):
    """A block of values at the top of a bin beyond the unscaled folds' range (the rescaled folds):
    each top digit near 2**43, a block's sum near 2**53, against the exact sum."""
    binned = partials.BinnedPowerSum(p)
    rng = np.random.default_rng(40 + p)
    m = 2.0 - rng.random(2 * _kernels.kernel_block(8)) * 2.0**-10  # full 53-bit significands, odd low digits
    if p == 2:  # squares m * 2**1054 just below 2**1055, the top of bin 23 (its unit 2**1012)
        x = np.ldexp(np.sqrt(m), 527)
    else:  # values m * 2**-882 just below 2**-881, the top of bin -21 (its unit 2**-924)
        x = np.ldexp(m, -882)
    exact = exact_sum(x, p)
    counts = np.zeros((binned.nbins, 2), np.int64)
    assert kernels.digits_view(x, p, counts, binned.W, binned._BIN_LO) == 0.0  # the kernel itself
    got = binned.exact(binned._pack(counts, x.size, 0.0))
    bound = Fraction(x.size) * Fraction(2) ** (-binned.W * (binned.K - 1))
    assert abs(got - exact) <= bound * exact, float(abs(got - exact) / exact)


@pytest.mark.parametrize("p", [1, 2])
def test_reproducible_digits_given_chunk_by_chunk_hold_the_exact_sum(kernels, numpy_only, p):
    """local_stream (chunks cut anywhere, one buffer refilled) against the exact sum, both paths."""
    rng = np.random.default_rng(11 + p)
    x = (rng.normal(size=5 * partials.BLOCK + 3) * 1e3).astype(np.float32)
    x[::7] *= 1e-9
    binned = partials.BinnedPowerSum(p)
    exact = exact_sum(x, p)
    bound = Fraction(x.size) * Fraction(2) ** (-binned.W * (binned.K - 1))

    def refilled():
        buf = np.empty(700, dtype=np.float32)  # not a multiple of BLOCK: blocks straddle the cuts
        for start in range(0, x.size, 700):
            n = min(700, x.size - start)
            buf[:n] = x[start : start + n]
            yield buf[:n]

    for path, digits in (
        ("compiled", binned.local_stream(refilled(), x.size)),
        ("numpy", numpy_only(lambda: binned.local_stream(refilled(), x.size))),
    ):
        assert digits[0] == x.size
        got = binned.exact(digits)
        assert abs(got - exact) <= bound * exact, f"{path}: {float(abs(got - exact) / exact):.3g} relative"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_reproducible_norm_has_the_same_bits_on_the_compiled_and_the_numpy_path(kernels, dtype):
    """One large rank takes the compiled path, many small ranks the numpy folds (each below
    MIN_SIZE): the norm must have the same bits, and be the exact norm rounded once."""
    x = (np.random.default_rng(3).normal(size=3 * _kernels.MIN_SIZE + 17) * 1e3).astype(dtype)
    whole = gclip.clip_simulated([x], 1.0, reproducible=True)[0].total_norm
    pieces = np.array_split(x, 8)
    assert max(p.size for p in pieces) < _kernels.MIN_SIZE
    split = gclip.clip_simulated(pieces, 1.0, reproducible=True)[0].total_norm
    assert whole.hex() == split.hex()
    ref = exact_norm(x.astype(np.float64))
    assert abs(whole - ref) <= math.ulp(ref), (whole, ref)


def test_float32_sum_of_squares_is_float64_accurate(kernels, numpy_only):
    x = np.random.default_rng(9).normal(size=2_000_000).astype(np.float32)
    exact = fsum_of_squares(x)
    compiled = partials.power_sum([x], 2.0)[0]
    plain = numpy_only(lambda: partials.power_sum([x], 2.0)[0])
    kernel = float(kernels.sumsq_f32(x))
    for path, got in (("power_sum, compiled", compiled), ("power_sum, numpy", plain), ("sumsq_f32", kernel)):
        assert abs(got - exact) / exact < 1e-13, f"{path}: {got!r} vs {exact!r}"


@pytest.mark.parametrize("n", [0, 1, 15, 16, 255, 256, 257, 4095, 4096, 4097, 4352, 4353, 9000])
def test_float32_kernel_counts_every_element_once(kernels, n):
    # sizes around the vector loop's edges (16 lanes, 4 accumulators) and 4096, with
    # powers of two whose sum is exact, so one lost or doubled element shows
    x = np.ldexp(1.0, np.arange(n) % 20).astype(np.float32)
    exact = fsum_of_squares(x)
    assert float(kernels.sumsq_f32(x)) == exact


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits of float32 values (their top halves: truncated, which is all a test needs)."""
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def fsum_of_bfloat16_squares(u: np.ndarray) -> float:
    """The oracle: each bfloat16 widened exactly (its bits on top of a float32), squared exactly in
    float64, the squares summed by math.fsum."""
    return fsum_of_squares((u.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("start", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 511, 512, 513, 1023, 8193, 9000])
def test_bfloat16_kernel_counts_every_element_once(kernels, start, n):
    # two values per 32-bit word: odd starts (a value before the first whole word) and odd ends,
    # around the runs' and the hints' edges; powers of two whose squares sum exactly
    bits = bfloat16_bits(np.ldexp(1.0, np.arange(n + 4) % 20 - 10) * np.where(np.arange(n + 4) % 3, 1, -1))
    u = bits[start : start + n]
    assert float(kernels.sumsq_bf16(u)) == fsum_of_bfloat16_squares(u)


def test_bfloat16_kernel_is_float64_accurate_on_any_view(kernels):
    rng = np.random.default_rng(21)
    x = rng.normal(size=300_001) * np.exp(rng.uniform(-60, 60, 300_001))  # squares from 1e-52 to 1e52
    x[[5, 6, 70_000]] = [1e-39, -3e-41, 0.0]  # a bfloat16 subnormal and a zero among them
    bits = bfloat16_bits(x)
    for u in (bits, bits[1:], bits[1:-1], bits[::3], bits[7::2]):
        exact = fsum_of_bfloat16_squares(u)
        got = float(kernels.sumsq_bf16(u))
        assert abs(got - exact) <= 1e-13 * exact, f"{got!r} vs {exact!r}"


def test_bfloat16_kernel_passes_inf_and_nan_on(kernels):
    for special, want in ((np.inf, math.isinf), (np.nan, math.isnan)):
        for where in (0, 1, 600, 1001):
            u = bfloat16_bits(np.ones(1002))
            u[where] = bfloat16_bits(np.array([special]))[0]
            assert want(float(kernels.sumsq_bf16(u))), (special, where)


def fsum_of_float16_squares(h: np.ndarray) -> float:
    """The oracle: each float16 widened by numpy (exact), squared exactly in float64, summed by math.fsum."""
    return math.fsum(np.square(h.astype(np.float64)).tolist())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 4097, 9000])
def test_float16_kernel_counts_every_element_once(kernels, n):
    # around the vector loop's edges (8 or 16 lanes, 4 accumulators); powers of two: an exact sum
    h = (np.ldexp(1.0, np.arange(n) % 20 - 12) * np.where(np.arange(n) % 3, 1, -1)).astype(np.float16)
    assert float(kernels.sumsq_f16(h.view(np.uint16))) == fsum_of_float16_squares(h)


def test_float16_sum_of_squares_is_float64_accurate_with_subnormals_on_both_paths(kernels, numpy_only):
    rng = np.random.default_rng(23)
    h = (rng.normal(size=200_001) * np.exp(rng.uniform(-9, 9, 200_001))).astype(np.float16)
    h[[3, 4, 5]] = [np.float16(6e-8), np.float16(-3e-6), np.float16(0.0)]  # two subnormals and a zero
    exact = fsum_of_float16_squares(h)
    compiled = partials.power_sum([h], 2.0)[0]
    plain = numpy_only(lambda: partials.power_sum([h], 2.0)[0])
    kernel = float(kernels.sumsq_f16(h.view(np.uint16)))
    for path, got in (("power_sum, compiled", compiled), ("power_sum, numpy", plain), ("sumsq_f16", kernel)):
        assert abs(got - exact) <= 1e-13 * exact, f"{path}: {got!r} vs {exact!r}"


def test_float16_kernel_passes_inf_and_nan_on(kernels):
    for special, want in ((np.inf, math.isinf), (np.nan, math.isnan)):
        for where in (0, 1, 600, 1001):
            h = np.ones(1002, np.float16)
            h[where] = special
            assert want(float(kernels.sumsq_f16(h.view(np.uint16)))), (special, where)


def test_byte_swapped_float16_stays_on_numpy_path(kernels):
    h = np.arange(1, 40_001).astype(">f2") / np.float16(4096)
    assert partials.power_sum([h], 2.0)[0] == pytest.approx(fsum_of_float16_squares(h), rel=1e-13)


def test_kernels_can_be_switched_off(numpy_only):
    assert numpy_only(_kernels.get) is None


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_reproducible_norm_with_an_empty_array_among_many(kernels, dtype):
    """20 arrays and an empty one go through the compiled table in one call; the empty one
    adds nothing and is never read (the boundscheck rerun below catches a read past its end)."""
    rng = np.random.default_rng(21)
    arrays = [rng.normal(size=100).astype(dtype) for _ in range(20)] + [np.zeros(0, dtype)]
    norm = gclip.global_norm(arrays, reproducible=True)
    exact = sum((exact_power_sum(a, 2) for a in arrays), Fraction(0))
    assert norm == pytest.approx(math.sqrt(exact), rel=1e-15)
    assert gclip.global_norm([np.zeros(0, dtype)] * 20, reproducible=True) == 0.0


@pytest.mark.parametrize("writable", [False, True])
def test_the_interface_table_reads_what_the_header_reads_give(kernels, monkeypatch, writable):
    """GCLIP_RAW_HEADERS=0 (or headers not readable here): the table from __array_interface__,
    entry by entry as the compiled header reads give it, on arrays of every kind they sort."""
    base = np.zeros((6, 8), np.float32)
    arrays = [
        base,
        np.zeros((3, 4), np.float64, order="F"),
        base[:, ::2],
        np.zeros(5, ">f8"),
        np.zeros(0, np.float64),
        np.zeros(3, np.float16),
        np.zeros((), np.float64),
        base.T,
        np.frombuffer(bytes(16), np.float64),
        np.ones(7, np.float32)[1:],
    ]
    raw = kernels.table(arrays, writable)
    monkeypatch.setenv("GCLIP_RAW_HEADERS", "0")
    python = kernels.table(arrays, writable)
    assert raw.compiled == python.compiled == (6 if writable else 7)  # the read-only one: not for a scale
    for field in ("kind", "size", "ptr"):
        assert getattr(raw, field).tolist() == getattr(python, field).tolist(), field
    monkeypatch.delenv("GCLIP_RAW_HEADERS")
    x = [np.full(100, 0.5, np.float32) for _ in range(20)]
    want = gclip.global_norm(x)
    monkeypatch.setenv("GCLIP_RAW_HEADERS", "0")
    assert gclip.global_norm(x) == want == pytest.approx(math.sqrt(2000 * 0.25), rel=1e-15)


def test_no_llvm_intrinsic_is_named_for_typed_pointers():
    """llvmlite names the overloaded intrinsics (declare_intrinsic) for its own pointer mode: none
    is spelt with a typed-pointer suffix such as .p0i8, which opaque-pointer LLVMs do not define."""
    import re
    from pathlib import Path

    source = (Path(gclip.__file__).parent / "_jit.py").read_text()
    assert not re.findall(r"\"llvm\.[\w.]*\.p\d+[a-z]+\d*\"", source)
    assert "get_or_insert_function" not in source  # every intrinsic goes through declare_intrinsic


AVX2_CPUS = ("haswell", "broadwell", "skylake", "znver1", "znver2", "znver3")


def test_the_code_generation_is_the_target_named(kernels):
    """Under NUMBA_CPU_NAME=haswell (scripts/test's second kernel lane) numba really emits AVX2
    code, at most 256-bit vectors, whatever CPU runs the tests: the lane checks what an AVX2
    machine runs, not this machine's AVX-512 code again (numba keeps the host's features when
    NUMBA_CPU_FEATURES is not set too)."""
    import os

    import numba

    name = os.environ.get("NUMBA_CPU_NAME")
    if name not in AVX2_CPUS:
        pytest.skip("the host's code generation (the AVX2 lane sets NUMBA_CPU_NAME=haswell)")

    @numba.njit(fastmath={"reassoc", "contract"})  # not cached: compiled here, its assembly readable
    def sumsq(x):
        s = 0.0
        for i in range(x.size):
            v = np.float64(x[i])
            s += v * v
        return s

    x = np.arange(100, dtype=np.float32)
    assert sumsq(x) == fsum_of_squares(x)
    (asm,) = sumsq.inspect_asm().values()
    assert "%zmm" not in asm, f"{name}: AVX-512 registers in the code (NUMBA_CPU_FEATURES unset?)"
    assert "%ymm" in asm and "vfmadd" in asm, f"{name}: no AVX2 fused vector loop"
