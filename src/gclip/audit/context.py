"""``gclip.testing.audit``: the audit of ``python -m gclip.audit`` around steps of your own test."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from typing import Any

from .auditor import Auditor

__all__ = ["audit"]


@contextlib.contextmanager
def audit(
    *,
    max_norm: float | None = None,
    optimizers: Iterable[Any] | None = None,
    plain: str = "auto",
    check: bool = True,
) -> Iterator[Auditor]:
    """Audit every optimizer step taken inside the block (collective: enter it on every rank).

    Each step (a backward, then ``optimizer.step()``) is graded as the command grades it;
    ``auditor.reports`` holds the reports (``gclip.audit.StepReport``), the same on every
    rank. ``max_norm``: the limit the code clips to (default: the one its clip function is
    called with). ``optimizers``: whose parameters to watch; default, every optimizer
    alive when the block starts (and any made inside it). ``plain``: what plain
    (non-DTensor, non-DDP) gradients are, ``"replicated"``, ``"sharded"`` or ``"auto"``.
    ``check``: on leaving, raise AssertionError (the same on every rank) unless at least
    one step was audited and none failed (a near miss, the correct norm through torch's
    epsilon or float32 rounding, does not fail).
    """
    auditor = Auditor(max_norm=max_norm, plain=plain)
    if optimizers is None:
        import torch

        optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
    for optimizer in optimizers:
        auditor.watch(p for group in optimizer.param_groups for p in group["params"])
    with auditor:
        yield auditor
    if not check:
        return
    if not auditor.reports:
        raise AssertionError("gclip.testing.audit: no optimizer step was audited inside the block")
    bad = [r for r in auditor.reports if r.grade == "fail"]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(auditor.reports)} audited steps failed:\n{bad[0]}")
