"""ZClip, AutoClip and AGC make the same decisions on PyTorch's layouts as on one process
(tests/torch_adaptive_check.py, 4 torchrun CPU processes, gloo, 100 steps with spikes; every
layout in one torchrun job, tests/torch_batch.py, which the tests share).

Oracles: with ``reproducible=True`` the layout's limits equal, bit for bit, those of the
same clipper on one process over the whole model's full gradients; the test's
transcriptions of the reference rules (tests/unit/test_adaptive.py), fed math.fsum's
norm of the full gradients, make the same decisions; without ``reproducible``, ZClip's
limits are within 1e-12 relative of one process's, with the same steps clipped. A ZClip
state saved by the FSDP2 job through torch.distributed.checkpoint is loaded by the HSDP job,
which continues as the reference does from that state.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import Batch  # noqa: E402
from unit.test_limits import ReferenceZClip  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]

RANKS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Batch:
    base = tmp_path_factory.mktemp("adaptive")
    cases = {layout: ("torch_adaptive_check", layout) for layout in ("tp", "pp_fsdp", "fsdp")}
    # the HSDP case loads the FSDP2 case's state through torch.distributed.checkpoint
    cases["hsdp"] = ("torch_adaptive_check", "hsdp", str(base / "fsdp" / "zclip_dcp"))
    return Batch(RANKS, cases, base)


@pytest.fixture(scope="module")
def fsdp_then_hsdp(job):
    return job.reports("fsdp"), job.reports("hsdp"), job.dirs["fsdp"] / "zclip_state.pt"


def test_the_job_of_every_case_ends_cleanly(job):
    job.assert_finished()


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def check(every: list[dict], reference: ReferenceZClip) -> None:
    for r in every:  # per-group limits: each group's norm, from one all-reduce
        g = r["groups"]
        assert g["all_reduces"] == 1, g
        assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(g["norms"], g["oracle"])), g
        assert math.isclose(g["after"][0], g["oracle"][0] / 3, rel_tol=1e-6), g  # clipped to its limit
        assert g["after"][1] == g["oracle"][1], g  # reported, untouched
    steps = every[0]["steps"]
    for r in every[1:]:  # every rank made the same decisions
        assert [s["zclip"] for s in r["steps"]] == [s["zclip"] for s in steps]
        assert [s["autoclip"] for s in r["steps"]] == [s["autoclip"] for s in steps]
    history, z_clipped, a_clipped = [], 0, 0
    for t, s in enumerate(steps):
        z, a, oracle = s["zclip"], s["autoclip"], s["oracle"]
        # bit for bit: the layout against one process (reproducible=True)
        assert z["norm"] == z["norm_one"] and same(z["limit"], z["limit_one"]), (t, z)
        assert a["norm"] == a["norm_one"] and a["limit"] == a["limit_one"], (t, a)
        assert abs(z["norm"] - oracle) <= 1e-13 * oracle
        # the reference rules, on the oracle's norm
        limit, _ = reference.step(oracle)
        ours = z["limit"] if z["limit"] < z["norm"] else None  # the limit bites only below the norm
        assert (ours is None) == (limit is None), (t, z, limit)
        if limit is not None:
            z_clipped += 1
            assert math.isclose(ours, limit, rel_tol=1e-12)
        history.append(oracle)
        auto = float(np.percentile(history, 20.0))
        assert math.isclose(a["limit"], auto, rel_tol=1e-12)
        a_clipped += a["norm"] > a["limit"]
        # AGC: the layout's clipped full gradients are one process's (float32 pieces)
        np.testing.assert_allclose(s["agc_layout"], s["agc_one"], rtol=1e-6, atol=0)
    # not reproducible: within 1e-12 relative of one process, the same steps clipped
    fast_clipped = 0
    for t, s in enumerate(steps):
        z, fz = s["zclip"], s["zclip_fast"]
        assert math.isclose(fz["norm"], fz["norm_one"], rel_tol=1e-12), (t, fz)
        assert math.isclose(fz["norm"], s["oracle"], rel_tol=1e-12), (t, fz)
        assert same(fz["limit"], fz["limit_one"]) or math.isclose(fz["limit"], fz["limit_one"], rel_tol=1e-12)
        clips = fz["limit"] < fz["norm"]
        assert clips == (fz["limit_one"] < fz["norm_one"]) == (z["limit"] < z["norm"]), (t, z, fz)
        fast_clipped += clips
    assert fast_clipped == z_clipped
    assert z_clipped >= 5 and a_clipped >= 5  # the spikes were clipped
    assert all(s["agc_changed"] > 0 for s in steps)  # AGC clipped some units on every step
    assert every[0]["mean"] == every[0]["mean_one"] and every[0]["var"] == every[0]["var_one"]


@pytest.mark.parametrize("layout", ["tp", "pp_fsdp"])
def test_adaptive_clippers_decide_on_the_layout_as_on_one_process(layout, job):
    check(job.reports(layout), ReferenceZClip(max_grad_norm=None))


def test_fsdp2_as_on_one_process(fsdp_then_hsdp):
    check(fsdp_then_hsdp[0], ReferenceZClip(max_grad_norm=None))


def test_a_state_saved_on_fsdp2_continues_on_hsdp_with_the_references_decisions(fsdp_then_hsdp):
    _, hsdp, state_file = fsdp_then_hsdp
    saved = torch.load(state_file)
    for r in hsdp:  # DCP gave every rank the state torch.save wrote, to the bit
        assert r["loaded"] == {k: float(saved[k]) for k in ("step", "mean", "var")}, r["loaded"]
    reference = ReferenceZClip(max_grad_norm=None)
    reference.initialized, reference.mean, reference.var = True, float(saved["mean"]), float(saved["var"])
    check(hsdp, reference)
