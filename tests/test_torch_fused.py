"""gclip.torch.clip_step: the clip folded into torch's fused Adam, AdamW and SGD, against the unfolded
path it replaces (gclip's clip_grad_norm_ then optimizer.step(); with a GradScaler, unscale_, the clip,
scaler.step, as torch documents), over 20 steps of gradients fixed in advance.

The stated bound, per parameter value, after N steps: |folded - unfolded| <= N * (2**-22 * max|p| +
lr * 2**-17). Per step the two effective gradients differ by a few float32 roundings (the scale's, each
product's: below 2**-21 relative), which moves Adam's lr * m/(sqrt(v) + eps) or SGD's lr * momentum
buffer (below 10 for clipped gradients and momentum 0.9) by less than lr * 2**-17, and the parameter's
own rounding may fall on either side (an ulp, 2**-23 |p|, twice). The gradients do not depend on the
parameters here, so no difference feeds back. Each test also checks that it can fail: the unclipped
run lies far outside the bound."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip.torch as gt  # noqa: E402
from conftest import OneRankComm  # noqa: E402

STEPS = 20
SHAPES = [(64, 32), (32,), (128, 64), (7,), (3, 5, 2)]
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 1e-3}),
    "SGD": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


def bound(params, lr: float) -> float:
    top = max(float(p.detach().abs().max()) for p in params)
    return STEPS * (2.0**-22 * top + lr * 2.0**-17)


def train(how: str, name: str, dtype=torch.float32, amp: bool = False, inf_at: int | None = None):
    """Parameters after STEPS steps of fixed gradients (norms from 1e-2 to 1e2 around max_norm 1)."""
    cls, kw = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = cls(params, **kw, fused=how != "fallback")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4) if amp else None
    grads = torch.Generator().manual_seed(2)
    skipped = []
    for k in range(STEPS):
        scale = 10.0 ** (k % 5 - 2)
        for p in params:
            g = (torch.randn(p.shape, generator=grads) * scale).to(dtype)
            p.grad = scaler.scale(g) if amp else g
        if k == inf_at:
            params[1].grad[3] = float("inf")
        before = [p.detach().clone() for p in params]
        if how in ("folded", "fallback"):
            gt.clip_step(opt, 1.0, scaler=scaler, comm=OneRankComm())
        else:
            if amp:
                scaler.unscale_(opt)
            if how == "unfolded":
                gt.clip_grad_norm_(params, 1.0, comm=OneRankComm())
            scaler.step(opt) if amp else opt.step()
        if amp:
            scaler.update()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, params)))
    return params, skipped, scaler.get_scale() if amp else None


def max_diff(a, b) -> float:
    return max(float((x.detach().double() - y.detach().double()).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "GradScaler"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_folded_matches_the_unfolded_clip_over_20_steps(name, amp):
    folded, skipped_f, scale_f = train("folded", name, amp=amp, inf_at=7 if amp else None)
    unfolded, skipped_u, scale_u = train("unfolded", name, amp=amp, inf_at=7 if amp else None)
    unclipped, _, _ = train("unclipped", name, amp=amp, inf_at=7 if amp else None)
    limit = bound(unfolded, OPTIMIZERS[name][1]["lr"])
    assert max_diff(folded, unfolded) <= limit
    assert max_diff(unclipped, unfolded) > 100 * limit  # the test can fail: clipping matters here
    assert skipped_f == skipped_u
    assert skipped_f[7] is amp and sum(skipped_f) == int(amp)  # the inf's step alone is skipped
    assert scale_f == scale_u


def test_folded_matches_with_bfloat16_parameters():
    folded, _, _ = train("folded", "AdamW", dtype=torch.bfloat16)
    unfolded, _, _ = train("unfolded", "AdamW", dtype=torch.bfloat16)
    # bfloat16 keeps 8 bits: the parameter's rounding (2**-8 |p|) may fall either way each step
    top = max(float(p.detach().abs().max()) for p in unfolded)
    assert max_diff(folded, unfolded) <= STEPS * (2.0**-7 * top + 1e-3 * 2.0**-17)
    assert max_diff(folded, unfolded) < max_diff(
        train("unclipped", "AdamW", dtype=torch.bfloat16)[0], unfolded
    )


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "GradScaler"])
def test_an_optimizer_without_a_fused_step_is_clipped_in_place_and_told_once(amp):
    from gclip.torch import _fused

    _fused._warned.discard(torch.optim.AdamW)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fallback, skipped, scale = train("fallback", "AdamW", amp=amp, inf_at=7 if amp else None)
    told = [w for w in seen if "no fused step" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in seen]
    unfolded, skipped_u, scale_u = train("unfolded", "AdamW", amp=amp, inf_at=7 if amp else None)
    assert max_diff(fallback, unfolded) <= bound(unfolded, 1e-3)
    assert skipped == skipped_u and scale == scale_u


def test_the_returned_norm_is_the_unscaled_global_norm():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    p.grad = scaler.scale(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    norm = gt.clip_step(opt, 1.0, scaler=scaler, comm=OneRankComm())
    assert float(norm) == 5.0
    assert torch.allclose(p.detach(), -0.1 * torch.tensor([0.6, 0.8, 0.0, 0.0]), rtol=2**-22, atol=0)


def test_unscale_before_clip_step_is_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], fused=True)
    scaler = torch.amp.GradScaler("cpu")
    p.grad = scaler.scale(torch.ones(4))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        gt.clip_step(opt, 1.0, scaler=scaler, comm=OneRankComm())
