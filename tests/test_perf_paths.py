"""The fast paths give what the numpy path gives: lists of many arrays in one
compiled call (the table read from the arrays' headers), the reproducible
mode's block digits on every layout and dtype, and the same checks (aliases,
read-only arrays, odd arrays) as the item-by-item path. No timing here."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gclip
from conftest import OneRankComm
from gclip import partials, reader
from gclip.errors import GclipValueError

COMM = OneRankComm()


def _mixed(rng: np.random.Generator, n: int = 40) -> list[np.ndarray]:
    """Arrays of every kind the table meets: float32/64 of many sizes (block edges),
    float16, byte-swapped, strided, Fortran-order, 0-d and empty."""
    out: list[np.ndarray] = []
    for i in range(n):
        size = int(rng.choice([1, 3, 64, 511, 512, 513, 1024, 1500, 5000]))
        dtype = (np.float32, np.float64)[i % 2]
        out.append((rng.standard_normal(size) * 10.0 ** rng.integers(-8, 8)).astype(dtype))
    out += [
        rng.standard_normal(700).astype(np.float16),
        rng.standard_normal(600).astype(">f8"),
        rng.standard_normal((30, 40))[:, ::3],
        np.asfortranarray(rng.standard_normal((20, 30)).astype(np.float32)),
        np.array(2.5),
        np.zeros(0, np.float32),
    ]
    return out


def _digits_both(arrays, p, numpy_only):
    binned = partials.BinnedPowerSum(p)
    return binned.local(arrays), numpy_only(lambda: binned.local(arrays))


def _kept(binned, combined):
    """The digit counts of the K bins the result keeps (from the top non-zero bin)."""
    digits = combined[2:].reshape(binned.nbins, binned._DIGITS)
    counts = [sum(int(d) << (binned._DIGIT_BITS * j) for j, d in enumerate(row)) for row in digits]
    top = max((i for i, c in enumerate(counts) if c), default=binned.K - 1)
    return counts[top - binned.K + 1 : top + 1]


def _same_result(fast, plain, p):
    """The compiled and the numpy digits: the same count, the same inf/NaN, the same integers in
    the bins the result keeps (the kernels' blocks are longer than numpy's: the bins below may
    differ, and no result reads them), so the same bits."""
    binned = partials.BinnedPowerSum(p)
    assert fast[0] == plain[0]
    assert np.array_equal(fast[1:2], plain[1:2], equal_nan=True)
    if fast[1] == 0.0:
        assert _kept(binned, fast) == _kept(binned, plain)
        assert binned.power(fast) == binned.power(plain)


# ---------------------------------------------------------------------------
# the table


def test_headers_are_read_on_cpython(kernels):
    if sys.implementation.name == "cpython":
        assert kernels.table([np.zeros(3)]) is not None


def test_table_reads_what_numpy_says(kernels):
    base = np.arange(48.0).reshape(6, 8)
    arrays = [
        base,
        base[1:3],
        base[:, 1:3],
        base.T,
        base.astype(np.float32),
        base.astype(">f4"),
        base.astype(np.float16),
        np.frombuffer(base.tobytes(), np.float64),
        np.zeros(0),
        np.array(1.0),
        np.ma.masked_array(np.ones(3)),
    ]
    t = kernels.table(arrays)
    assert t.kind.tolist() == [2, 2, 0, 2, 1, 0, 0, 2, 2, 2, 0]
    for a, kind, ptr, size in zip(arrays, t.kind, t.ptr, t.size):
        if kind:
            assert (ptr, size) == (a.__array_interface__["data"][0], a.size)
    writable = kernels.table(arrays, writable=True)
    assert writable.kind[7] == 0  # read-only: not for an in-place scale


def test_overlaps(kernels):
    flat = np.zeros(1000)
    assert not kernels.table([flat[:500], flat[500:]]).overlaps()  # adjacent, as in a bucket
    assert kernels.table([flat[:501], flat[500:]]).overlaps()
    assert kernels.table([flat, flat]).overlaps()
    assert not kernels.table([flat[:0], flat[:0], flat]).overlaps()  # empty views share nothing


# ---------------------------------------------------------------------------
# sums and scales of many arrays


@pytest.mark.parametrize("seed", range(3))
def test_many_arrays_norm_matches_numpy(kernels, numpy_only, seed):
    arrays = _mixed(np.random.default_rng(seed))
    fast = gclip.global_norm(arrays, comm=COMM)
    plain = numpy_only(lambda: gclip.global_norm(arrays, comm=COMM))
    exact = math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in np.asarray(a, np.float64).ravel()))
    assert fast == pytest.approx(exact, rel=1e-13)
    assert plain == pytest.approx(exact, rel=1e-13)


@pytest.mark.parametrize("seed", range(3))
def test_many_arrays_inplace_scale_matches_numpy_bitwise(kernels, numpy_only, seed):
    arrays = _mixed(np.random.default_rng(seed))
    copies = [a.copy() for a in arrays]
    scale = 1 / 3
    out = gclip.apply_scale(arrays, scale, inplace=True)
    numpy_only(lambda: gclip.apply_scale(copies, scale, inplace=True))
    assert out is arrays
    for a, b in zip(arrays, copies):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    res = gclip.clip_by_global_norm(arrays, 1.0, comm=COMM, inplace=True)
    assert res.total_norm * res.scale == pytest.approx(1.0)
    assert gclip.global_norm(arrays, comm=COMM) <= 1.0 + 1e-12


def test_bucket_views_of_one_buffer(kernels):
    flat = np.random.default_rng(1).standard_normal(64 * 100)
    views = [flat[i : i + 64] for i in range(0, flat.size, 64)]
    res = gclip.clip_by_global_norm(views, 1.0, comm=COMM, inplace=True)
    assert res.total_norm == pytest.approx(
        float(np.linalg.norm(np.random.default_rng(1).standard_normal(6400)))
    )
    assert np.linalg.norm(flat) == pytest.approx(1.0, rel=1e-12)


def test_many_arrays_aliases_and_overlaps(kernels, numpy_only):
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(64) for _ in range(30)]
    twice = [*arrays, arrays[3]]
    assert gclip.global_norm(twice, comm=COMM) == pytest.approx(gclip.global_norm(arrays, comm=COMM))
    res = gclip.clip_by_global_norm(twice, 0.5, comm=COMM, inplace=True)
    assert res.total_norm * res.scale == pytest.approx(0.5)
    assert np.linalg.norm(np.concatenate(arrays)) == pytest.approx(0.5)  # arrays[3] scaled once
    flat = np.zeros(64 * 20)
    overlapping = [flat[i : i + 65] for i in range(0, 64 * 19, 64)]
    with pytest.raises(GclipValueError, match="overlap"):
        gclip.global_norm(overlapping, comm=COMM)


def test_many_arrays_read_only_and_odd_items(kernels):
    arrays = [np.ones(8) for _ in range(20)]
    arrays[7].flags.writeable = False
    with pytest.raises(GclipValueError, match=r"grads\[7\] is read-only"):
        gclip.clip_by_global_norm(arrays, 1.0, comm=COMM, inplace=True)
    assert gclip.global_norm(arrays, comm=COMM) == pytest.approx(math.sqrt(160))
    lists = [[1.0, 2.0] for _ in range(20)]  # not arrays: the item-by-item path converts them
    assert gclip.global_norm(lists, comm=COMM) == pytest.approx(math.sqrt(100))


def test_a_changed_list_is_read_again(kernels):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(100) for _ in range(20)]
    first = gclip.global_norm(arrays, comm=COMM)
    arrays[5] = rng.standard_normal(5000) * 100  # a new array in the same list
    second = gclip.global_norm(arrays, comm=COMM)
    assert second == pytest.approx(float(np.linalg.norm(np.concatenate(arrays))), rel=1e-13)
    assert second > first
    owner = np.zeros(100)
    arrays[6] = owner
    owner.resize(10_000, refcheck=False)  # new memory, new size: the table reads them anew
    assert gclip.global_norm(arrays, comm=COMM) == pytest.approx(
        float(np.linalg.norm(np.concatenate([np.ravel(a) for a in arrays]))), rel=1e-13
    )


# ---------------------------------------------------------------------------
# the reproducible mode's digits: the very integers of the numpy path in the bins kept


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_digits_many_and_mixed_arrays(kernels, numpy_only, p, seed):
    arrays = _mixed(np.random.default_rng(10 + seed))
    fast, plain = _digits_both(arrays, p, numpy_only)
    _same_result(fast, plain, p)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ">f4"])
def test_digits_tiny_tensors(kernels, numpy_only, p, dtype):
    rng = np.random.default_rng(p)
    arrays = [(rng.standard_normal(64) * 10.0 ** rng.integers(-3, 3)).astype(dtype) for _ in range(2000)]
    fast, plain = _digits_both(arrays, p, numpy_only)
    _same_result(fast, plain, p)
    one = np.concatenate([a.astype(np.float64) for a in arrays])  # another layout, the same result
    assert partials.BinnedPowerSum(p).power(fast) == partials.BinnedPowerSum(p).power(
        partials.BinnedPowerSum(p).local([one])
    )


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("spread", [0, 10, 40, 150, 300])
def test_digits_wide_ranges_in_one_block(kernels, numpy_only, p, dtype, spread):
    # values far apart in one block: every fold has digits, and blocks of extreme
    # magnitude take the scaled route
    rng = np.random.default_rng(spread)
    hi = 300 if dtype is np.float64 else 35
    spread = min(spread, hi)
    x = rng.standard_normal(5000) * 10.0 ** rng.integers(-spread, spread + 1, 5000)
    x = x.astype(dtype)
    x[::97] = 0.0
    extremes = [x, x * (10.0 ** (hi - spread) if spread < hi else 1.0)]
    for arrays in ([x], extremes, [x[i : i + 100] for i in range(0, 5000, 100)]):
        fast, plain = _digits_both(arrays, p, numpy_only)
        _same_result(fast, plain, p)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_digits_special_values_in_some_blocks(kernels, numpy_only, value):
    arrays = [np.ones(1000) for _ in range(20)]
    arrays[4][700] = value
    arrays[9][3] = np.inf
    for p in (1, 2):
        fast, plain = _digits_both(arrays, p, numpy_only)
        _same_result(fast, plain, p)
        assert math.isnan(fast[1]) == (value != value) and not math.isfinite(fast[1])


def test_reproducible_norm_is_layout_free_with_many_tensors(kernels):
    rng = np.random.default_rng(5)
    flat = rng.standard_normal(64 * 500).astype(np.float32)
    pieces = [flat[i : i + 64].copy() for i in range(0, flat.size, 64)]
    odd = [flat[i : i + 77].copy() for i in range(0, flat.size, 77)]
    norms = {gclip.global_norm(g, comm=COMM, reproducible=True) for g in ([flat], pieces, odd, pieces[::-1])}
    assert len(norms) == 1


# ---------------------------------------------------------------------------
# the demo starts without numba


@pytest.mark.slow
def test_demo_never_imports_numba():
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun")
    proc = subprocess.run(  # -X importtime: every module imported, on stderr
        [mpirun, "-n", "2", sys.executable, "-X", "importtime", "-m", "gclip.demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPIEXEC_TIMEOUT": "100", "NO_COLOR": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| gclip" in proc.stderr  # the import log is there
    assert "numba" not in proc.stderr


def test_validate_fast_path_keeps_the_list_and_container(kernels):
    arrays = tuple(np.ones(4) for _ in range(20))
    got = reader.grads(arrays, inplace=True)
    assert got.container is tuple and got.slots is None and got.as_given() is arrays
    res = gclip.clip_by_global_norm(arrays, 1.0, comm=COMM)
    assert isinstance(res.grads, tuple) and len(res.grads) == 20


def test_one_header_read_per_clip(kernels, monkeypatch):
    # the checks read the table once; the sum and the in-place scale reuse it
    reads = []
    original = type(kernels).table

    def counted(self, arrays, writable=False):
        reads.append(writable)
        return original(self, arrays, writable)

    monkeypatch.setattr(type(kernels), "table", counted)
    arrays = [np.ones(8) for _ in range(20)]
    res = gclip.clip_by_global_norm(arrays, 1.0, comm=COMM, inplace=True)
    assert reads == [True]
    assert res.scale < 1 and np.linalg.norm(np.concatenate(arrays)) == pytest.approx(1.0)
    reads.clear()
    gclip.global_norm(arrays, comm=COMM)
    gclip.apply_scale(arrays, 0.5, inplace=True)
    assert reads == [False, True]
