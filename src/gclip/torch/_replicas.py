"""explain and check_replicas for gclip.torch: who counts what, and are copies still identical?

The torch counterpart of ``gclip.replicas.check_replicas`` (mpi4py only): over a
torch.distributed group or a DeviceMesh, DTensor-aware. Who holds copies of
what is read as the clip reads it (``gclip.torch._dtensor``): a DTensor's placements
(Replicate dimensions, and root-mesh dimensions of copies), ``replicated=`` for
plain tensors. ``check_replicas``: each rank hashes its local tensors (crc32
of their bytes); one all_gather_object compares them. ``explain``: one row per
tensor or shard (``gclip.replicas.Row``). Diagnostics, not for every step.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from .. import engine
from ..errors import GclipTypeError, GclipValueError
from ..replicas import Row, _Record, _rows, diverged
from . import _dtensor

__all__ = ["check_replicas", "explain"]


def _crc(t: torch.Tensor) -> int:
    flat = t.detach().contiguous().reshape(-1).cpu()
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


def _gathered(world: Any, collect: Any, names: Any, p: float) -> list[list[_Record]]:
    """Every rank's records (name, shape, dtype, holders, slot, power, crc), errors agreed.

    ``world`` is gclip.torch's communicator, ``collect()`` its reading of the tensors."""
    from . import _partials

    if not hasattr(world, "process_group"):  # the same on every rank: no collective yet
        raise GclipTypeError("gclip.torch's explain and check_replicas take a torch group or DeviceMesh")
    records: list[_Record] = []
    error = None
    try:
        got = collect()
        labels = list(names) if names is not None else got.wheres
        if len(labels) != len(got.tensors):
            raise GclipValueError(f"names has {len(labels)} entries for {len(got.tensors)} tensors")
        places: dict[tuple[int, ...], int] = {}
        holders = _dtensor.holders(world, got.tensors, got.entries, got.wheres)
        for t, members, label in zip(got.tensors, holders, labels):
            slot = places[members] = places.get(members, -1) + 1
            if p == float("inf"):
                power = norm = _partials.max_abs([t])[0]
            else:  # the engine's own local step: right where the plain sum over- or underflows
                power, _, norm = engine.local_norm([t], p, _partials)
            records.append(
                _Record(str(label), tuple(t.shape), str(t.dtype), members, slot, power, norm, _crc(t))
            )
    except Exception as exc:  # noqa: BLE001 - agreed below, so no rank waits
        error = exc
    every: list[Any] = [None] * world.size
    message = None if error is None else " ".join(str(error).split())
    dist.all_gather_object(every, (message, records), group=world.process_group)
    bad = [(r, msg) for r, (msg, _) in enumerate(every) if msg is not None]
    if bad:
        raise GclipValueError(f"rank {bad[0][0]} of {world.size}: {bad[0][1]}")
    return [recs for _, recs in every]


def explain(world: Any, collect: Any, names: Any, norm_type: Any) -> list[Row]:
    """gclip.torch.explain's rows (see there)."""
    p = engine.norm_type(norm_type)
    return _rows(_gathered(world, collect, names, p), p)


def check_replicas(world: Any, collect: Any, names: Any) -> None:
    """gclip.torch.check_replicas (see there)."""
    per_rank = _gathered(world, collect, names, 2.0)
    problem = diverged([[(r.name, r.members, r.slot, r.crc) for r in recs] for recs in per_rank])
    if problem:
        raise GclipValueError(problem)
