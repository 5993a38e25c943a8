"""Numerics on simulated ranks: dtypes, accuracy, p-norms, non-finite, overflow, in place."""

from __future__ import annotations

import array
import math
from fractions import Fraction

import numpy as np
import pytest

import gclip
import gclip.gallery
from conftest import OneRankComm
from gclip import partials


def split(values: np.ndarray, ranks: int) -> list[np.ndarray]:
    return np.array_split(values, ranks)


def exact_pnorm(values, p: float) -> float:
    """sum |x|^p exactly for integer p (Fraction), then the p-th root."""
    total = sum((abs(Fraction(float(v))) ** int(p) for v in np.ravel(values)), Fraction(0))
    return float(total) ** (1.0 / p)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_are_kept_and_accumulation_is_float64(dtype):
    rng = np.random.default_rng(0)
    shards = [rng.normal(size=(3, 4)).astype(dtype), rng.normal(size=7).astype(dtype), np.zeros(0, dtype)]
    results = gclip.clip_simulated(shards, 0.5)
    exact = exact_pnorm(np.concatenate([s.ravel() for s in shards]).astype(np.float64), 2)
    assert math.isclose(results[0].total_norm, exact, rel_tol=1e-15)
    for shard, r in zip(shards, results):
        assert r.grads.dtype == dtype and r.grads.shape == shard.shape
    clipped = np.concatenate([r.grads.ravel().astype(np.float64) for r in results])
    eps = float(np.finfo(dtype).eps)
    assert math.isclose(float(np.linalg.norm(clipped)), 0.5, rel_tol=4 * eps)


def test_float32_sum_of_1e7_elements_is_accurate_to_1e12():
    x = np.random.default_rng(1).normal(size=10_000_000).astype(np.float32)
    ref = math.sqrt(math.fsum(np.square(x.astype(np.float64))))
    got = gclip.clip_simulated(split(x, 2), 1.0)[0].total_norm
    naive = math.sqrt(float(np.dot(x, x)))  # a float32 dot, for contrast
    assert abs(got - ref) / ref < 1e-12
    assert abs(naive - ref) / ref > 1e-9  # what gclip avoids


def test_many_arrays_per_rank_empty_arrays_and_ranks_with_nothing():
    rng = np.random.default_rng(2)
    a, b, c = rng.normal(size=(2, 3)), rng.normal(size=5), rng.normal(size=(1, 1, 4))
    ranks = [[a, np.zeros((0, 3))], [], [b, c], np.zeros(0)]
    results = gclip.clip_simulated(ranks, 1.0)
    ref = math.sqrt(sum(float(np.sum(t * t)) for t in (a, b, c)))
    assert all(math.isclose(r.total_norm, ref, rel_tol=1e-14) for r in results)
    assert [len(r.grads) for r in results[:3]] == [2, 0, 2]
    assert isinstance(results[3].grads, np.ndarray) and results[3].grads.size == 0


def test_buffer_protocol_and_array_interface_inputs():
    buf = array.array("d", [3.0, 0.0])
    mem = memoryview(array.array("f", [0.0, 4.0]))
    result = gclip.clip_simulated([[buf], [mem]], 2.5)
    assert math.isclose(result[0].total_norm, 5.0)
    assert result[0].grads[0].tolist() == [1.5, 0.0] and result[1].grads[0].tolist() == [0.0, 2.0]


@pytest.mark.parametrize("p", [1, 2, 3])
def test_integer_p_norms_match_an_exact_oracle(p):
    rng = np.random.default_rng(p)
    x = rng.normal(size=301)
    got = gclip.clip_simulated(split(x, 3), 1.0, norm_type=p)[0].total_norm
    assert math.isclose(got, exact_pnorm(x, p), rel_tol=1e-13)


@pytest.mark.parametrize("p", [0.5, 1, 2, 3, 4.5, math.inf])
def test_p_norms_match_torch_on_any_layout(p):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = rng.normal(size=500) * 3
    ref = float(torch.linalg.vector_norm(torch.from_numpy(x), ord=p))
    for ranks in (1, 2, 3, 4):
        got = gclip.clip_simulated(split(x, ranks), 1.0, norm_type=p)[0].total_norm
        assert math.isclose(got, ref, rel_tol=1e-12), (ranks, got, ref)


def test_inf_norm_is_the_max_and_not_total_pow_zero():
    x = np.array([0.5, -7.0, 3.0])
    assert gclip.clip_simulated(split(x, 2), 1.0, norm_type="inf")[0].total_norm == 7.0
    assert (
        gclip.gallery.clip_simulated(split(x, 2), 1.0, norm_type=math.inf, mode="inf-pow")[0].total_norm
        == 1.0
    )


@pytest.mark.parametrize("p", [0, -1, math.nan, "two", True, None])
def test_invalid_norm_types_are_errors(p):
    with pytest.raises(gclip.GclipError):
        gclip.clip_simulated([np.ones(2)], 1.0, norm_type=p)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_left_untouched_and_reported(bad):
    shards = [np.array([1.0, 2.0]), np.array([bad, 3.0])]
    results = gclip.clip_simulated(shards, 0.1)
    for shard, r in zip(shards, results):
        assert not r.finite and r.scale == 1.0
        np.testing.assert_array_equal(r.grads, shard)
    assert math.isnan(results[0].total_norm) if math.isnan(bad) else results[0].total_norm == math.inf


def test_nonfinite_with_error_if_nonfinite_raises():
    shards = [np.array([1.0]), np.array([math.nan])]
    with pytest.raises(gclip.NonFiniteNormError):
        gclip.clip_simulated(shards, 1.0, error_if_nonfinite=True)


def test_frameworks_wipe_gradients_on_overflow_gclip_does_not():
    big = np.array([300.0, 300.0], dtype=np.float32)  # sum of squares 180000 > float16 max
    bug = gclip.gallery.clip_simulated([big], 1.0, mode="fp16-sumsq")[0]
    ok = gclip.clip_simulated([big], 1.0)[0]
    assert bug.total_norm == math.inf and bug.scale == 0.0 and not np.any(bug.grads)
    assert math.isclose(ok.total_norm, math.hypot(300, 300), rel_tol=1e-15)


@pytest.mark.parametrize("magnitude", [1e200, 1e-200, 1e154, 1e-160, 1.5e308, 5e-324])
@pytest.mark.parametrize("reproducible", [False, True])
def test_no_overflow_no_underflow(magnitude, reproducible):
    x = np.random.default_rng(6).uniform(0.5, 1.0, size=50) * magnitude
    ref = math.hypot(*x.tolist())
    for ranks in (1, 3):
        got = gclip.clip_simulated(split(x, ranks), 1.0, reproducible=reproducible)[0].total_norm
        assert math.isclose(got, ref, rel_tol=1e-12), (ranks, got, ref)


def test_mixed_magnitudes_across_ranks():
    shards = [np.array([1e200, 3e199]), np.array([1e-200]), np.array([2.0])]
    ref = math.hypot(1e200, 3e199, 1e-200, 2.0)
    assert math.isclose(gclip.clip_simulated(shards, 1.0)[0].total_norm, ref, rel_tol=1e-15)


def test_double_counting_numbers():
    """A replicated bias on 4 ranks: counted once by gclip, 4 times by the bug."""
    shards = [np.full(3, 1.0) for _ in range(4)]
    bias = np.array([2.0, 2.0])
    ranks = [[s, bias] for s in shards]
    right = gclip.clip_simulated(ranks, 1.0, replicated=[False, True])[0].total_norm
    wrong = gclip.gallery.clip_simulated(ranks, 1.0, replicated=[False, True], mode="double-count")[
        0
    ].total_norm
    assert right == math.sqrt(12 + 8) and wrong == math.sqrt(12 + 4 * 8)


def test_inplace_scales_the_given_arrays():
    a, b = np.array([3.0, 0.0]), np.array([[0.0], [4.0]], dtype=np.float32)
    result = gclip.clip_simulated([[a, b]], 1.0)  # not in place: originals untouched
    assert a[0] == 3.0 and math.isclose(result[0].grads[0][0], 0.6, rel_tol=1e-15)
    out = gclip.clip_by_global_norm([a, b], 1.0, inplace=True, comm=OneRankComm())
    assert out.grads[0] is a and out.grads[1] is b
    assert math.isclose(a[0], 0.6, rel_tol=1e-15) and b.dtype == np.float32
    assert math.isclose(float(b[1, 0]), 0.8, rel_tol=1e-7)


def test_float32_scale_never_rounds_up():
    x = np.full(1000, 1.0, dtype=np.float32)
    out = gclip.apply_scale(x, 1 / 3)
    assert float(out[0]) <= 1 / 3 and (1 / 3 - float(out[0])) <= float(np.spacing(np.float32(1 / 3)))


def test_inplace_needs_float_arrays():
    comm = OneRankComm()
    with pytest.raises(gclip.GclipTypeError):
        gclip.clip_by_global_norm(np.arange(3), 1.0, inplace=True, comm=comm)
    with pytest.raises(gclip.GclipTypeError):
        gclip.clip_by_global_norm([[1.0, 2.0]], 1.0, inplace=True, comm=comm)
    ro = np.ones(2)
    ro.flags.writeable = False
    with pytest.raises(gclip.GclipValueError):
        gclip.clip_by_global_norm(ro, 1.0, inplace=True, comm=comm)


def test_inplace_with_scale_one_does_not_touch_memory(monkeypatch):
    calls = []
    real = partials._multiply_one
    monkeypatch.setattr(partials, "_multiply_one", lambda *a: calls.append(1) or real(*a))
    x = np.array([0.1, 0.2])
    gclip.clip_by_global_norm(x, 10.0, inplace=True, comm=OneRankComm())
    assert calls == []
    gclip.clip_by_global_norm(x, 0.1, inplace=True, comm=OneRankComm())
    assert calls == [1]


def test_strided_views_are_read_and_scaled_in_place_without_copies():
    from gclip.partials import iter_chunks

    base = np.arange(1.0, 41.0).reshape(4, 10)
    views = [base[:, ::3], base[1, ::2], base.T]
    for v in views:
        assert all(np.shares_memory(c, base) for c in iter_chunks(v, 4))
    strided = base[::2, ::2]
    expected = strided * (1.0 / np.linalg.norm(strided))
    gclip.clip_by_global_norm(strided, 1.0, inplace=True, comm=OneRankComm())
    np.testing.assert_allclose(base[::2, ::2], expected, rtol=1e-15)
    assert base[1, 0] == 11.0  # the elements between the strides are untouched
