"""``gclip.torch.clip_grad_norm_`` with ``mode=``: a gallery bug, on torch tensors.

The bug's program (``gclip.gallery.program``) over gclip.torch's reader, driver and
local sums: the lab runs it itself, gclip.torch has no hook for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import engine
from .. import torch as gclip_torch
from ..torch import _dtensor, _gradients
from .program import program

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    mode: str = "global",
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
    reproducible: bool = False,
) -> torch.Tensor:
    """:func:`gclip.torch.clip_grad_norm_` as bug ``mode`` clips (``"global"``: the correct one)."""
    world = gclip_torch._world(comm)

    def counting(given: Any, entries: Any, tensors: Sequence[Any]) -> engine.Counting:
        return _dtensor.counting(world, tensors, entries, given.wheres)

    args = engine.check(
        parameters,
        max_norm,
        _gradients.backend(True, foreach),
        rank=world.rank,
        size=world.size,
        replicated=replicated,
        counting=counting,
        norm_type=norm_type,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
        inplace=True,
    )
    out = world.run(program(mode, args, world.rank))  # type: ignore[arg-type]
    args.grads.scaled(out.scale, True)
    device = args.arrays[0].device if args.arrays else "cpu"
    return torch.full((), out.norm, dtype=torch.float64, device=device)
