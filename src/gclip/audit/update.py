"""A step whose optimizer clips inside itself, audited from the update it made.

DeepSpeed's ZeRO optimizers (and Megatron's distributed optimizer) clip their own flat
partitions of the gradients inside ``step``: neither the gradients backward left (moved into
the optimizer's buffers and reduced there) nor the ones it clipped are tensors a hook can
read. The update is: with plain SGD (no momentum, no weight decay, learning rate ``lr``)
the step moves every parameter by ``-lr`` times the gradient it clipped. So, with the
parameters read before and after the step (gathered where the framework partitions them)
and the gradients the same batch gives outside the framework (the reference: autograd on a
plain copy of the model, averaged over the data-parallel ranks as the framework averages
them), each tensor's factor is read from ``(before - after) / lr`` as the audit reads the
optimizer's gradient (``capture.factor``), and the step is graded as any audited step
(``verdict.grade_step``).

Memory: the parameters before the step, one copy, and the reference gradients, another;
the audit of a small model in a test, not of a training run. An optimizer with momentum,
weight decay or an adaptive step (Adam) hides the clip in its update: this works only where
the framework lets the script choose plain SGD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import capture, verdict

__all__ = ["grade_update"]


@torch.no_grad()
def grade_update(
    reference: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    *,
    lr: float,
    max_norm: float,
    holders: Sequence[tuple[int, ...]] | None = None,
    step: int = 0,
    holds: str = "",
) -> verdict.StepReport:
    """The report of one SGD step (collective: every rank calls it, on the default group).

    ``reference``: the gradients backward produced, unclipped, per tensor; ``before`` and
    ``after``: the same tensors' values around the step; ``holders``: per tensor, the ranks
    holding identical copies of it (default: every rank, as a data-parallel model's);
    ``max_norm``: the limit the framework was configured with."""
    if not len(reference) == len(before) == len(after):
        counts = f"{len(reference)}, {len(before)}, {len(after)}"
        raise ValueError(f"reference, before and after must list the same tensors: {counts}")
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    everyone = tuple(range(size))
    pieces = []
    for i, (grad, old, new) in enumerate(zip(reference, before, after)):
        members = tuple(holders[i]) if holders is not None else everyone
        applied = (old.detach().double() - new.detach().double()) / lr
        seed = 1_000_003 * step + i
        first = capture.sketch(grad, seed)
        # the update's rounding is the parameters' dtype's: tell the factor so
        then = capture.sketch(applied, seed)._replace(dtype=first.dtype)
        scale, uniform = capture.factor(first, then)
        copies = "dp" if len(members) > 1 else ""
        pieces.append(verdict.Piece(members, copies, first.sumsq, first.count, scale, uniform, first.dtype))
    row = verdict.Row(rank, None, pieces, max_norm, None, holds)
    rows: list[Any] = [row]
    if size > 1:
        rows = [None] * size
        dist.all_gather_object(rows, row)
    # the limit travels in the rows, as a clip call's does: the framework's own clip used it
    return verdict.grade_step(step, rows, None, given=False)
