"""gclip.audit.update: a step read from its SGD update, in one process (no process group).

The oracle is the arithmetic of the step itself: the parameters moved by exactly
``-lr * s * g`` for a scale ``s`` chosen here from math.fsum over the gradient's squares,
so the audit must name the scale and grade it as a clip to that norm would be graded.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="gclip.audit needs PyTorch (pip install 'gclip[torch]')")

from gclip.audit.update import grade_update  # noqa: E402

LR = 0.5
MAX_NORM = 0.2


def step(scales: list[float]) -> tuple[list, list, list, float]:
    """Gradients, and parameters before and after an SGD step that scaled each by its scale."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)]
    before = [torch.randn(g.shape, generator=gen) * 0.05 for g in grads]
    after = [p - LR * s * g for p, g, s in zip(before, grads, scales)]
    norm = math.sqrt(math.fsum(float(v) ** 2 for g in grads for v in g.double().reshape(-1)))
    return grads, before, after, norm


def test_the_correct_scale_passes_and_its_norm_is_the_gradients():
    _, _, _, norm = step([1.0, 1.0])
    grads, before, after, _ = step([MAX_NORM / norm] * 2)
    report = grade_update(grads, before, after, lr=LR, max_norm=MAX_NORM)
    assert report.grade == "pass" and report.fingerprint is None
    assert report.global_norm == pytest.approx(norm, rel=1e-12)
    assert report.scales[0] == pytest.approx(MAX_NORM / norm, rel=1e-5)
    assert report.max_norm == MAX_NORM and report.clipped


def test_an_update_without_the_clip_is_never_scaled():
    grads, before, after, _ = step([1.0, 1.0])
    report = grade_update(grads, before, after, lr=LR, max_norm=MAX_NORM)
    assert (report.grade, report.fingerprint) == ("fail", "never-scaled")


def test_the_rms_for_the_norm_is_named():
    _, _, _, norm = step([1.0, 1.0])
    rms = norm / math.sqrt(27)
    grads, before, after, _ = step([min(1.0, MAX_NORM / rms)] * 2)
    report = grade_update(grads, before, after, lr=LR, max_norm=MAX_NORM)
    assert report.grade == "fail"
    assert report.fingerprint == "rms" or "rms" in report.matches


def test_tensors_scaled_apart_are_unknown():
    _, _, _, norm = step([1.0, 1.0])
    grads, before, after, _ = step([MAX_NORM / norm, 0.5 * MAX_NORM / norm])
    report = grade_update(grads, before, after, lr=LR, max_norm=MAX_NORM)
    assert (report.grade, report.fingerprint) == ("fail", "unknown") and report.split is not None


def test_mismatched_lists_and_a_bad_lr_are_refused():
    grads, before, after, _ = step([1.0, 1.0])
    with pytest.raises(ValueError, match="same tensors"):
        grade_update(grads, before[:1], after, lr=LR, max_norm=MAX_NORM)
    with pytest.raises(ValueError, match="lr must be positive"):
        grade_update(grads, before, after, lr=0.0, max_norm=MAX_NORM)
