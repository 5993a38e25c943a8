"""gclip.torch's ZClip, AutoClip and AGC on one process, against the references' rules
(the transcriptions in tests/unit/test_adaptive.py) and timm's AGC (written out here)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip.torch as gt  # noqa: E402
from unit.test_limits import ReferenceZClip, norms  # noqa: E402

pytestmark = pytest.mark.torch


def one_parameter(norm: float) -> torch.nn.Parameter:
    """A parameter whose gradient's norm is ``norm`` exactly."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([norm, 0.0], dtype=torch.float64)
    return p


@pytest.mark.parametrize(
    "settings", [dict(max_grad_norm=None), dict(max_grad_norm=1.4), dict(mode="percentile")]
)
def test_torch_zclip_makes_the_reference_rules_decisions(settings):
    ours, ref, clipped = gt.ZClip(**settings), ReferenceZClip(**settings), 0
    for t, norm in enumerate(norms()):
        p = one_parameter(norm)
        got = ours.step([p])
        limit, _ = ref.step(norm)
        assert got.dtype == torch.float64 and float(got) == norm
        after = float(p.grad[0])
        if limit is None:
            assert after == norm, t
        else:
            clipped += 1
            assert math.isclose(float(ours.last_limit), limit, rel_tol=4e-16), t
            assert math.isclose(after, limit, rel_tol=1e-15), (t, after, limit)
    assert 0 < clipped < 150


def test_torch_zclip_state_round_trips_through_torch_save():
    seq = norms(120, seed=7)
    whole, first = gt.ZClip(max_grad_norm=None), gt.ZClip(max_grad_norm=None)
    for norm in seq[:40]:
        whole.step([one_parameter(norm)])
        first.step([one_parameter(norm)])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = gt.ZClip(max_grad_norm=None)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    for norm in seq[40:]:
        a, b = one_parameter(norm), one_parameter(norm)
        whole.step([a])
        resumed.step([b])
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("window", [None, 9])
def test_torch_autoclip_clips_at_the_percentile_of_the_norms_seen(window):
    ours, history, clipped = gt.AutoClip(30.0, window=window), [], 0
    for norm in norms(80, seed=4):
        history.append(norm)
        limit = float(np.percentile(history if window is None else history[-window:], 30.0))
        p = one_parameter(norm)
        ours.step([p])
        after = float(p.grad[0])
        if norm > limit:
            clipped += 1
            assert math.isclose(after, limit, rel_tol=1e-14), (after, limit)
        else:
            assert after == norm
    assert 0 < clipped < 80
    resumed = gt.AutoClip(30.0, window=window)
    resumed.load_state_dict(ours.state_dict())
    a, b = one_parameter(2.0), one_parameter(2.0)
    ours.step([a])
    resumed.step([b])
    assert torch.equal(a.grad, b.grad)


def timm_adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3):
    """timm/utils/agc.py's adaptive_clip_grad, as written there."""

    def unitwise_norm(x):
        return x.norm(2.0) if x.ndim <= 1 else x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)

    for p in parameters:
        if p.grad is None:
            continue
        p_data, g_data = p.detach(), p.grad.detach()
        max_norm = unitwise_norm(p_data).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def small_model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 8), torch.nn.Linear(8, 3)
    ).to(dtype)
    with torch.no_grad():
        model[3].weight.zero_()  # a zero-initialised layer: the eps floor
    loss = model(torch.randn(5, 2, 6, 6, dtype=dtype)).square().sum() * 50
    loss.backward()
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_agc_clips_each_unit_as_timm_does(dtype):
    ours, theirs = small_model(dtype), small_model(dtype)
    before = [p.grad.clone() for p in ours.parameters()]
    gt.AGC(0.01).step(ours)
    timm_adaptive_clip_grad(theirs.parameters(), 0.01)
    changed = kept = 0
    for a, b, g0 in zip(ours.parameters(), theirs.parameters(), before):
        # gclip sums in float64 and rounds the product once; timm works in the dtype
        tol = 1e-14 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=0)
        changed, kept = changed + int((a.grad != g0).sum()), kept + int((a.grad == g0).sum())
    assert changed > 0 and kept > 0


def test_a_clipper_as_a_groups_limit_decides_as_it_would_alone():
    """clip_groups_(groups, [ZClip, None, AutoClip]): each clipper fed its own group's global
    norm from the one collective. Oracle: the same clippers stepped alone on a copy of their
    group (each checked against its reference rule above), bit for bit, 40 steps with spikes."""
    torch.manual_seed(5)
    shapes = [[(8, 4), (8,)], [(16, 16)], [(5,)]]
    ours = [[torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in g] for g in shapes]
    alone = [[torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in g] for g in shapes]
    zclip, autoclip = gt.ZClip(warmup_steps=5), gt.AutoClip(25.0)
    lone_z, lone_a = gt.ZClip(warmup_steps=5), gt.AutoClip(25.0)
    clipped = 0
    for step in range(40):
        for g, group in enumerate(ours):
            for p, q in zip(group, alone[g]):
                grad = torch.randn(p.shape, dtype=torch.float64) * (
                    40.0 if step in (12, 30) and g == 0 else 1.0
                )
                p.grad, q.grad = grad.clone(), grad.clone()
        norms = gt.clip_groups_([{"params": g} for g in ours], [zclip, None, autoclip])
        want = [lone_z.step(alone[0]), gt.get_total_norm([p.grad for p in alone[1]]), lone_a.step(alone[2])]
        assert torch.equal(norms, torch.stack(want).to(torch.float64))
        for group, other in zip(ours, alone):
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(group, other))
        clipped += bool(zclip.last_limit < norms[0]) if torch.is_tensor(zclip.last_limit) else 0
    assert clipped >= 2  # the spikes, at least: not a vacuous agreement
    assert str(zclip.state_dict()) == str(lone_z.state_dict())
    assert torch.equal(autoclip.state_dict()["history"], lone_a.state_dict()["history"])
