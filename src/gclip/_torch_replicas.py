"""explain and check_replicas for gclip.torch: who counts what, and are copies still identical?

The torch counterpart of ``gclip.replicas.check_replicas`` (mpi4py only): over a
torch.distributed group or a DeviceMesh, DTensor-aware. Who holds copies of
what is read as the clip reads it (``gclip._dtensor``): a DTensor's placements
(Replicate dimensions, and root-mesh dimensions of copies), ``replicated=`` for
plain tensors. ``check_replicas``: each rank hashes its local tensors (crc32
of their bytes); one all_gather_object compares them. ``explain``: one row per
tensor or shard (``gclip.replicas.Row``). Diagnostics, not for every step.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _dtensor, _validate
from .errors import GclipTypeError, GclipValueError
from .replicas import Row, _Record, _rows, diverged

__all__ = ["check_replicas", "explain"]


def _crc(t: torch.Tensor) -> int:
    flat = t.detach().contiguous().reshape(-1).cpu()
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


def _gathered(
    tensors: Any, replicated: Any, names: Any, comm: Any, p: float
) -> tuple[Any, list[list[_Record]]]:
    """Every rank's records (name, shape, dtype, holders, slot, power, crc), errors agreed."""
    from . import _torch_partials
    from .torch import _gradients, _TorchGroup, _world

    world = _world(comm)
    if not isinstance(world, _TorchGroup):  # the same on every rank: no collective yet
        raise GclipTypeError("gclip.torch's explain and check_replicas take a torch group or DeviceMesh")
    records: list[_Record] = []
    error = None
    try:
        given = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        got = _gradients(given, replicated, of_parameters=False)
        labels = list(names) if names is not None else got.wheres
        if len(labels) != len(got.tensors):
            raise GclipValueError(f"names has {len(labels)} entries for {len(got.tensors)} tensors")
        places: dict[tuple[int, ...], int] = {}
        holders = _dtensor.holders(world, got.tensors, got.entries, got.wheres)
        for t, members, label in zip(got.tensors, holders, labels):
            slot = places[members] = places.get(members, -1) + 1
            power = (
                _torch_partials.max_abs([t])[0] if p == float("inf") else _torch_partials.power_sum([t], p)[0]
            )
            records.append(_Record(str(label), tuple(t.shape), str(t.dtype), members, slot, power, _crc(t)))
    except Exception as exc:  # noqa: BLE001 - agreed below, so no rank waits
        error = exc
    every: list[Any] = [None] * world.size
    message = None if error is None else " ".join(str(error).split())
    dist.all_gather_object(every, (message, records), group=world.process_group)
    bad = [(r, msg) for r, (msg, _) in enumerate(every) if msg is not None]
    if bad:
        raise GclipValueError(f"rank {bad[0][0]} of {world.size}: {bad[0][1]}")
    return world, [recs for _, recs in every]


@torch.no_grad()
def explain(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    *,
    replicated: Sequence[Any] | Any = None,
    names: Sequence[str] | None = None,
    comm: Any = None,
    norm_type: float | str = 2.0,
) -> list[Row]:
    """Who counts what: one row per tensor (or shard), the same list on every rank.

    As ``gclip.replicas.explain``, over a torch group or DeviceMesh: each row names the
    tensor, its local shape and dtype, the ranks of comm holding it, the one that counts
    it, and its share of the global norm**p.
    """
    p = _validate.norm_type(norm_type)
    _, per_rank = _gathered(tensors, replicated, names, comm, p)
    return _rows(per_rank, p)


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
    _, per_rank = _gathered(tensors, replicated, names, comm, 2.0)
    problem = diverged([[(r.name, r.members, r.slot, r.crc) for r in recs] for recs in per_rank])
    if problem:
        raise GclipValueError(problem)
