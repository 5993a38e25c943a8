"""Who holds copies of what, who counts them, and whether copies really are copies.

Diagnostics of a layout (see ``layout``): :func:`explain` tabulates, for each
tensor or shard, the ranks that hold it, the one that counts it and its share
of the norm; :func:`check_replicas` checks, bit for bit, that arrays declared
identical over a group are. Both gather (extra collectives): for a teacher's
table or a debugging session, not for every step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import drivers, engine, partials, reader
from .drivers import Comm
from .errors import GclipValueError
from .layout import _holding, is_flag, is_shard, no_copy_here, ranges

__all__ = ["Row", "check_replicas", "diverged", "explain", "explain_simulated"]


class Row(NamedTuple):
    """One tensor (or one shard of it) and who counts it: a row of :func:`explain`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]  # the ranks holding it (one for a shard; every copy's for a group)
    counted_on: int  # the one rank whose partial includes it
    power: float  # its sum |x|**p (max |x| for the inf-norm)
    share: float  # its share of the global norm**p (for inf: 1 for the max, else 0)

    @property
    def copies(self) -> int:
        return len(self.ranks)


class _Record(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    members: tuple[int, ...]
    slot: int  # its place among this rank's arrays of the same group: the k-th of each member match
    power: float
    norm: float  # its own p-norm, right where power over- or underflows
    crc: int

    @property
    def key(self) -> tuple[tuple[int, ...], int]:
        """The copy it is, the same on every member: the group and the place in it, as the
        engine matches what a group's members declare (names and positions may differ)."""
        return self.members, self.slot


def _records(
    grads: Any, replicated: Any, names: Any, rank: int, size: int, comm: Any, p: float
) -> list[_Record]:
    given = reader.grads(grads, inplace=False)
    entries = (
        given.per_array(list(replicated), "replicated")
        if replicated is not None
        else [False] * len(given.arrays)
    )
    labels = _names(given, names)
    out = []
    places: dict[tuple[int, ...], int] = {}
    for i, (a, entry, label) in enumerate(zip(given.arrays, entries, labels)):
        if entry is None:
            raise no_copy_here(i)
        members: tuple[int, ...]
        if is_shard(entry):
            members = (rank,)
        elif is_flag(entry):
            members = tuple(range(size))
        else:
            members = _holding(entry, comm, rank, size, i).members
        if math.isinf(p):
            power = norm = partials.max_abs([a])[0]
        else:  # the engine's own local step, with its overflow/underflow rescue
            power, _, norm = engine.local_norm([a], p)
        slot = places[members] = places.get(members, -1) + 1
        out.append(_Record(str(label), tuple(a.shape), a.dtype.name, members, slot, power, norm, _crc(a)))
    return out


def _label(names: Sequence[str]) -> str:
    """One name for a copy that its holders may call differently ('embed / head')."""
    return " / ".join(dict.fromkeys(names))


def _names(given: Any, names: Sequence[str] | None) -> list[str]:
    """One label per distinct array; an array given twice under two names is 'a = b'."""
    if names is None:
        names = [f"grads[{i}]" for i in range(given.given)]
    names = [str(n) for n in names]
    if len(names) != given.given:
        raise GclipValueError(f"names has {len(names)} entries for {given.given} arrays")
    if given.slots is None:
        return names
    labels: list[list[str]] = [[] for _ in given.arrays]
    for slot, name in zip(given.slots, names):
        if name not in labels[slot]:
            labels[slot].append(name)
    return [" = ".join(label) for label in labels]


def _crc(a: np.ndarray) -> int:
    crc = 0
    for c in partials.iter_chunks(a):
        crc = zlib.crc32(np.ascontiguousarray(c).view(np.uint8).data, crc)
    return crc


def _rows(per_rank: Sequence[Sequence[_Record]], p: float) -> list[Row]:
    merged: dict[tuple[tuple[int, ...], int], list[_Record]] = {}
    for records in per_rank:
        for rec in records:
            merged.setdefault(rec.key, []).append(rec)
    counted = [recs[0]._replace(name=_label([r.name for r in recs])) for recs in merged.values()]
    if math.isinf(p):
        top = max((r.power for r in counted), default=0.0)
        shares = [1.0 if r.power == top and top > 0 else 0.0 for r in counted]
    else:
        shares = _shares([r.norm for r in counted], p)
    return [
        Row(r.name, r.shape, r.dtype, r.members, r.members[0], r.power, share)
        for r, share in zip(counted, shares)
    ]


def _shares(norms: Sequence[float], p: float) -> list[float]:
    """Each norm**p over the sum of all, computed as (norm / top)**p so that neither
    1e200 (whose power overflows) nor 1e-200 (whose power underflows) loses its share."""
    if any(math.isnan(n) for n in norms):
        return [math.nan] * len(norms)
    top = max(norms, default=0.0)
    if top == 0.0 or math.isinf(top):  # nothing to share, or an infinite value: undefined there
        return [math.nan if math.isinf(n) else 0.0 for n in norms]
    powers = [(n / top) ** p for n in norms]
    total = math.fsum(powers)
    return [w / total for w in powers]


def explain(
    grads: Any,
    *,
    replicated: Sequence[Any] | None = None,
    names: Sequence[str] | None = None,
    comm: Comm | None = None,
    norm_type: float | str = 2.0,
) -> list[Row]:
    """Who counts what: one row per tensor (or shard), the same list on every rank.

    Each row names the tensor, its shape and dtype, the ranks that hold it,
    the one rank that counts it, and its share of the global norm**p. A
    diagnostic (it gathers every rank's list: not for the training loop).
    """
    comm = drivers.communicator(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    records, error, p = [], None, 2.0
    try:
        p = engine.norm_type(norm_type)
        records = _records(grads, replicated, names, rank, size, comm, p)
    except Exception as exc:  # noqa: BLE001 - agreed below, so no rank waits
        error = exc
    gathered = comm.allgather((engine.error_report(error), records))
    _raise_agreed(gathered)
    return _rows([recs for _, recs in gathered], p)


def explain_simulated(
    ranks: Sequence[Any],
    *,
    replicated: Sequence[Sequence[Any]] | None = None,
    names: Any = None,
    norm_type: Any = 2.0,
) -> list[Row]:
    """:func:`explain` over simulated ranks (``replicated[r]`` and ``names[r]`` per rank)."""
    p, size = engine.norm_type(norm_type), len(ranks)
    entries: Sequence[Any] = [None] * size if replicated is None else replicated
    labels: Sequence[Any] = [None] * size if names is None else names
    return _rows([_records(g, entries[r], labels[r], r, size, None, p) for r, g in enumerate(ranks)], p)


def _raise_agreed(gathered: Sequence[tuple[tuple[str, str] | None, Any]]) -> None:
    """Every rank raises the same error, of the class the failing rank met (see ``engine.agreed_error``)."""
    if any(report is not None for report, _ in gathered):
        raise engine.agreed_error([(report, None) for report, _ in gathered], mismatch=False)


def check_replicas(
    grads: Any, *, replicated: Sequence[Any], names: Sequence[str] | None = None, comm: Comm | None = None
) -> None:
    """Check that arrays declared identical over a group really are, bit for bit.

    Opt-in (it gathers a checksum per array): every rank raises the same
    one-line GclipValueError naming the tensor and the ranks that diverge,
    e.g. after replicas drifted apart under a clip that was not global.
    """
    comm = drivers.communicator(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    records, error = [], None
    try:
        records = _records(grads, replicated, names, rank, size, comm, 2.0)
    except Exception as exc:  # noqa: BLE001 - agreed below
        error = exc
    gathered = comm.allgather(
        (engine.error_report(error), [(r.name, r.members, r.slot, r.crc) for r in records])
    )
    _raise_agreed(gathered)
    problem = diverged([recs for _, recs in gathered])
    if problem:
        raise GclipValueError(problem)


def diverged(per_rank: Sequence[Sequence[tuple[str, tuple[int, ...], int, int]]]) -> str | None:
    """The first group whose copies differ, in one line (None: all copies agree).

    ``per_rank[r]``: rank r's (name, group members, place in the group, checksum) per array."""
    seen: dict[tuple[tuple[int, ...], int], dict[int, int]] = {}
    names: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for rank, records in enumerate(per_rank):
        for name, members, slot, crc in records:
            if len(members) > 1:
                seen.setdefault((members, slot), {})[rank] = crc
                names.setdefault((members, slot), []).append(name)
    for (members, slot), crcs in seen.items():
        name = _label(names[members, slot])
        kinds = list(dict.fromkeys(crcs.values()))
        if len(kinds) > 1:
            reference = crcs.get(members[0], kinds[0])
            odd = [r for r, c in crcs.items() if c != reference]
            return (
                f"replicas of {name!r} differ: {'rank' if len(odd) == 1 else 'ranks'} {ranges(odd)} "
                f"hold other values than rank {members[0]} (group {ranges(members)})"
            )
    return None
