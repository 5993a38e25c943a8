"""The bench's optimizer-step rows (what clipping adds to a fused AdamW step): the rows' arithmetic
by hand, and each op doing what its name says, on one rank of gloo. No timing is asserted."""

from __future__ import annotations

import pytest

from gclip.bench import options, table, workloads

torch = pytest.importorskip("torch", reason="the step rows time torch optimizers")

from gclip.bench import step  # noqa: E402


def test_step_rows_by_hand():
    wl = step.STEP_LISTS[1]
    assert wl.dtype == "bfloat16" and wl.shapes == workloads.GPT2_SMALL
    ms = {"step": 100, "torch-clip+step": 160, "gclip-folded+step": 120}
    ms |= {"amp-step": 110, "torch-amp-clip+step": 210, "gclip-folded-amp+step": 130}
    # (wall, CPU) per rep; the slowest rank per rep counts, in each
    rank0 = {k: [(v * 1e-3, v * 1e-3), (1.0, 0.0)] for k, v in ms.items()}
    rank1 = {k: [(0.0, 0.0), (v * 1e-3, 0.5 * v * 1e-3)] for k, v in ms.items()}
    rows = {r["impl"]: r for r in step._rows(wl, [rank0, rank1])}
    # per rep the slower rank: (v, 1.0), so each median is (v + 1) / 2 and the added times halve
    assert rows["gclip-folded+step"]["adds_s"] == pytest.approx(0.01)
    assert rows["gclip-folded+step"]["vs_torch"] == pytest.approx(20 / 60)
    assert rows["gclip-folded-amp+step"]["vs_torch"] == pytest.approx(20 / 100)
    assert rows["step"]["ranks"] == 2 and "adds_s" not in rows["step"]
    assert "torch_fold_s" not in rows["gclip-folded+step"]  # no step+grad_scale row measured
    # CPU: per rep the busier rank, (v, v/2): medians 3v/4, the same ratios
    assert rows["gclip-folded+step"]["cpu_adds_s"] == pytest.approx(0.015)
    assert rows["gclip-folded-amp+step"]["cpu_vs_torch"] == pytest.approx(20 / 100)
    ms["step+grad_scale"] = 106  # torch's step handed grad_scale alone: its part of the folded clip
    rank0 = {k: [(v * 1e-3, v * 1e-3), (1.0, 0.0)] for k, v in ms.items()}
    rank1 = {k: [(0.0, 0.0), (v * 1e-3, 0.5 * v * 1e-3)] for k, v in ms.items()}
    folded = {r["impl"]: r for r in step._rows(wl, [rank0, rank1])}["gclip-folded+step"]
    assert folded["torch_fold_s"] == pytest.approx(0.003)
    assert folded["cpu_torch_fold_s"] == pytest.approx(0.0045)
    assert folded["vs_torch"] == pytest.approx(20 / 60)  # unchanged by the extra row
    text = table.format_steps(list(rows.values()))
    assert "0.33" in text and "0.20" in text and "gpt2-small-step-bf16" in text
    assert options.parse_lists("gpt2-small-step,gpt2-small-step-bf16") == [
        "gpt2-small-step",
        "gpt2-small-step-bf16",
    ]


def test_step_ops_step_as_their_names_say():
    """From the same gradients, each op's parameters: the clipped ops match each other (folded or
    not, with the scaler or not) and differ from the unclipped steps."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        _ops_agree(dist)
    finally:
        if started:
            dist.destroy_process_group()


def _ops_agree(dist) -> None:
    class Ctx:
        pass

    ctx = Ctx()
    ctx.torch, ctx.dist = torch, dist
    wl = workloads.ListWorkload("small", ((50, 30), (70,)), "float32", 1)
    after = {}
    for name in (
        "step",
        "torch-clip+step",
        "gclip-folded+step",
        "step+grad_scale",
        "amp-step",
        "torch-amp-clip+step",
        "gclip-folded-amp+step",
    ):
        params, saved = step._setup(torch, wl, 0)
        norm = float(torch.nn.utils.get_total_norm(saved))
        opt, listed = step._ops(ctx, params, 0.5 * norm)
        ops = {n: (amp, op) for n, amp, op in listed}
        amp, op = ops[name]
        if amp:
            torch._foreach_mul_([p.grad for p in params], step.LOSS_SCALE)
        with torch.no_grad():
            op()
        # AdamW's first step is the same for any scale of the gradient; its first moment is not:
        # (1 - beta1) times the gradient it was given, clipped or not
        after[name] = torch.cat([opt.state[p]["exp_avg"].flatten() for p in params]) / 0.1
    want = torch.cat([g.flatten() for g in saved])
    for name in ("step", "amp-step"):
        assert torch.allclose(after[name], want, rtol=1e-5, atol=0), name
    clipped = ("torch-clip+step", "gclip-folded+step", "torch-amp-clip+step", "gclip-folded-amp+step")
    for name in (*clipped, "step+grad_scale"):  # the last: grad_scale 2 alone
        assert torch.allclose(after[name], 0.5 * want, rtol=1e-4, atol=0), name  # torch: + 1e-6 on the norm


def test_first_call_memory_is_measured_in_a_fresh_process():
    """The one-time cost: numba imported in the child, its peak RSS grown by more than the second
    call's (the copy clip_simulated returns is in both), by less than a gigabyte."""
    from gclip import _kernels
    from gclip.bench import memory

    if _kernels.get() is None:
        pytest.skip("numba is not installed here, or GCLIP_KERNELS=0")
    got = memory.first_call_memory()
    if got is None:
        pytest.skip("peak RSS is not readable here (/proc/self/clear_refs)")
    assert got["numba_loaded"] is True
    assert 1 << 20 < got["default"] < 1 << 30


def test_step_targets_read_the_step_rows():
    from gclip.bench import targets

    rows = [
        {
            "workload": "gpt2-small-step",
            "impl": "gclip-folded+step",
            "vs_torch": 0.35,
            "adds_s": 0.02,
            "ranks": 1,
        },
        {
            "workload": "gpt2-small-step",
            "impl": "gclip-folded-amp+step",
            "vs_torch": 0.35,
            "adds_s": 0.02,
            "ranks": 1,
        },
    ]
    counts = {
        "default_active": {"total": 1, "pickle_based": 0},
        "layout_flag": {"total": 1, "pickle_based": 0},
        "layout_communicator": {"total": 1, "pickle_based": 0},
    }
    got = {t["name"]: t for t in targets.targets([], [], counts, 1e-6, (), rows)}
    assert got["gpt2-small-step: what gclip-folded+step adds / what torch's adds"]["ok"] is True  # limit 0.4
    assert got["gpt2-small-step: what gclip-folded-amp+step adds / what torch's adds"]["ok"] is False  # 0.3
    assert not any("bf16" in name for name in got)  # not measured: left out
    rows[1] |= {"cpu_vs_torch": -0.2, "cpu_adds_s": -0.002}  # CPU time first; below 0 is a pass taken over
    got = {t["name"]: t for t in targets.targets([], [], counts, 1e-6, (), rows)}
    assert got["gpt2-small-step: what gclip-folded-amp+step adds / what torch's adds"]["ok"] is True
    rows[0] |= {"torch_fold_s": 0.012}
    got = {t["name"]: t for t in targets.targets([], [], counts, 1e-6, (), rows)}
    note = got["gpt2-small-step: what gclip-folded+step adds / what torch's adds"]["note"]
    assert "torch's grad_scale pass 12 ms" in note
    rows[0] |= {"vs_torch": float("nan")}  # torch's clip added nothing: no verdict
    got = {t["name"]: t for t in targets.targets([], [], counts, 1e-6, (), rows)}
    assert got["gpt2-small-step: what gclip-folded+step adds / what torch's adds"]["ok"] is False
