"""The gallery's usage bugs (gallery.USAGE_BUGS): each one's wrong result with
plain torch, and the right one with gclip.torch."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip.torch as gt  # noqa: E402
from conftest import OneRankComm  # noqa: E402
from gclip.gallery import USAGE_BUG_NAMES, USAGE_BUGS  # noqa: E402

ONE = OneRankComm()
MAX_NORM = 0.5


def model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    loss = model(torch.randn(32, 8)).pow(2).sum()
    loss.backward()
    return model


def grad_norm(model: torch.nn.Module) -> float:
    return math.sqrt(math.fsum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def test_the_table():
    assert len(USAGE_BUG_NAMES) == len(USAGE_BUGS) == 3
    for bug in USAGE_BUGS:
        assert bug.name and bug.summary and bug.incident and bug.explanation
    assert "pytorch/examples #1196" in USAGE_BUG_NAMES["clip-before-unscale"].incident
    assert "pytorch/torchtitan PR #1258" in USAGE_BUG_NAMES["generator-consumed"].incident
    assert "transformers PR #46113" in USAGE_BUG_NAMES["never-scaled"].incident


def clip_as_transformers_46113(parameters, max_norm: float) -> torch.Tensor:
    """The norm of the gradients, then the gradients handed over where parameters are expected."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm)
    return total_norm


def test_never_scaled():
    wrong = model_with_grads()
    norm = grad_norm(wrong)
    assert norm > 10 * MAX_NORM  # the clip must act
    reported = clip_as_transformers_46113(list(wrong.parameters()), MAX_NORM)
    assert reported.item() == pytest.approx(norm, rel=1e-6)  # the norm is right
    assert grad_norm(wrong) == pytest.approx(norm, rel=1e-12)  # the bug: nothing was scaled

    right = model_with_grads()
    got = gt.clip_grad_norm_(list(right.parameters()), MAX_NORM, comm=ONE)
    assert got.item() == pytest.approx(norm, rel=1e-12)
    assert grad_norm(right) == pytest.approx(MAX_NORM, rel=1e-6)


def clip_as_torchtitan_did_before_pr_1258(parameters, max_norm: float) -> torch.Tensor:
    """The norm from one pass over ``parameters``, the scaling from a second pass."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


def test_generator_consumed():
    wrong = model_with_grads()
    norm = grad_norm(wrong)
    assert norm > 10 * MAX_NORM  # the clip must act
    reported = clip_as_torchtitan_did_before_pr_1258(wrong.parameters(), MAX_NORM)
    assert reported.item() == pytest.approx(norm, rel=1e-6)
    assert grad_norm(wrong) == pytest.approx(norm, rel=1e-12)  # the bug: nothing was scaled

    right = model_with_grads()
    got = gt.clip_grad_norm_(right.parameters(), MAX_NORM, comm=ONE)  # a generator, read once
    assert got.item() == pytest.approx(norm, rel=1e-12)
    assert grad_norm(right) == pytest.approx(MAX_NORM, rel=1e-6)


def update_norm(clip_first: bool) -> tuple[float, float]:
    """(the true gradient norm, the norm of the update an SGD step with lr=1 makes)
    in a GradScaler loop that clips before (the bug) or after scaler.unscale_."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loss = model(torch.randn(32, 8)).pow(2).sum()
    scaler.scale(loss).backward()
    true_norm = grad_norm(model) / 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    if clip_first:  # minGPT-DDP's order: torch's clip on the scaled gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:  # the documented order, with gclip.torch
        scaler.unscale_(opt)
        gt.clip_grad_norm_(model.parameters(), MAX_NORM, comm=ONE)
    scaler.step(opt)
    scaler.update()
    step = math.sqrt(
        math.fsum(float((b - p.detach()).double().pow(2).sum()) for b, p in zip(before, model.parameters()))
    )
    return true_norm, step


def test_clip_before_unscale():
    true_norm, wrong = update_norm(clip_first=True)
    assert true_norm > 10 * MAX_NORM  # the clip must act
    assert wrong == pytest.approx(
        MAX_NORM / 2.0**16, rel=1e-3
    )  # the bug: the update is 65536 times too short
    _, right = update_norm(clip_first=False)
    assert right == pytest.approx(MAX_NORM, rel=1e-5)
