"""The bench's list workloads (a model's gradient as many arrays) and the targets that read
them: shapes as data, the rows' arithmetic, the torch op against torch's own clip, the
verdicts. No timing is asserted."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gclip._lab.cli import UsageError
from gclip.bench import lists, options, sweep, table, targets, workloads
from gclip.bench.ops import Norm
from gclip.gallery import TORCH_EPS


def test_gpt2_small_has_its_148_parameters():
    shapes = workloads.GPT2_SMALL
    assert len(shapes) == 148
    assert sum(math.prod(s) for s in shapes) == 124_439_808
    assert shapes[0] == (50257, 768) and shapes[1] == (1024, 768)
    tiny = {w.name: w for w in workloads.LISTS}["tiny"]
    assert tiny.shapes == ((64,),) * 2000


def test_list_arrays_are_separate_and_seeded_by_rank():
    w = workloads.ListWorkload("t", ((3,), (2, 2)), "float32", 1)
    a, b = workloads.list_arrays(w, 0), workloads.list_arrays(w, 1)
    assert [x.shape for x in a] == [(3,), (2, 2)] and all(x.dtype == np.float32 for x in a)
    assert not np.shares_memory(a[0], a[1])
    assert not np.array_equal(a[0], b[0])


def test_parse_lists():
    assert options.parse_lists("gpt2-small,tiny") == ["gpt2-small", "tiny"]
    assert options.parse_lists("none") == [] and options.parse_lists("") == []
    with pytest.raises(UsageError, match="not one of"):
        options.parse_lists("gpt3")


def _times(**medians):
    return {k: {"median_s": v, "min_s": v, "reps": 5} for k, v in medians.items()}


def test_list_rows_arithmetic():
    w = workloads.ListWorkload("tiny", ((64,),) * 2000, "float32", 5)
    rows = {r["impl"]: r for r in lists.list_rows(w, True, _times(**{
        "gclip": 2e-3, "gclip-repro": 3e-3, "torch-foreach": 8e-3}), misses=1)}  # fmt: skip
    assert rows["gclip"]["per_tensor_s"] == pytest.approx(1e-6)
    assert rows["gclip"]["vs_torch"] == pytest.approx(0.25)
    assert rows["gclip-repro"]["vs_torch"] == pytest.approx(0.375)
    assert rows["gclip-repro"]["vs_default"] == pytest.approx(1.5)
    assert rows["gclip"]["misses"] == 1 and "misses" not in rows["torch-foreach"]
    assert rows["gclip"]["elements"] == 128_000
    text = table.format_lists(list(rows.values()))
    assert "tiny" in text and "0.25" in text
    assert "vs_floor" not in rows["gclip"]  # no floor measured: no ratio to it


def test_list_rows_against_the_floor():
    w = workloads.ListWorkload("tiny", ((64,),) * 2000, "float32", 5)
    rows = {r["impl"]: r for r in lists.list_rows(w, True, _times(**{
        "floor": 1e-3, "gclip": 2e-3, "gclip-repro": 3e-3, "torch-foreach": 8e-3}), misses=0)}  # fmt: skip
    assert rows["gclip"]["vs_floor"] == pytest.approx(2.0)
    assert rows["gclip-repro"]["vs_floor"] == pytest.approx(3.0)
    assert rows["floor"]["vs_torch"] == pytest.approx(0.125)
    line = next(x for x in table.format_lists(list(rows.values())).splitlines() if x.startswith("tiny"))
    assert line.split()[-1] == "0.12" and "2.00" in line.split()


def test_list_targets_read_the_rows():
    w = workloads.ListWorkload("gpt2-small", workloads.GPT2_SMALL, "float32", 5)
    rows = lists.list_rows(w, False, _times(**{"gclip": 5e-2, "gclip-repro": 9e-2, "torch-foreach": 1e-1}), 0)
    rows += lists.list_rows(w, True, _times(**{
        "floor": 6e-2, "gclip": 7e-2, "gclip-repro": 9e-2, "torch-foreach": 1e-1}), 0)  # fmt: skip
    m = targets.Measured([], [], {"default_active": {"total": 1, "pickle_based": 0}}, 1e-6, rows)
    got = {t["name"]: t for t in targets.evaluate(m)}
    assert got["gpt2-small inactive: gclip / torch foreach"]["ok"] is True  # 0.5 <= 0.6
    assert got["gpt2-small active: gclip / torch foreach"]["ok"] is False  # 0.7 > 0.6
    assert "reproducible: 0.90x torch" in got["gpt2-small inactive: gclip / torch foreach"]["note"]
    active = got["gpt2-small active: gclip / torch foreach"]["note"]
    assert "the floor (bare memory passes): 0.60x torch" in active
    assert "tiny inactive: gclip / torch foreach" not in got  # not measured: left out


def test_reproducible_and_layout_targets():
    rows = [
        {"n": 10**7, "dtype": "float32", "active": False, "impl": "gclip-repro", "vs_default": 2.4},
        {"n": 10**7, "dtype": "float64", "active": False, "impl": "gclip-repro", "vs_default": 1.25},
    ]
    counts = {
        "default_active": {"total": 1, "pickle_based": 0},
        "layout_flag": {"total": 1, "pickle_based": 0},
        "layout_communicator": {"total": 2, "pickle_based": 0},
    }
    got = {t["name"]: t for t in targets.targets(rows, [], counts, 1e-6)}
    assert got["float32 1e7 inactive: reproducible / default"]["ok"] is False  # limit 1.5
    assert got["float64 1e7 inactive: reproducible / default"]["ok"] is True
    assert got["collectives per clip with a replicated array"]["value"] == 2
    assert got["collectives per clip with a replicated array"]["ok"] is False


class _OneRankDist:
    @staticmethod
    def all_reduce(t):
        return t


def test_torch_foreach_op_is_torchs_clip():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((5, 3), (7,), (64,))]
    copies = [torch.from_numpy(a.copy()) for a in arrays]
    ctx = type("Ctx", (), {"torch": torch, "dist": _OneRankDist()})()
    norm = Norm(float(np.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays))))
    op = lists.torch_foreach(ctx, arrays, norm, lambda: 0.5, active=True)
    op()
    params = []
    for c in copies:
        p = torch.nn.Parameter(torch.zeros_like(c))
        p.grad = c
        params.append(p)
    torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
    for a, c in zip(arrays, copies):
        assert np.array_equal(a, c.numpy())
    assert norm.value == pytest.approx(0.5, rel=1e-5)


def test_sweep_marks_oversubscribed_rank_counts():
    rows = [
        {"ranks": r, "n": 1000, "dtype": "float64", "active": True, "gclip_s": 1e-5, "floor_s": 1e-6,
         "vs_floor": 10.0, "allreduce_s": 1e-6}
        for r in (1, 2, 4, 8)
    ]  # fmt: skip
    text = sweep.format_sweep({"sweep": rows, "cpus": 2})
    machine, head = text.splitlines()[:2]  # the bench names its machine first, then the table
    assert machine.startswith("machine:")
    assert "gclip R=2 " in head and "gclip R=4*" in head and "gclip R=8*" in head
    assert "*: R=4,8 oversubscribes the 2 cores" in text
    assert workloads.DEFAULT_RANKS == "1,2,4,8"


def test_torch_list_rows_and_table_by_hand():
    """gclip.torch against torch's clip plus one all-reduce: the ratio, the table."""
    from gclip.bench import torch_lists

    wl = workloads.TORCH_LISTS[1]
    assert wl.dtype == "bfloat16" and wl.shapes == workloads.GPT2_SMALL
    times = {
        "gclip.torch": {"median_s": 0.05, "min_s": 0.04, "reps": 5},
        "torch+allreduce": {"median_s": 0.1, "min_s": 0.09, "reps": 5},
    }
    rows = torch_lists._rows(wl, True, times)
    mine = next(r for r in rows if r["impl"] == "gclip.torch")
    assert mine["vs_torch"] == 0.5 and mine["tensors"] == 148 and mine["elements"] == 124_439_808
    assert "vs_torch" not in next(r for r in rows if r["impl"] == "torch+allreduce")
    text = table.format_torch_lists(rows)
    assert "gpt2-small-torch-bf16" in text and "bfloat16" in text and "0.50" in text
    times["gclip.torch-repro"] = {"median_s": 0.15, "min_s": 0.14, "reps": 5}
    repro = next(r for r in torch_lists._rows(wl, True, times) if r["impl"] == "gclip.torch-repro")
    assert repro["vs_torch"] == pytest.approx(1.5) and repro["vs_default"] == pytest.approx(3.0)
    last = table.format_torch_lists([*rows, repro]).splitlines()[-1]
    assert last.split()[-3:] == ["150", "ms", "3.00"], last
    assert options.parse_lists("gpt2-small-torch,gpt2-small-torch-bf16") == [
        "gpt2-small-torch",
        "gpt2-small-torch-bf16",
    ]


def test_torch_list_ops_clip_like_torch():
    """Both ops end at the same clipped norm on one rank (a group of one over gloo)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        _both_ops_clip(torch, dist)
    finally:
        if started:  # later tests in this process must not find a torch group (comm=None would use it)
            dist.destroy_process_group()


def _both_ops_clip(torch, dist) -> None:
    from gclip.bench import torch_lists

    class Ctx:
        pass

    ctx = Ctx()
    ctx.torch, ctx.dist = torch, dist
    wl = workloads.ListWorkload("small", ((5, 3), (7,)), "float32", 1)
    for name in ("gclip.torch", "gclip.torch-repro", "torch+allreduce"):
        params = torch_lists._params(torch, wl, 0)
        before = math.sqrt(math.fsum(float(v) ** 2 for p in params for v in p.grad.double().flatten()))
        norm = Norm(before)
        ops = dict(torch_lists._ops(ctx, params, norm, active=True))
        ops[name]()
        after = math.sqrt(math.fsum(float(v) ** 2 for p in params for v in p.grad.double().flatten()))
        limit = before * (1 - workloads.DELTA)
        # gclip clips to the limit; torch to limit * norm / (norm + 1e-6), its epsilon
        want = limit if name.startswith("gclip.torch") else limit * before / (before + TORCH_EPS)
        assert after < before and math.isclose(after, want, rel_tol=1e-6), name


@pytest.mark.parametrize("active", [False, True])
def test_every_list_op_runs_on_matrices_and_clips_to_the_limit(active):
    """The floor, gclip and gclip-repro on 2-D arrays (np.dot of matrices would be a product):
    active, each op ends at its limit (an fsum oracle); inactive, the data are untouched."""
    from mpi4py import MPI

    wl = workloads.ListWorkload("small", ((5, 3), (7,), (2, 2, 2)), "float32", 1)
    for name in ("floor", "gclip", "gclip-repro"):
        arrays = workloads.list_arrays(wl, 0)
        original = [a.copy() for a in arrays]
        before = math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in a.ravel()))
        norm = Norm(before)
        ops = dict(lists._ops(arrays, norm, active, None, MPI.COMM_SELF))
        ops[name]()
        after = math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in a.ravel()))
        if active:
            assert math.isclose(after, before * (1 - workloads.DELTA), rel_tol=1e-6), name
            assert math.isclose(norm.value, after, rel_tol=1e-6), name  # the next rep's limit follows
        else:
            assert all(np.array_equal(a, o) for a, o in zip(arrays, original)), name


def test_overhead_rows_and_table_by_hand():
    """The one-process rows: the ratio to torch's clip, the target (1.05 for GPT-2 active only),
    the table; ``--lists overhead`` names the three workloads."""
    from gclip.bench import torch_overhead

    assert options.parse_lists("overhead") == [w.name for w in workloads.OVERHEAD_LISTS]
    assert [len(w.shapes) for w in workloads.OVERHEAD_LISTS] == [1, 2000, 148]
    gpt2 = workloads.OVERHEAD_LISTS[2]
    assert torch_overhead.limit_of(gpt2, True) == 1.05 and torch_overhead.limit_of(gpt2, False) == 1.0
    times = {
        "gclip.torch": {"median_s": 0.0011, "min_s": 0.001, "reps": 5, "cpu_median_s": 0.001},
        "torch": {"median_s": 0.001, "min_s": 0.0009, "reps": 5, "cpu_median_s": 0.002},
    }
    rows = torch_overhead.overhead_rows(gpt2, True, times, 0)
    mine = next(r for r in rows if r["impl"] == "gclip.torch")
    assert mine["vs_torch"] == pytest.approx(1.1) and mine["cpu_vs_torch"] == pytest.approx(0.5)
    assert mine["ok"] is False and mine["limit"] == 1.05
    line = table.format_torch_overhead(rows).splitlines()[-1]
    assert line.split()[:3] == ["overhead-gpt2-small", "148", "active"] and "MISS <= 1.05" in line, line


@pytest.mark.parametrize("active", [False, True])
def test_overhead_ops_clip_like_torch(active):
    """Both one-process ops on a small list: active, each ends at its limit (fsum oracle);
    off, the gradients are untouched."""
    torch = pytest.importorskip("torch")
    from gclip.bench import torch_overhead

    wl = workloads.ListWorkload("small", ((5, 3), (7,), (64,)), "float32", 1)
    for name in ("gclip.torch", "torch"):
        params = torch_lists_params(torch, wl)
        original = [p.grad.clone() for p in params]
        before = math.sqrt(math.fsum(float(v) ** 2 for p in params for v in p.grad.double().flatten()))
        norm = Norm(before)
        ops = dict(torch_overhead.overhead_ops(torch, params, norm, active))
        ops[name]()
        after = math.sqrt(math.fsum(float(v) ** 2 for p in params for v in p.grad.double().flatten()))
        if active:
            limit = before * (1 - workloads.DELTA)
            want = limit if name == "gclip.torch" else limit * before / (before + TORCH_EPS)
            assert math.isclose(after, want, rel_tol=1e-6), name
            assert math.isclose(norm.value, after, rel_tol=1e-6), name
        else:
            assert all(torch.equal(p.grad, o) for p, o in zip(params, original)), name


def torch_lists_params(torch, wl):
    from gclip.bench import torch_lists

    return torch_lists._params(torch, wl, 0)
