"""What each rank counts in ``gclip.torch``: DTensor placements, DeviceMeshes, declarations.

The engine counts a tensor on one rank only through per-tensor "owned" flags,
inside its ONE header all-reduce over the whole group. This module decides
those flags, so DTensor layouts (FSDP2, HSDP, tensor parallel, FSDP x TP,
pipeline stages) need no declaration and no collective of their own:

- a DTensor gradient counts its local tensor (``_local_tensor``) on this rank
  iff this rank's coordinate is 0 on every dimension of its mesh where the
  placement is ``Replicate``. ``Shard``, ``_StridedShard``, uneven or empty
  FSDP2 shards: every rank counts its local piece. ``Partial`` (not reduced
  yet) is refused.
- Copies outside a tensor's own mesh: a dimension of the root mesh that some
  DTensor on this rank spans but this tensor's mesh lacks is a dimension of
  copies (e.g. a 1-D data-parallel DTensor whose tensor-parallel peers hold
  the same values): it counts on coordinate 0 there. A dimension of the root
  mesh that no DTensor on this rank spans could hold either: named "pp", it
  holds other tensors (pipeline stages; the sum over the whole group adds
  them, no second collective); otherwise gclip refuses until ``replicated=``
  names it as a dimension of copies (never a silent double count).
- Plain tensors on a group of more than one rank must be declared
  (``replicated=``): no default counts every replica (sqrt(R) too large
  under DDP) or one rank's only.

``replicated=`` entries: ``True`` (the same on every rank of comm), ``False``
(this rank's own), a torch ProcessGroup (the ranks holding copies), or mesh
dimension names (``"dp"``, ``("dp", "tp")``: the ranks that differ from this
one only along them, of ``comm=DeviceMesh`` or of the gradients' mesh).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from .. import engine, layout
from ..errors import GclipTypeError, GclipValueError
from . import _compile

__all__ = ["Placed", "counting", "is_dtensor", "is_mesh", "local", "mesh_group", "undeclared_error"]


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def describe(placements: Sequence[Any]) -> str:
    """Placements as a short string, built without repr (which torch.compile cannot trace)."""
    out = []
    for p in placements:
        if p.is_partial():
            out.append(f"Partial({_reduce_op(p)})")
        elif p.is_replicate():
            out.append("Replicate()")
        else:
            split = getattr(p, "split_factor", None)
            out.append(f"Shard({p.dim})" if split is None else f"_StridedShard({p.dim}, {split})")
    return "(" + ", ".join(out) + ")"


def is_mesh(comm: Any) -> bool:
    return hasattr(comm, "mesh_dim_names") and hasattr(comm, "get_group") and hasattr(comm, "mesh")


def local(g: Any) -> torch.Tensor:
    """The DTensor's local tensor: its memory, so scaling it in place scales the gradient."""
    return g._local_tensor


class Placed(NamedTuple):
    """A DTensor gradient's entry: its mesh and placements, and what ``replicated=`` added."""

    mesh: Any
    placements: tuple[Any, ...]
    declared: Any  # None, False, or mesh dimension names of copies outside its mesh
    where: str
    signature: tuple[Any, ...] = ()  # (global shape, dtype, placements, mesh shape): peers must agree


# ---------------------------------------------------------------------------
# meshes: root coordinates, computed once per mesh


class _MeshInfo(NamedTuple):
    root: Any
    root_coord: tuple[int, ...]  # this rank on the root mesh
    coord: tuple[int, ...]  # this rank on the mesh
    spanned: frozenset[int]  # root dimensions along which the mesh's ranks vary
    ranks: tuple[int, ...]  # the mesh's global ranks
    named: bool  # the root is comm's DeviceMesh: its dimension names are the caller's


_INFO: dict[tuple[int, int], tuple[Any, Any, _MeshInfo]] = {}


def _info(mesh: Any, comm_mesh: Any = None) -> _MeshInfo:
    """Where ``mesh`` sits: on ``comm_mesh`` (comm=DeviceMesh) when its ranks are a slice of
    it, else on the root torch records for it. torch compares meshes by their ranks and names
    only, so a DTensor may carry an equal mesh sliced from another root (a mesh built earlier
    under other names): that root's grid is right, its names may not be the caller's."""
    key = (id(mesh), id(comm_mesh))
    cached = _INFO.get(key)
    if cached is not None and cached[0]() is mesh and (comm_mesh is None or cached[1]() is comm_mesh):
        return cached[2]
    info = None
    if comm_mesh is not None:
        info = _placed_on(mesh, comm_mesh, named=True)
    if info is None:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        info = _placed_on(mesh, root, named=False)
    if info is None:  # a mesh torch made by flattening or unflattening (torchtitan's): read alone,
        info = _placed_on(mesh, mesh, named=False)  # ranks outside it hold other tensors
    if info is None:
        raise GclipValueError("a gradient's DeviceMesh is not a slice of its root mesh")
    _INFO[key] = (weakref.ref(mesh), None if comm_mesh is None else weakref.ref(comm_mesh), info)
    return info


def _placed_on(mesh: Any, root: Any, named: bool) -> _MeshInfo | None:
    """``mesh`` as a slice of ``root``'s grid (None if it is not one)."""
    coord, root_coord = mesh.get_coordinate(), root.get_coordinate()
    if coord is None or root_coord is None:
        raise GclipValueError("a gradient's DeviceMesh does not hold this rank")
    grid = root.mesh
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    spanned: set[int] = set()
    for r in ranks:
        where = (grid == r).nonzero()
        if where.shape[0] != 1:
            return None
        spanned.update(d for d, c in enumerate(where[0].tolist()) if c != root_coord[d])
    index = [slice(None) if d in spanned else c for d, c in enumerate(root_coord)]
    if sorted(ranks) != sorted(int(r) for r in grid[tuple(index)].flatten().tolist()):
        return None  # not every rank of that slice of the root: not a slice
    return _MeshInfo(root, tuple(root_coord), tuple(coord), frozenset(spanned), ranks, named)


def _dims(mesh: Any, names: Any, where: str, named: bool = True) -> tuple[int, ...]:
    """Mesh dimension names -> their indices in ``mesh`` (a one-line error otherwise).
    ``named``: the mesh is the caller's (comm=DeviceMesh), not the root torch records."""
    names = (names,) if isinstance(names, str) else tuple(names)
    known = tuple(mesh.mesh_dim_names or ())
    out = []
    for n in names:
        if not isinstance(n, str) or n not in known:
            hint = (
                ""
                if named
                else " (torch may record an equal mesh built earlier under other names: pass "
                "comm=<the DeviceMesh you built> to name its dimensions)"
            )
            raise GclipValueError(
                f"{where}: {n!r} is not a dimension of the mesh{'' if named else ' torch records'} "
                f"(its dimensions: {', '.join(known) or 'unnamed'}){hint}"
            )
        out.append(known.index(n))
    return tuple(out)


def _is_names(entry: Any) -> bool:
    if isinstance(entry, str):
        return True
    return isinstance(entry, (tuple, list)) and len(entry) > 0 and all(isinstance(n, str) for n in entry)


def mesh_group(mesh: Any) -> Any:
    """The process group of every rank of ``mesh`` (comm=DeviceMesh)."""
    if mesh.get_coordinate() is None:
        raise GclipValueError("comm: this rank is not in that DeviceMesh")
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()  # torch makes (and keeps) one group per flattened slice


# ---------------------------------------------------------------------------
# who counts what


def undeclared_error(where: str, size: int) -> GclipValueError:
    return GclipValueError(
        f"{where} is a plain tensor on a group of {size} ranks: say what it holds with replicated= "
        "(True: the same on every rank, as under DDP; False: this rank's own shard; a process group "
        "or mesh dimension names: the ranks holding copies)"
    )


def counting(
    world: Any, grads: Sequence[torch.Tensor], entries: Sequence[Any], wheres: Sequence[str]
) -> engine.Counting:
    """The engine's Counting for this rank: ``entries[i]`` is grads[i]'s replicated= entry,
    None where none was given, or a :class:`Placed` for a DTensor's local tensor."""
    placed = [e for e in entries if isinstance(e, Placed)]
    if not placed and all(e is None for e in entries) and world.size == 1:
        return engine.EVERY_ARRAY
    comm_mesh = getattr(world, "mesh", None)
    mesh = comm_mesh if comm_mesh is not None or not placed else _info(placed[0].mesh).root
    plain: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Placed):
            plain.append(False)  # counted as the placements say (below)
        elif entry is None:
            if world.size > 1:
                raise undeclared_error(wheres[i], world.size)
            plain.append(False)
        elif entry is True or entry is False or type(entry).__name__ == "bool_":
            plain.append(bool(entry))
        elif _is_names(entry):
            plain.append(_names_group(world, mesh, entry, f"replicated[{i}]"))
        else:
            plain.append(world.group(entry, i))
    result = layout.counting(plain, cast(Any, grads), rank=world.rank, size=world.size)  # shapes, dtypes
    if world.size == 1 and not placed:
        return result
    if placed and not hasattr(world, "ranks"):
        raise GclipTypeError(
            f"{placed[0].where} is a DTensor: pass a torch.distributed comm (or None), not MPI"
        )
    owned = list(result.owned or [True] * len(grads))
    spans: dict[int, set[int]] = {}
    for e in placed:
        info = _info(e.mesh, comm_mesh)
        spans.setdefault(id(info.root), set()).update(info.spanned)
    decided: dict[tuple[int, tuple[Any, ...], str], bool] = {}  # models share few (mesh, placements)
    for i, entry in enumerate(entries):
        if isinstance(entry, Placed):
            key = (id(entry.mesh), entry.signature[2], str(entry.declared))
            if key not in decided:
                decided[key] = _owns(world, entry, spans, comm_mesh)
            owned[i] = owned[i] and decided[key]
    ring, held = _list_ring(world, placed, comm_mesh)
    both = (result.ring[0] + ring[0], result.ring[1] + ring[1])
    return engine.Counting(owned, both, (result.summary, held), _explain)


def _list_ring(world: Any, placed: Sequence[Placed], comm_mesh: Any) -> tuple[tuple[float, float], Any]:
    """This rank's share of the ring sums (``layout``) that say the ranks of each DTensor mesh
    hold the same list of DTensors (global shape, dtype, placements, mesh shape), as they must:
    0 over all ranks when they do, so a rank that passes one tensor fewer, one with another
    shape or placement, or none at all, is one agreed error (no collective of its own): each
    member adds its term, so one that adds none (it passes nothing on that mesh) breaks the sum."""
    lists: dict[tuple[int, ...], list[Any]] = {}
    for e in placed:
        members = tuple(sorted(world.ranks[r] for r in _info(e.mesh, comm_mesh).ranks))
        lists.setdefault(members, []).append(e.signature)
    held = {members: tuple(items) for members, items in lists.items()}
    ring = [0.0, 0.0]
    for members, items in held.items():
        i, k, what = members.index(world.rank), len(members), repr(items)
        for slot, salt in enumerate((b"gclip-dtensor-a", b"gclip-dtensor-b")):
            ring[slot] += _ring(salt, members, i, what) - _ring(salt, members, (i + 1) % k, what)
    return (ring[0], ring[1]), held


@_compile.constant_result
def _ring(salt: bytes, members: tuple[int, ...], position: int, what: str) -> float:
    """``layout._ring`` (a hash: computed once at trace time under torch.compile)."""
    return float(layout._ring(salt, members, position, what))


def _explain(summaries: list[Any]) -> str:
    """One line naming what the ranks disagree on: the copies of plain tensors (``layout``), or
    the DTensors of a mesh."""
    plain = [s[0] if s else None for s in summaries]
    if any(plain):
        told = layout._explain(plain)
        if not told.startswith("ranks disagree"):
            return told
    held = [s[1] if s else {} for s in summaries]
    groups: dict[tuple[int, ...], None] = {}
    for h in held:
        groups.update(dict.fromkeys(h or {}))
    for members in sorted(groups, key=len):
        views = {r: (held[r] or {}).get(members, ()) for r in members if r < len(held)}
        kinds = list(dict.fromkeys(views.values()))
        if len(kinds) > 1:
            common = max(kinds, key=lambda k: sum(v == k for v in views.values()))
            odd = [r for r, v in views.items() if v != common]
            theirs = views[odd[0]]
            at = next(
                i for i in range(max(len(theirs), len(common))) if theirs[i : i + 1] != common[i : i + 1]
            )
            return (
                f"the ranks of mesh {layout.ranges(members)} disagree on the DTensors they pass: "
                f"{'rank' if len(odd) == 1 else 'ranks'} {layout.ranges(odd)} "
                f"{len(theirs)}, the others {len(common)}; the first that differs, #{at}: "
                f"{_signature(theirs, at)} against {_signature(common, at)} (each rank must pass the "
                "same parameters, each with its .grad)"
            )
    return "ranks disagree on the DTensors they pass"


def _signature(items: tuple[Any, ...], i: int) -> str:
    if i >= len(items):
        return "none"
    shape, dtype, placements, _ = items[i]
    return f"{tuple(shape)} {dtype.removeprefix('torch.')} {placements}"


def _owns(world: Any, e: Placed, spans: dict[int, set[int]], comm_mesh: Any) -> bool:
    """Does this rank count the DTensor's local tensor?"""
    info = _info(e.mesh, comm_mesh)
    if any(r not in world.ranks for r in info.ranks):
        raise GclipValueError(f"{e.where}: its DeviceMesh has ranks outside comm")
    counted_here = True  # along its own mesh: coordinate 0 of every Replicate dimension
    for dim, p in enumerate(e.placements):
        if p.is_partial():
            raise GclipValueError(
                f"{e.where} is a Partial({_reduce_op(p)}) DTensor: gclip reduces Partial sums and "
                "averages; reduce it (redistribute to Replicate or Shard) before clipping"
            )
        if p.is_replicate() and info.coord[dim] != 0:
            counted_here = False
    root = info.root
    copies = spans[id(root)] - info.spanned  # root dims other DTensors span, this one lacks
    if e.declared not in (None, False):
        for n in _dims(root, e.declared, e.where, info.named):
            if n in info.spanned:
                raise GclipValueError(
                    f"{e.where}: {root.mesh_dim_names[n]!r} is a dimension of its own mesh: "
                    "its placement says what it holds"
                )
            copies.add(n)
    names = tuple(root.mesh_dim_names or (f"#{d}" for d in range(root.ndim)))
    for d in range(root.ndim):  # spanned by no DTensor here: pipeline stages, or copies?
        if d in spans[id(root)] or d in copies or root.mesh.shape[d] == 1:
            continue
        if info.named and names[d] == "pp":
            continue  # comm's own mesh names it: pipeline stages, added by the one SUM
        if info.named:
            raise GclipValueError(
                f"{e.where}: no DTensor on this rank spans dimension {names[d]!r} of comm's mesh, so its "
                f"ranks may hold copies or other tensors: declare copies with replicated={names[d]!r}, or "
                "name the dimension 'pp' if it holds pipeline stages"
            )
        raise GclipValueError(
            f"{e.where}: no DTensor on this rank spans dimension {d} ({names[d]!r}) of the mesh torch "
            f"records for it (dimensions {', '.join(names)}), so its ranks may hold copies or other "
            f"tensors: declare copies with replicated={names[d]!r}, or pass comm=<the DeviceMesh you "
            "built> (its names are then read: a dimension 'pp' holds pipeline stages). torch may "
            "record an equal mesh built earlier under other names, so gclip reads none from it"
        )
    return counted_here and all(info.root_coord[d] == 0 for d in copies)


def _reduce_op(p: Any) -> str:
    return str(getattr(p, "reduce_op", "sum"))


def _names_group(world: Any, mesh: Any, names: Any, where: str) -> layout.Group:
    """The ranks that differ from this one only along the named dimensions, as ranks of comm."""
    if mesh is None:
        raise GclipValueError(f"{where}: mesh dimension names need comm=DeviceMesh (or DTensor gradients)")
    dims = _dims(mesh, names, where)
    coord = mesh.get_coordinate()
    if coord is None:
        raise GclipValueError(f"{where}: this rank is not in the mesh")
    index: list[Any] = [slice(None) if d in dims else c for d, c in enumerate(coord)]
    members = [int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()]
    ranks = getattr(world, "ranks", None)
    if ranks is None or any(m not in ranks for m in members):
        raise GclipValueError(f"{where}: the mesh has ranks outside comm")
    me = dist.get_rank()
    return layout.Group(tuple(ranks[m] for m in members), members.index(me))


# ---------------------------------------------------------------------------
# who holds copies (check_replicas)


def holders(
    world: Any, tensors: Sequence[Any], entries: Sequence[Any], wheres: Sequence[str]
) -> list[tuple[int, ...]]:
    """For each tensor, the ranks of comm that hold identical copies of this rank's local
    tensor (this rank alone for a shard), read as :func:`counting` reads them."""
    if not hasattr(world, "ranks"):
        raise GclipTypeError("check_replicas in gclip.torch takes a torch.distributed comm (or None)")
    placed = [e for e in entries if isinstance(e, Placed)]
    comm_mesh = getattr(world, "mesh", None)
    mesh = comm_mesh if comm_mesh is not None or not placed else _info(placed[0].mesh).root
    spans: dict[int, set[int]] = {}
    for e in placed:
        info = _info(e.mesh, comm_mesh)
        spans.setdefault(id(info.root), set()).update(info.spanned)
    me = dist.get_rank()
    out: list[tuple[int, ...]] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Placed):
            out.append(tuple(world.ranks[r] for r in _copies_of(entry, spans, comm_mesh)))
        elif entry is None or entry is False:
            if entry is None and world.size > 1:
                raise undeclared_error(wheres[i], world.size)
            out.append((world.ranks[me],))
        elif entry is True:
            out.append(tuple(range(world.size)))
        elif _is_names(entry):
            out.append(_names_group(world, mesh, entry, f"replicated[{i}]").members)
        else:
            out.append(world.group(entry, i).members)
    return out


def _copies_of(e: Placed, spans: dict[int, set[int]], comm_mesh: Any) -> list[int]:
    """The global ranks holding the same local tensor as this rank: along its mesh's Replicate
    dimensions and along the root dimensions of copies; first the one that counts it (coordinate 0)."""
    info = _info(e.mesh, comm_mesh)
    if any(p.is_partial() for p in e.placements):
        raise GclipValueError(f"{e.where} is a Partial DTensor (not reduced yet)")
    index: list[Any] = [slice(None) if p.is_replicate() else c for p, c in zip(e.placements, info.coord)]
    same = {int(r) for r in e.mesh.mesh[tuple(index)].flatten().tolist()}
    copies = spans[id(info.root)] - info.spanned
    if e.declared not in (None, False):
        copies.update(_dims(info.root, e.declared, e.where, info.named))
    grid = info.root.mesh
    out: dict[int, tuple[int, ...]] = {}
    for r in same:
        coord = (grid == r).nonzero()[0].tolist()
        along: list[Any] = [slice(None) if d in copies else c for d, c in enumerate(coord)]
        for x in grid[tuple(along)].flatten().tolist():
            out[int(x)] = tuple((grid == int(x)).nonzero()[0].tolist())
    return sorted(out, key=out.__getitem__)  # by root coordinates: the one at 0 first
