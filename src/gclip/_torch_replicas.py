"""check_replicas for gclip.torch: are the copies of every tensor still identical?

The torch counterpart of ``gclip.replicas.check_replicas`` (mpi4py only): over a
torch.distributed group or a DeviceMesh, DTensor-aware. Who holds copies of
what is read as the clip reads it (``gclip._dtensor``): a DTensor's placements
(Replicate dimensions, and root-mesh dimensions of copies), ``replicated=`` for
plain tensors. Each rank hashes its local tensors (crc32 of their bytes); one
all_gather_object compares them. A diagnostic, not for every step.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _dtensor
from .errors import GclipValueError
from .replicas import diverged

__all__ = ["check_replicas"]


def _crc(t: torch.Tensor) -> int:
    flat = t.detach().contiguous().reshape(-1).cpu()
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


@torch.no_grad()
def check_replicas(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    *,
    replicated: Sequence[Any] | Any = None,
    names: Sequence[str] | None = None,
    comm: Any = None,
) -> None:
    """Check, bit for bit, that the copies of each tensor (parameters, gradients) agree.

    ``tensors`` as gclip.torch's clip takes them (DTensors read by their placements);
    ``replicated=`` as there, for plain tensors. Every rank raises the same one-line
    GclipValueError naming the tensor and the ranks whose copy differs.
    """
    from .torch import _gradients, _world

    world = _world(comm)
    records: list[tuple[str, tuple[int, ...], int, int]] = []
    error = None
    try:
        given = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
        got = _gradients(given, replicated, of_parameters=False)
        labels = list(names) if names is not None else got.wheres
        if len(labels) != len(got.tensors):
            raise GclipValueError(f"names has {len(labels)} entries for {len(got.tensors)} tensors")
        places: dict[tuple[int, ...], int] = {}
        for t, members, label in zip(
            got.tensors, _dtensor.holders(world, got.tensors, got.entries, got.wheres), labels
        ):
            slot = places[members] = places.get(members, -1) + 1
            records.append((str(label), members, slot, _crc(t)))
    except Exception as exc:  # noqa: BLE001 - agreed below, so no rank waits
        error = exc
    every: list[Any] = [None] * world.size
    dist.all_gather_object(
        every, (None if error is None else " ".join(str(error).split()), records), group=world.process_group
    )
    bad = [(r, msg) for r, (msg, _) in enumerate(every) if msg is not None]
    if bad:
        raise GclipValueError(f"rank {bad[0][0]} of {world.size}: {bad[0][1]}")
    problem = diverged([recs for _, recs in every])
    if problem:
        raise GclipValueError(problem)
