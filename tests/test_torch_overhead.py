"""The one-process fast paths of gclip.torch give what a fresh reading gives, call after call.

What is read once per call (each gradient's facts, the compiled kernels' table) or kept across
calls (the default group) must follow the gradients when they change between steps: new
tensors every step (``zero_grad(set_to_none=True)``, often at a freed tensor's address),
another shape or dtype, a view that now overlaps another gradient, a regrouped process group.
Oracle: math.fsum over the values, and torch's own clip for the scaled gradients.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import gclip.torch as gt  # noqa: E402
from gclip.errors import GclipValueError  # noqa: E402


def _fsum_norm(grads) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for g in grads for v in g.double().flatten().tolist()))


def _params(n: int, size: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.empty(size, dtype=dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(size, generator=gen, dtype=torch.float64).to(dtype)
    return params


@pytest.mark.parametrize("n", [1, 40])  # one tensor, and a list the compiled table takes
def test_new_gradients_every_step_are_read_afresh(n):
    """set_to_none between steps: each call's norm and scale are those of the new gradients
    (freed tensors' memory is reused, so addresses repeat; the values do not)."""
    params = _params(n, 64)
    for step in range(8):
        dtype = torch.float64 if step % 3 == 2 else torch.float32  # another dtype some steps
        size = 64 if step % 4 < 2 else 96  # another shape some steps
        if params[0].shape != (size,) or params[0].dtype != dtype:
            params = _params(n, size, dtype)  # a new model: new parameters and gradients
        for p in params:
            p.grad = None  # zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = (torch.randn(size, generator=gen, dtype=torch.float64) * (step + 1)).to(dtype)
        want = _fsum_norm([p.grad for p in params])
        limit = want / 2
        expected = [p.grad.double() * (limit / want) for p in params]
        got = float(gt.clip_grad_norm_(params, limit))
        assert math.isclose(got, want, rel_tol=1e-12), step
        for p, e in zip(params, expected):
            assert torch.allclose(p.grad.double(), e, rtol=1e-6, atol=0), step
        assert math.isclose(_fsum_norm([p.grad for p in params]), limit, rel_tol=1e-6), step


def test_gradients_changed_in_place_between_calls():
    """The same tensor objects, resized in place (new memory, new size): read afresh."""
    params = _params(20, 64)
    gt.clip_grad_norm_(params, 1e9)
    for p in params:
        p.grad.resize_(200).normal_()
    want = _fsum_norm([p.grad for p in params])
    assert math.isclose(float(gt.get_total_norm([p.grad for p in params])), want, rel_tol=1e-12)
    assert math.isclose(float(gt.clip_grad_norm_(params, 1e9)), want, rel_tol=1e-12)


def test_an_overlap_that_appears_later_is_refused():
    """A clean call first; then two gradients made views of one buffer that overlap: refused
    (nothing remembered from the clean call may let it through), and a repeat counts once."""
    params = _params(20, 64)
    gt.clip_grad_norm_(params, 1e9)
    buf = torch.randn(100)
    params[3].grad, params[7].grad = buf[0:64], buf[30:94]
    with pytest.raises(GclipValueError, match="overlap in memory"):
        gt.clip_grad_norm_(params, 1.0)
    params[7].grad = params[3].grad  # the same gradient twice: counted and scaled once
    distinct = [p.grad for i, p in enumerate(params) if i != 7]
    want = _fsum_norm(distinct)
    before = [g.clone() for g in distinct]
    assert math.isclose(float(gt.clip_grad_norm_(params, want / 2)), want, rel_tol=1e-12)
    for g, b in zip(distinct, before):
        assert torch.allclose(g.double(), b.double() / 2, rtol=1e-6, atol=0)


def test_an_expanded_gradient_that_appears_later_is_refused():
    params = _params(20, 64)
    gt.clip_grad_norm_(params, 1.0)
    params[5].grad = torch.ones(1).expand(64)
    with pytest.raises(GclipValueError, match="stride 0"):
        gt.clip_grad_norm_(params, 1.0)


def test_scaling_bumps_autograd_version_counters():
    """The compiled multiply writes the memory torch does not see: it must tell autograd, as
    torch's mul_ does, so a saved tensor modified in place is still detected."""
    params = _params(40, 64)
    versions = [p.grad._version for p in params]
    gt.clip_grad_norm_(params, _fsum_norm([p.grad for p in params]) / 2)
    assert all(p.grad._version > v for p, v in zip(params, versions))


def test_the_default_group_follows_a_new_init():
    """comm=None under torch.distributed: the group kept from one init is not the next one's."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a torch group is already running in this process")
    params = _params(3, 8)
    want = _fsum_norm([p.grad for p in params])
    for port in (0, 0):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            world = gt._world(None)
            assert world.process_group is dist.group.WORLD and world.size == 1
            assert math.isclose(float(gt.clip_grad_norm_(params, 1e9)), want, rel_tol=1e-12)
        finally:
            dist.destroy_process_group()
