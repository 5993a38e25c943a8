"""The lab's model clipped on real ranks under a mesh: correctly, or with a gallery bug.

A gallery bug is either a mode of the engine (``gclip.gallery``'s ``mode=``: the bug is in how the
norm is combined) or a layout bug (``gclip.gallery.LAYOUT_BUGS``: the clip
is right, what it is told is wrong). :func:`clip_model` runs either on this
rank and returns what the rank did; the demo gathers the results.

The hang bug (``skip-collective``) is shown without hanging: the ranks that
hold no gradient return before the all-reduce, the others wait for it under a
watchdog, then every rank reports what it did on a second communicator (a
collective on another communicator does not mix with the stuck one), and the
ranks that skipped enter the all-reduce late so that it completes and the job
ends cleanly.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np

from .. import gallery
from ..clip import clip_by_global_norm, clip_simulated, clip_with_norm, global_norm
from ..engine import HEADER_SIZE
from ..layout import Group, Mesh, ranges
from . import transformer

__all__ = [
    "RankClip",
    "bug_names",
    "clip_model",
    "clip_model_simulated",
    "counts_here",
    "frozen_ranks",
    "true_norm",
]

WATCHDOG_S = 2.0  # how long the ranks wait for a skipped all-reduce before they say so


class RankClip(NamedTuple):
    """What one rank did in one clip of the model."""

    rank: int
    coords: dict[str, int]
    norm: float | None  # the norm this rank clipped by (None: it never got one)
    scale: float | None  # the scale it applied (None: it applied none)
    counted: int  # elements this rank counted in the norm
    held: int  # elements this rank holds
    pieces: list[transformer.Piece]  # its arrays, as they are after the clip
    note: str  # what happened, in words (the hang bug: who waited, who skipped)
    split: tuple[tuple[float, float], tuple[float, float]] | None = None  # ((norm, scale) of the
    # dense tensors, of the experts) where a bug clipped them apart; norm and scale are the dense ones


def bug_names() -> list[str]:
    """Every bug the demo can run on a layout: the engine's modes, then the layout bugs."""
    return [b.name for b in gallery.BUGS] + [b.name for b in gallery.LAYOUT_BUGS]


def frozen_ranks(mesh: Mesh) -> list[int]:
    """The ranks with nothing to clip in the hang demonstration: the last pipeline
    stage's (its layers frozen, as in a fine-tuning job), or the last rank."""
    if mesh.shape.get("pp", 1) > 1:
        last = mesh.shape["pp"] - 1
        return [r for r in range(mesh.size) if Mesh((r, mesh.size), **mesh.shape).coords["pp"] == last]
    return [mesh.size - 1]


def clip_model(
    mesh: Mesh,
    max_norm: float,
    *,
    bug: str | None = None,
    norm_type: float = 2.0,
    reproducible: bool = False,
    dtype: Any = np.float64,
    model: transformer.Model = transformer.LAB,
) -> RankClip:
    """Clip this rank's part of the model, in place, correctly or with ``bug``.

    Collective over ``mesh.comm``: every rank calls it with the same arguments.
    """
    layout_bug, mode, placements = _bug_parts(bug)
    arrays, entries, _, pieces = transformer.clip_arguments(mesh, dtype, placements, model)
    comm = _clip_comm(mesh, layout_bug)
    held = sum(p.array.size for p in pieces)
    kwargs = dict(norm_type=norm_type, reproducible=reproducible, replicated=entries)
    if layout_bug is not None and layout_bug.skips_collective:
        return _skip_collective(mesh, arrays, pieces, max_norm, kwargs, held)
    if layout_bug is not None and layout_bug.omits(mesh.shape):
        kept = [i for i in range(len(arrays)) if not _omitted(layout_bug, i, pieces, mesh.coords)]
        norm = global_norm(
            [arrays[i] for i in kept],
            comm=comm,
            norm_type=norm_type,
            reproducible=reproducible,
            replicated=[entries[i] for i in kept],
        )
        clip_with_norm(arrays, max_norm, norm, inplace=True)
        scale = gallery.GLOBAL.scale(norm, max_norm)
        counted = sum(arrays[i].size for i in set(kept))
        return RankClip(mesh.rank, mesh.coords, norm, scale, counted, held, pieces, "")
    counted = sum(p.array.size for p in pieces if p.replicated is False or counts_here(p.replicated))
    if layout_bug is not None and layout_bug.split in mesh.shape:
        done = []
        for part in _split(layout_bug, len(arrays), pieces):
            mine = [arrays[i] for i in part]
            norm = global_norm(mine, comm=comm, replicated=[entries[i] for i in part], **_no_rep(kwargs))
            clip_with_norm(mine, max_norm, norm, inplace=True)
            done.append((norm, gallery.GLOBAL.scale(norm, max_norm)))
        (dense, experts) = done
        return RankClip(mesh.rank, mesh.coords, *dense, counted, held, pieces, "", (dense, experts))
    result = gallery.clip_by_global_norm(arrays, max_norm, comm=comm, mode=mode, inplace=True, **kwargs)
    return RankClip(mesh.rank, mesh.coords, result.total_norm, result.scale, counted, held, pieces, "")


def _no_rep(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "replicated"}


def _split(bug: gallery.LayoutBug, count: int, pieces: list) -> tuple[list[int], list[int]]:
    """(the dense arrays, the experts'): the indices of the arrays not sharded along ``bug.split``,
    and of those that are (two optimizers' parameters, each clipped apart)."""
    experts = [i for i in range(count) if _sharded_along(bug.split or "", i, pieces)]
    return [i for i in range(count) if i not in experts], experts


def _bug_parts(bug: str | None) -> tuple[gallery.LayoutBug | None, str, Any]:
    """(the layout bug or None, the engine's mode, the placements the bug declares or None)."""
    layout_bug = gallery.LAYOUT_BUG_NAMES.get(bug or "")
    mode = bug if bug in gallery.STRATEGIES else "global"
    placements = None
    if layout_bug is not None:
        placements = {pl: layout_bug.declare(pl) for pl in transformer.PLACEMENTS}
    return layout_bug, mode, placements


def clip_model_simulated(
    shape: dict[str, int],
    max_norm: float,
    *,
    bug: str | None = None,
    norm_type: float = 2.0,
    reproducible: bool = False,
    dtype: Any = np.float64,
    model: transformer.Model = transformer.LAB,
) -> list[RankClip]:
    """:func:`clip_model` on every rank of a simulated mesh of ``shape``, in this one process.

    The same engine and the same arguments as on real ranks (``gclip.clip_simulated``:
    the all-reduce is a sum over a list), so the numbers are the same. A bug that reduces
    over one slice of the world clips each slice apart; the hang bug cannot hang here:
    the ranks that would wait are named instead.
    """
    size = math.prod(shape.values())
    meshes = [Mesh((r, size), **shape) for r in range(size)]
    layout_bug, mode, placements = _bug_parts(bug)
    args = [transformer.clip_arguments(m, dtype, placements, model) for m in meshes]
    held = [sum(p.array.size for p in a[3]) for a in args]
    kwargs = dict(norm_type=norm_type, reproducible=reproducible)

    def done(r: int, norm: Any, scale: Any, counted: int, note: str = "") -> RankClip:
        return RankClip(r, meshes[r].coords, norm, scale, counted, held[r], args[r][3], note)

    if layout_bug is not None and layout_bug.skips_collective:
        frozen = frozen_ranks(meshes[0])
        rest = [r for r in range(size) if r not in frozen]
        note = (
            f"{'rank' if len(frozen) == 1 else 'ranks'} {ranges(frozen)} returned without entering the "
            f"all-reduce; {'rank' if len(rest) == 1 else 'ranks'} {ranges(rest)} would wait in it "
            "forever (simulated ranks: on real ones the demo's watchdog ends the wait)"
        )
        return [done(r, None, None, 0, note) for r in range(size)]
    if layout_bug is not None and layout_bug.split in shape:
        parts = [_split(layout_bug, len(a[0]), a[3]) for a in args]
        found_split: list[list[tuple[float, float]]] = [[] for _ in args]
        for k in range(2):  # the dense arrays, then the experts: each set a clip of its own
            results = clip_simulated(
                [[a[0][i] for i in p[k]] for a, p in zip(args, parts)],
                max_norm,
                replicated=[[a[1][i] for i in p[k]] for a, p in zip(args, parts)],
                inplace=True,
                **kwargs,
            )
            for r, res in enumerate(results):
                found_split[r].append((res.total_norm, res.scale))
        counted = [
            sum(p.array.size for p in a[3] if p.replicated is False or counts_here(p.replicated))
            for a in args
        ]
        return [
            RankClip(r, meshes[r].coords, *found_split[r][0], counted[r], held[r], args[r][3], "",
                     (found_split[r][0], found_split[r][1]))
            for r in range(size)
        ]  # fmt: skip
    if layout_bug is not None and layout_bug.omits(shape):
        kept = [
            [i for i in range(len(a[0])) if not _omitted(layout_bug, i, a[3], m.coords)]
            for a, m in zip(args, meshes)
        ]
        results = clip_simulated(
            [[a[0][i] for i in k] for a, k in zip(args, kept)],
            max_norm,
            replicated=[[a[1][i] for i in k] for a, k in zip(args, kept)],
            **kwargs,
        )
        out = []
        for r, (a, k, res) in enumerate(zip(args, kept, results)):
            clip_with_norm(a[0], max_norm, res.total_norm, inplace=True)
            scale = gallery.GLOBAL.scale(res.total_norm, max_norm)
            out.append(done(r, res.total_norm, scale, sum(a[0][i].size for i in set(k))))
        return out
    slices: dict[int, list[int]] = {}  # the ranks that reduce together: the world, or (a bug) slices
    for r, m in enumerate(meshes):
        apart = layout_bug.apart if layout_bug is not None and layout_bug.apart in shape else None
        slices.setdefault(m.coords[apart] if apart else 0, []).append(r)
    found: dict[int, Any] = {}
    for members in slices.values():
        results = gallery.clip_simulated(
            [args[r][0] for r in members],
            max_norm,
            mode=mode,
            inplace=True,
            replicated=[_within(args[r][1], members, size) for r in members],
            **kwargs,
        )
        found.update(zip(members, results))
    return [
        done(
            r,
            found[r].total_norm,
            found[r].scale,
            sum(p.array.size for p in args[r][3] if p.replicated is False or counts_here(p.replicated)),
        )
        for r in range(size)
    ]


def _within(entries: list, members: list[int], size: int) -> list:
    """A rank's entries with each simulated group renumbered to the ranks of its slice (which holds
    all the group's members); one new group per group, so that an array passed twice (the tied
    head) keeps one entry."""
    if len(members) == size:
        return entries
    renumbered: dict[int, Any] = {}
    for e in entries:
        if isinstance(e, Group) and id(e) not in renumbered:
            renumbered[id(e)] = Group(tuple(members.index(m) for m in e.members), e.rank)
    return [renumbered.get(id(e), e) for e in entries]


def _omitted(bug: gallery.LayoutBug, index: int, pieces: list, coords: dict) -> bool:
    piece = pieces[index] if index < len(pieces) else pieces[0]  # past the pieces: the head
    return bug.left_out(piece.placement, coords)


def _sharded_along(axis: str, index: int, pieces: list) -> bool:
    piece = (
        pieces[index] if index < len(pieces) else pieces[0]
    )  # past the pieces: the head, i.e. the embedding
    return axis in piece.placement.sharded


def counts_here(entry: Any) -> bool:
    """Whether this rank counts an array whose replicated= entry is ``entry`` (a group's rank 0)."""
    return entry is True or (entry is not None and entry.Get_rank() == 0)


def _clip_comm(mesh: Mesh, bug: gallery.LayoutBug | None) -> Any:
    """The communicator the clip reduces over: the world, or (a bug) one slice of it."""
    if bug is None or bug.apart is None or bug.apart not in mesh.shape:
        return mesh.comm
    group = mesh.replicated(*(a for a in mesh.axes if a != bug.apart))
    if group is False:  # this rank is alone in its slice
        from mpi4py import MPI

        return MPI.COMM_SELF
    return group


def _skip_collective(
    mesh: Mesh, arrays: list, pieces: list, max_norm: float, kwargs: dict, held: int
) -> RankClip:
    """The hang bug, shown under a watchdog (see the module docstring)."""
    from mpi4py import MPI

    comm = mesh.comm
    frozen = frozen_ranks(mesh)
    reports = comm.Dup()  # the second communicator, for what each rank did
    watched = _WatchedComm(comm, WATCHDOG_S)
    if mesh.rank in frozen:  # "nothing to clip": returns before the all-reduce
        did = ("skipped", 0.0)
    else:
        try:
            clip_by_global_norm(arrays, max_norm, comm=watched, inplace=True, **kwargs)
            did = ("clipped", watched.waited)
        except _Timeout:
            did = ("waited", watched.waited)
    told = reports.allgather(did)
    skipped = [r for r, (what, _) in enumerate(told) if what == "skipped"]
    waited = [r for r, (what, _) in enumerate(told) if what == "waited"]
    if mesh.rank in frozen:  # enter the all-reduce late, with nothing, so that it completes
        header = np.zeros(HEADER_SIZE)  # (a nonblocking collective matches only nonblocking ones)
        comm.Iallreduce(header, np.empty_like(header), op=MPI.SUM).Wait()
    else:
        watched.finish()
    reports.Free()
    note = (
        f"{'rank' if len(skipped) == 1 else 'ranks'} {ranges(skipped)} returned without entering the "
        f"all-reduce; {'rank' if len(waited) == 1 else 'ranks'} {ranges(waited)} waited "
        f"{WATCHDOG_S:g} s and gave up (without the watchdog they would wait forever)"
    )
    return RankClip(mesh.rank, mesh.coords, None, None, 0, held, pieces, note)


class _Timeout(Exception):
    """The watched all-reduce did not complete in time."""


class _WatchedComm:
    """A communicator whose Allreduce gives up after ``timeout`` seconds (the request is
    kept, to be completed by :meth:`finish` once the late ranks have entered)."""

    def __init__(self, comm: Any, timeout: float) -> None:
        self._comm = comm
        self._timeout = timeout
        self._pending: Any = None
        self.waited = 0.0

    def Get_rank(self) -> int:
        return self._comm.Get_rank()

    def Get_size(self) -> int:
        return self._comm.Get_size()

    def Allreduce(self, send: np.ndarray, recv: np.ndarray, op: Any = None) -> None:
        request = self._comm.Iallreduce(send, recv, op=op)
        start = time.monotonic()
        while not request.Test():
            self.waited = time.monotonic() - start
            if self.waited > self._timeout:
                self._pending = request
                raise _Timeout
            time.sleep(0.005)
        self.waited = time.monotonic() - start

    def __getattr__(self, name: str) -> Any:  # everything else: the communicator's own
        return getattr(self._comm, name)

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.Wait()
            self._pending = None


def true_norm(ep: bool, norm_type: float = 2.0, model: transformer.Model = transformer.LAB) -> float:
    """The model's norm from its definition alone (every tensor whole, once): the oracle."""
    values = [
        np.abs(transformer.full_tensor(name, shape, model=model, ep=ep)).ravel()
        for name, shape in transformer.model_shapes(ep).items()
    ]
    if math.isinf(norm_type):
        return float(max(v.max() for v in values))
    return math.fsum(float(x) ** norm_type for v in values for x in v) ** (1.0 / norm_type)
