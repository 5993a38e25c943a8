"""gclip.torch in one process: the torch backend against numpy's and an fsum oracle,
torch's own clip as a second oracle, dtypes, inputs, errors and memory.

The distributed tests are in test_torch_mpi.py (pytest-mpi) and
test_torch_launch.py (mpirun and torchrun jobs).
"""

from __future__ import annotations

import inspect
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip  # noqa: E402
import gclip.gallery.torch as gallery_torch  # noqa: E402
import gclip.torch as gt  # noqa: E402
import torch_oracle  # noqa: E402
from binned_digits import kept_bins  # noqa: E402
from conftest import OneRankComm  # noqa: E402
from gclip import _kernels, partials  # noqa: E402
from gclip.torch import _partials as tp  # noqa: E402
from torch_oracle import DTYPES, float64, fsum_norm, scaled_once  # noqa: E402

ONE = OneRankComm()


def parameters(seed: int, dtypes=DTYPES, scale: float = 1.0) -> list:
    """Parameters of several shapes and dtypes, each with a random gradient."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, dtype in enumerate(dtypes):
        for shape in [(7, 5), (33,), ()][: 1 + (i + seed) % 3]:
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
            p.grad = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
            out.append(p)
    return out


# ---------------------------------------------------------------------------
# the package and the signatures


def test_import_gclip_never_imports_torch():
    code = "import sys, gclip, gclip.clip, gclip.layout, gclip.engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (gt.clip_grad_norm_, torch.nn.utils.clip_grad_norm_),
        (gt.get_total_norm, torch.nn.utils.get_total_norm),
        (gt.clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_),
    ],
)
def test_signatures_are_torchs_plus_keyword_only_extras(ours, theirs):
    mine = list(inspect.signature(ours).parameters.values())
    torchs = list(inspect.signature(theirs).parameters.values())
    assert [(p.name, p.default, p.kind) for p in mine[: len(torchs)]] == [
        (p.name, p.default, p.kind) for p in torchs
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in mine[len(torchs) :])


# ---------------------------------------------------------------------------
# the backend: the same partials as numpy's, on the tensors' own device


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
def test_power_sums_are_float64_accurate(dtype, p):
    x = (torch.randn(300_001, dtype=torch.float64) * 3).to(dtype)
    exact = math.fsum((np.abs(float64(x)) ** p).tolist())
    got, rescue = tp.power_sum([x[:2000:2], x[1:2000:2], x[2000:].view(-1, 1).t()], p)  # strided too
    assert not rescue
    assert abs(got - exact) <= 1e-13 * exact


def test_power_sum_asks_for_the_rescue_when_squares_overflow_or_underflow():
    huge = torch.tensor([1e200, -3e200], dtype=torch.float64)
    tiny = torch.tensor([1e-200, 3e-200], dtype=torch.float64)
    assert tp.power_sum([huge], 2.0)[1] and tp.power_sum([tiny], 2.0)[1]
    assert tp.power_sum([torch.zeros(5)], 2.0) == (0.0, False)
    assert tp.power_sum([torch.tensor([1.0, math.inf])], 2.0) == (math.inf, False)
    norm = gt.get_total_norm([huge], comm=ONE).item()
    assert math.isclose(norm, math.hypot(1e200, 3e200), rel_tol=1e-15)


def test_max_abs_reads_nan_and_inf():
    assert tp.max_abs([torch.tensor([1.0, -4.0]).half(), torch.tensor([3.0]).bfloat16()]) == (4.0, False)
    assert tp.max_abs([torch.tensor([1.0, -math.inf])]) == (math.inf, False)
    assert tp.max_abs([torch.tensor([1.0, math.nan])])[1] is True
    assert tp.max_abs([torch.zeros(0)]) == (0.0, False)


@pytest.fixture(params=["compiled", "numpy"])
def numpy_digits(request, monkeypatch):
    """BinnedPowerSum.local with the compiled kernels, and with numpy alone."""
    if request.param == "numpy":
        monkeypatch.setenv("GCLIP_KERNELS", "0")
    elif _kernels.get() is None:
        pytest.skip("numba is not installed: the numpy digits are tested alone")
    _kernels.get.cache_clear()
    yield lambda binned, arrays: binned.local(arrays)
    _kernels.get.cache_clear()


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30, 1e-150, 1e150, 1e300, 1e-300, 1e-310])
def test_reproducible_digits_are_numpys_integers(numpy_digits, p, dtype, magnitude):
    info = torch.finfo(dtype)
    if not info.tiny * info.eps <= magnitude <= info.max / 1e3:
        magnitude = 1.0  # out of the dtype's range
    g = torch.Generator().manual_seed(p * 100 + DTYPES.index(dtype))
    x = torch.randn(3 * 65536 + 17, generator=g, dtype=torch.float64) * magnitude
    x[::5] *= 1e-7  # values far below the top bin too
    t = x.to(dtype)
    binned = partials.BinnedPowerSum(p)
    theirs = numpy_digits(binned, [float64(t)])
    parts = [t[:100].view(10, 10).t(), t[100:]]  # any split, any layout
    for mine in (tp.digits_with_torch_ops(binned, parts), tp.binned_digits(binned, parts)):
        assert kept_bins(binned, mine) == kept_bins(binned, theirs)
        assert binned.exact(mine) == binned.exact(theirs)
        assert binned.power(mine) == binned.power(theirs)


def test_reproducible_digits_of_mixed_dtypes_add_up_as_ranks_do():
    """CPU float16/32/64 go to numpy's digit kernel, bfloat16 to torch ops: the sum is the whole's."""
    g = torch.Generator().manual_seed(7)
    tensors = [(torch.randn(5000, generator=g, dtype=torch.float64) * 3).to(d) for d in DTYPES]
    tensors.append(tensors[0][::3])  # a strided view
    binned = partials.BinnedPowerSum(2)
    theirs = binned.local([float64(t) for t in tensors])
    mine = tp.binned_digits(binned, tensors)
    assert kept_bins(binned, mine) == kept_bins(binned, theirs) and mine[0] == theirs[0]
    assert binned.exact(mine) == binned.exact(theirs)


def test_reproducible_digits_carry_inf_and_nan():
    binned = partials.BinnedPowerSum(2)
    assert tp.binned_digits(binned, [torch.tensor([1.0, math.inf])])[1] == math.inf
    assert math.isnan(tp.binned_digits(binned, [torch.tensor([math.inf, 2.0]), torch.tensor([math.nan])])[1])
    for call in (tp.binned_digits, tp.digits_with_torch_ops):  # bfloat16 (torch ops) mixed with float32
        mixed = [torch.tensor([math.inf], dtype=torch.bfloat16), torch.tensor([math.nan, 1.0])]
        assert math.isnan(call(binned, mixed)[1])
        assert (
            call(binned, [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([math.inf])])[1] == math.inf
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),
        lambda b: b[::2, 1:],
        lambda b: b.view(4, 6, 2, 5).permute(0, 2, 3, 1),  # channels-last-like
        lambda b: b[3],
        lambda b: b[:, 7],
        lambda b: b[0, 0],
        lambda b: b[:0],
    ],
)
def test_chunks_read_every_element_once_through_views(make):
    base = torch.arange(1.0, 241.0).view(24, 10)
    t = make(base)
    got = list(tp.chunks(t, 7))
    assert all(c.dim() == 1 and c.numel() <= 7 for c in got)
    assert all(c.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for c in got)
    assert sorted(torch.cat(got).tolist() if got else []) == sorted(t.reshape(-1).tolist())


# ---------------------------------------------------------------------------
# the clip: against the fsum oracle and torch's own clip


@pytest.mark.parametrize("given", ["list", "generator", "tensor"])
def test_clip_is_the_fsum_norm_and_scales_every_grad_once_in_its_dtype(given):
    params = parameters(0)
    params[1].grad = None  # skipped, as torch skips it
    if given == "tensor":
        params = params[:1]
    before = [float64(p.grad) if p.grad is not None else None for p in params]
    norm = fsum_norm([b for b in before if b is not None])
    limit = norm * 0.37
    arg = {"list": params + params[:2], "generator": (p for p in params), "tensor": params[0]}[given]
    got = gt.clip_grad_norm_(arg, limit, comm=ONE)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64 and got.dim() == 0
    assert abs(got.item() - norm) <= 1e-12 * norm
    for p, b in zip(params, before):
        if b is None:
            assert p.grad is None
            continue
        assert p.grad.dtype == p.dtype
        ok, detail = scaled_once(b, p.grad, limit / got.item())  # the scale of the norm checked above
        assert ok, detail


@pytest.mark.parametrize("p", [1.0, 3.0, math.inf, "inf"])
def test_p_norms_match_the_oracle(p):
    params = parameters(1)
    before = [float64(q.grad) for q in params]
    got = gt.clip_grad_norm_(params, 1e9, norm_type=p, comm=ONE).item()
    exact = fsum_norm(before, math.inf if p == "inf" else p)
    assert abs(got - exact) <= 1e-12 * exact


def test_torchs_own_clip_is_a_second_oracle():
    ours, theirs = parameters(2, [torch.float64] * 4, 10.0), parameters(2, [torch.float64] * 4, 10.0)
    n_ours = gt.clip_grad_norm_(ours, 1.0, comm=ONE).item()
    n_theirs = torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
    assert abs(n_ours - n_theirs) <= 1e-12 * n_theirs
    # torch scales by max_norm / (norm + 1e-6), gclip by max_norm / norm: they differ by that factor
    factor = (n_theirs + 1e-6) / n_theirs
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad * factor, rtol=1e-14, atol=0)
    assert factor - 1 > 1e-9  # the difference is there to see (norm ~150: 1e-6 / 150)


def test_float32_norm_matches_torch_within_its_float32_accumulation():
    params = parameters(3, [torch.float32] * 4)
    ours = gt.get_total_norm([p.grad for p in params], comm=ONE)
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert math.isclose(ours.item(), theirs.item(), rel_tol=1e-6)
    assert ours.item() == pytest.approx(fsum_norm([float64(p.grad) for p in params]), rel=1e-13, abs=0)


def test_the_two_halves_give_the_whole():
    whole, halves = parameters(4), parameters(4)
    n1 = gt.clip_grad_norm_(whole, 0.5, comm=ONE)
    n2 = gt.get_total_norm([p.grad for p in halves], comm=ONE)
    gt.clip_grads_with_norm_(halves, 0.5, n2)
    assert n1.item() == n2.item()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(whole, halves))


def test_reproducible_norm_is_the_numpy_cores_bits_for_any_split():
    values = (torch.randn(10_007, dtype=torch.float64) * 1e3).to(torch.float32)
    core = gclip.global_norm([float64(values)], reproducible=True, comm=ONE)
    for parts in (1, 3, 10):
        chunks = list(values.tensor_split(parts))
        assert gt.get_total_norm(chunks, reproducible=True, comm=ONE).item() == core
    bf = values.bfloat16()
    core_bf = gclip.global_norm([float64(bf)], reproducible=True, comm=ONE)
    assert gt.get_total_norm(bf, reproducible=True, comm=ONE).item() == core_bf


def test_foreach_and_tensor_by_tensor_scale_the_same():
    a, b = parameters(5), parameters(5)
    gt.clip_grad_norm_(a, 0.3, comm=ONE, foreach=False)
    gt.clip_grad_norm_(b, 0.3, comm=ONE, foreach=True)
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b))


def test_scale_is_rounded_toward_zero():
    g = torch.ones(9, dtype=torch.float32)  # norm 3: the scale is 1/3, which float32 rounds up
    assert float(np.float32(1 / 3)) > 1 / 3
    p = torch.nn.Parameter(torch.zeros(9))
    p.grad = g
    gt.clip_grad_norm_(p, 1.0, comm=ONE)
    assert float(g[0]) <= 1 / 3 and 1 / 3 - float(g[0]) <= float(np.spacing(np.float32(1 / 3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_norm_stays_within_the_documented_rounding_bound(dtype):
    params = parameters(6, [dtype] * 4, 5.0)
    gt.clip_grad_norm_(params, 1.0, comm=ONE)
    after = fsum_norm([float64(p.grad) for p in params])
    bound = 1.0 + (2.0**-53 if dtype == torch.float64 else torch_oracle.UNIT_ROUNDOFF[dtype] + 2.0**-24)
    assert after <= bound


def test_a_nonfinite_norm_leaves_grads_untouched_or_raises():
    params = parameters(7)
    params[0].grad.view(-1)[0] = math.nan
    before = [p.grad.clone() for p in params]
    assert math.isnan(gt.clip_grad_norm_(params, 0.1, comm=ONE).item())
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(gclip.NonFiniteNormError, match="non-finite values on rank 0"):
        gt.clip_grad_norm_(params, 0.1, error_if_nonfinite=True, comm=ONE)


def test_views_of_one_memory_count_once_and_disjoint_views_are_fine():
    flat = torch.randn(30, dtype=torch.float64)
    a, b, c = (torch.nn.Parameter(torch.zeros(10, dtype=torch.float64)) for _ in range(3))
    a.grad, b.grad, c.grad = flat[:10], flat[:10], flat[10:20]  # a and b: the same view
    expected = fsum_norm([float64(flat[:20])])
    before = float64(flat)
    got = gt.clip_grad_norm_([a, b, c], 0.5, comm=ONE).item()
    assert got == pytest.approx(expected, rel=1e-14)
    ok, detail = scaled_once(before[:20], flat[:20], 0.5 / got)
    assert ok, detail
    assert np.array_equal(float64(flat[20:]), before[20:])  # not given: untouched


def test_the_gallery_modes_run_on_tensors():
    params = parameters(8, [torch.float32] * 4, 1e3)  # squares above float16's 65504
    n = fsum_norm([float64(p.grad) for p in params])
    assert gallery_torch.clip_grad_norm_(params, 1.0, comm=ONE, mode="epsilon").item() == pytest.approx(
        n, rel=1e-13
    )
    after = fsum_norm([float64(p.grad) for p in params])
    assert after == pytest.approx(1.0 * n / (n + 1e-6), rel=1e-6)
    params = parameters(8, [torch.float32] * 4, 1e3)
    assert math.isinf(gallery_torch.clip_grad_norm_(params, 1.0, comm=ONE, mode="fp16-sumsq").item())
    assert all(not p.grad.any() for p in params)  # max_norm / inf = 0: the step's gradient is wiped


# ---------------------------------------------------------------------------
# errors: one line, a GclipError (agreed on every rank: see test_torch_mpi.py)


def one_param(dtype=torch.float32, shape=(3,)):
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = torch.ones(shape, dtype=dtype)
    return p


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: gt.clip_grad_norm_(5, 1.0, comm=ONE), gclip.GclipTypeError, "iterable of tensors"),
        (lambda: gt.clip_grad_norm_([one_param(), 3], 1.0, comm=ONE), gclip.GclipTypeError, "parameters[1]"),
        (
            lambda: gt.clip_grad_norm_([("w", one_param())], 1.0, comm=ONE),
            gclip.GclipTypeError,
            "named_parameters",
        ),
        (lambda: gt.get_total_norm([torch.ones(2), None], comm=ONE), gclip.GclipTypeError, "[1] is None"),
        (lambda: gt.get_total_norm([torch.arange(3)], comm=ONE), gclip.GclipTypeError, "torch.int64"),
        (
            lambda: gt.get_total_norm([torch.ones(2).to_sparse()], comm=ONE),
            gclip.GclipTypeError,
            "dense tensors",
        ),
        (lambda: gt.clip_grad_norm_([one_param()], -1.0, comm=ONE), gclip.GclipValueError, "max_norm"),
        (lambda: gt.clip_grad_norm_([one_param()], 1.0, 0, comm=ONE), gclip.GclipValueError, "norm_type"),
        (
            lambda: gt.clip_grad_norm_([one_param()], 1.0, replicated=[True, False], comm=ONE),
            gclip.GclipValueError,
            "2 entries for 1 parameters",
        ),
        (
            lambda: gt.clip_grad_norm_([one_param()], 1.0, replicated=["x"], comm=ONE),
            gclip.GclipValueError,
            "replicated[0]: mesh dimension names need comm=DeviceMesh",
        ),
        (
            lambda: gt.clip_grad_norm_([one_param()], 1.0, replicated=[3.5], comm=ONE),
            gclip.GclipTypeError,
            "replicated[0]",
        ),
        (lambda: gt.clip_grad_norm_([one_param()], 1.0, comm="world"), gclip.GclipTypeError, "ProcessGroup"),
        (
            lambda: gallery_torch.clip_grad_norm_([one_param()], 1.0, mode="no", comm=ONE),
            gclip.GclipValueError,
            "mode",
        ),
    ],
)
def test_bad_arguments_are_one_line_gclip_errors(call, error, words):
    with pytest.raises(error) as got:
        call()
    assert words in str(got.value) and "\n" not in str(got.value)


def test_gradients_overlapping_in_part_are_an_error():
    flat = torch.zeros(20)
    a, b = one_param(shape=(10,)), one_param(shape=(10,))
    a.grad, b.grad = flat[:10], flat[5:15]
    with pytest.raises(gclip.GclipValueError, match=r"parameters\[0\].grad and parameters\[1\].grad overlap"):
        gt.clip_grad_norm_([a, b], 1.0, comm=ONE)


def test_a_parameter_given_twice_must_get_one_replicated_entry():
    p = one_param()
    with pytest.raises(gclip.GclipValueError, match="the same gradient but replicated gives them different"):
        gt.clip_grad_norm_([p, p], 1.0, replicated=[True, False], comm=ONE)


# ---------------------------------------------------------------------------
# the core API, given torch tensors (issue 12's first findings)


def test_core_api_takes_iterables_names_none_and_takes_tensor_limits():
    grads = [torch.ones(4), torch.full((3,), 2.0)]
    result = gclip.clip_by_global_norm((g for g in grads), torch.tensor(1.0), comm=ONE, inplace=True)
    assert result.total_norm == pytest.approx(4.0, rel=1e-15)
    assert grads[0][0].item() == pytest.approx(0.25, rel=1e-7)  # the tensors themselves, in place
    with pytest.raises(gclip.GclipTypeError, match=r"grads\[1\] is None"):
        gclip.clip_by_global_norm([grads[0], None], 1.0, comm=ONE)


def test_core_api_gives_tensors_back_for_tensors_when_not_in_place():
    """inplace=False: a new tensor for each tensor given (numpy arrays stay numpy), in the layout given."""
    t, a = torch.tensor([3.0, 4.0]), np.array([12.0])  # norm 13
    single = gclip.clip_by_global_norm(t, 1.0, comm=ONE).grads
    assert isinstance(single, torch.Tensor) and single.dtype == torch.float32
    assert single.tolist() == pytest.approx([0.6, 0.8], rel=2.0**-22) and t[0].item() == 3.0  # t untouched
    pair = gclip.clip_by_global_norm((t, a), 1.0, comm=ONE).grads
    assert type(pair) is tuple and isinstance(pair[0], torch.Tensor) and type(pair[1]) is np.ndarray
    assert pair[1][0] == 12.0 / 13.0
    tied = gclip.clip_by_global_norm([t, t], 1.0, comm=ONE).grads  # counted once: norm 5
    assert all(isinstance(g, torch.Tensor) for g in tied) and tied[0][1].item() == pytest.approx(0.8)
    halves = [gclip.clip_with_norm([t], 1.0, 5.0)[0], gclip.apply_scale([t], 0.5)[0]]
    assert all(isinstance(g, torch.Tensor) for g in halves)
    assert halves[1].tolist() == [1.5, 2.0]


@pytest.mark.parametrize("limit", [torch.tensor(2.0), torch.tensor([2.0]), torch.tensor([[2.0]])])
def test_a_tensor_limit_of_one_value_is_taken_as_torch_takes_it(limit):
    p = one_param(shape=(4,))  # grad ones(4): norm 2
    p.grad.mul_(2.0)  # norm 4
    gt.clip_grad_norm_([p], limit, comm=ONE)
    assert fsum_norm([p.grad]) == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(gclip.GclipTypeError, match="max_norm must be a number, got a Tensor of 2 values"):
        gt.clip_grad_norm_([p], torch.tensor([1.0, 2.0]), comm=ONE)


@pytest.mark.parametrize("api", ["core", "torch"])
def test_a_tensor_limit_changed_in_place_is_read_afresh(api):
    """A tensor hashes by identity: a limit kept in a tensor and updated in place must not be remembered."""
    limit = torch.tensor(1.0)
    for target in (1.0, 0.5, 0.25):
        limit.fill_(target)
        p = one_param(shape=(4,))  # norm 2, above every target
        if api == "core":
            gclip.clip_by_global_norm(p.grad, limit, comm=ONE, inplace=True)
        else:
            gt.clip_grad_norm_([p], limit, comm=ONE)
        assert fsum_norm([p.grad]) == pytest.approx(target, rel=1e-6)


@pytest.mark.parametrize(
    ("value", "words"),
    [(one_param(), "requires grad"), (torch.ones(2, dtype=torch.bfloat16), "use gclip.torch")],
)
def test_core_api_points_torch_users_to_gclip_torch(value, words):
    with pytest.raises(gclip.GclipTypeError, match=words):
        gclip.global_norm([value], comm=ONE)


# ---------------------------------------------------------------------------
# memory: bfloat16 is read in chunks, never copied whole


def largest_allocation(fn) -> int:
    """The largest CPU allocation any torch op made while ``fn`` ran, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("reproducible", [False, True])
def test_bfloat16_makes_no_full_size_float32_or_float64_copy(reproducible):
    n = 4_000_000
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    p.grad = torch.randn(n).bfloat16()
    chunk_bytes = 8 * tp.CPU_CHUNK  # one float64 working chunk
    clip = lambda: gt.clip_grad_norm_(p, 1.0, reproducible=reproducible, comm=ONE)  # noqa: E731
    clip()
    assert largest_allocation(clip) <= chunk_bytes
    assert largest_allocation(lambda: p.grad.float()) >= 4 * n  # the probe sees a full-size copy


# ---------------------------------------------------------------------------
# CUDA: the same code on the device (run where a GPU is present)


def test_cuda_path():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: tests/torch_cuda_check.py runs where one is present")
    import torch_cuda_check

    assert torch_cuda_check.main() == 0


def test_bfloat16_on_the_cpu_is_squared_from_its_bits_as_exactly_as_on_any_device(monkeypatch):
    """The compiled pass over bfloat16's bits and the torch path both give the fsum of exact squares."""
    from gclip import _kernels
    from gclip.torch import _partials

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(70_000, generator=gen) * 3).to(torch.bfloat16)
    x[7] = -7.5
    exact = math.fsum(float(v) ** 2 for v in x.to(torch.float64).tolist())
    compiled = _partials.power_sum([x], 2.0)[0]
    monkeypatch.setenv("GCLIP_KERNELS", "0")
    _kernels.get.cache_clear()
    try:
        plain = _partials.power_sum([x], 2.0)[0]
    finally:
        monkeypatch.delenv("GCLIP_KERNELS")
        _kernels.get.cache_clear()
    assert abs(compiled - exact) / exact < 1e-13
    assert abs(plain - exact) / exact < 1e-13


# ---------------------------------------------------------------------------
# one process: engine.alone's shortcut gives what the program gives


@pytest.mark.parametrize("count", [1, 2, 20])
@pytest.mark.parametrize("limit", [0.0, 1e-40, 0.5, 1e9, math.inf])
def test_the_one_process_shortcut_is_the_programs_result(monkeypatch, count, limit):
    """Each dtype, one or many parameters, with and without the header's program: the same
    norm and the same gradients, bit for bit; the norm also against fsum."""
    for seed, special in enumerate([None, math.inf, math.nan, 1e30]):
        runs = []
        for shortcut in (True, False):
            params = parameters(seed, scale=3.0)[:count]
            if special is not None:
                params[0].grad.view(-1)[0] = special
            with monkeypatch.context() as m:
                if not shortcut:
                    m.setattr(gclip.engine, "alone", lambda args: None)
                norm = gt.clip_grad_norm_(params, limit, comm=ONE)
            runs.append((norm, [p.grad.clone() for p in params]))
        (norm_a, grads_a), (norm_b, grads_b) = runs
        assert torch.equal(norm_a, norm_b) or (norm_a.isnan() and norm_b.isnan())
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())
        if special is None:
            want = fsum_norm([p.grad.double().numpy() for p in parameters(seed, scale=3.0)[:count]])
            assert math.isclose(float(norm_a), want, rel_tol=1e-12)


@pytest.mark.parametrize("settings", [{"error_if_nonfinite": True}, {"reproducible": True}])
def test_under_compile_the_host_paths_settings_run_eagerly(settings):
    """What the device path does not take runs eagerly inside a compiled function (a graph
    break): the eager result, and error_if_nonfinite's own error, not a tracing failure."""
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.zeros(10))
    grad = torch.randn(10, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(lambda: gt.clip_grad_norm_([p], 0.5, **settings), backend="eager")
    p.grad = grad.clone()
    got = compiled()
    assert math.isclose(float(got), fsum_norm([grad.double().numpy()]), rel_tol=1e-12)
    ok, info = scaled_once(grad.double().numpy(), p.grad, 0.5 / float(got))
    assert ok, info
    if settings.get("error_if_nonfinite"):
        p.grad = grad.clone()
        p.grad[0] = math.inf
        with pytest.raises(gclip.NonFiniteNormError):
            compiled()
