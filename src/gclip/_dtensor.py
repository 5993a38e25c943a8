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

from . import engine, layout
from .errors import GclipTypeError, GclipValueError

__all__ = ["Placed", "counting", "is_dtensor", "is_mesh", "local", "mesh_group", "undeclared_error"]


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements") and hasattr(t, "device_mesh")


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


# ---------------------------------------------------------------------------
# meshes: root coordinates, computed once per mesh


class _MeshInfo(NamedTuple):
    root: Any
    root_coord: tuple[int, ...]  # this rank on the root mesh
    coord: tuple[int, ...]  # this rank on the mesh
    spanned: frozenset[int]  # root dimensions along which the mesh's ranks vary
    ranks: tuple[int, ...]  # the mesh's global ranks


_INFO: dict[int, tuple[Any, _MeshInfo]] = {}


def _info(mesh: Any) -> _MeshInfo:
    cached = _INFO.get(id(mesh))
    if cached is not None and cached[0]() is mesh:
        return cached[1]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    coord, root_coord = mesh.get_coordinate(), root.get_coordinate()
    if coord is None or root_coord is None:
        raise GclipValueError("a gradient's DeviceMesh does not hold this rank")
    grid = root.mesh
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    spanned: set[int] = set()
    for r in ranks:
        where = (grid == r).nonzero()
        if where.shape[0] != 1:
            raise GclipValueError("a gradient's DeviceMesh is not a slice of its root mesh")
        spanned.update(d for d, c in enumerate(where[0].tolist()) if c != root_coord[d])
    info = _MeshInfo(root, tuple(root_coord), tuple(coord), frozenset(spanned), ranks)
    _INFO[id(mesh)] = (weakref.ref(mesh), info)
    return info


def _dims(mesh: Any, names: Any, where: str) -> tuple[int, ...]:
    """Mesh dimension names -> their indices in ``mesh`` (a one-line error otherwise)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    known = tuple(mesh.mesh_dim_names or ())
    out = []
    for n in names:
        if not isinstance(n, str) or n not in known:
            raise GclipValueError(
                f"{where}: {n!r} is not a dimension of the mesh "
                f"(its dimensions: {', '.join(known) or 'unnamed'})"
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
    mesh = getattr(world, "mesh", None)
    if mesh is None and placed:
        mesh = _info(placed[0].mesh).root
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
    if not placed:
        return result
    if not hasattr(world, "ranks"):
        raise GclipTypeError(
            f"{placed[0].where} is a DTensor: pass a torch.distributed comm (or None), not MPI"
        )
    owned = list(result.owned or [True] * len(grads))
    spans: dict[int, set[int]] = {}
    for e in placed:
        info = _info(e.mesh)
        spans.setdefault(id(info.root), set()).update(info.spanned)
    decided: dict[tuple[int, tuple[Any, ...], str], bool] = {}  # models share few (mesh, placements)
    for i, entry in enumerate(entries):
        if isinstance(entry, Placed):
            key = (id(entry.mesh), entry.placements, repr(entry.declared))
            if key not in decided:
                decided[key] = _owns(world, entry, spans)
            owned[i] = owned[i] and decided[key]
    return result._replace(owned=owned)


def _owns(world: Any, e: Placed, spans: dict[int, set[int]]) -> bool:
    """Does this rank count the DTensor's local tensor?"""
    info = _info(e.mesh)
    if any(r not in world.ranks for r in info.ranks):
        raise GclipValueError(f"{e.where}: its DeviceMesh has ranks outside comm")
    counted_here = True  # along its own mesh: coordinate 0 of every Replicate dimension
    for dim, p in enumerate(e.placements):
        if p.is_partial():
            raise GclipValueError(
                f"{e.where} is a Partial DTensor (not reduced yet): reduce it (redistribute to "
                "Replicate or Shard) before clipping"
            )
        if p.is_replicate() and info.coord[dim] != 0:
            counted_here = False
    root = info.root
    copies = spans[id(root)] - info.spanned  # root dims other DTensors span, this one lacks
    if e.declared not in (None, False):
        for n in _dims(root, e.declared, e.where):
            if n in info.spanned:
                raise GclipValueError(
                    f"{e.where}: {root.mesh_dim_names[n]!r} is a dimension of its own mesh: "
                    "its placement says what it holds"
                )
            copies.add(n)
    names = tuple(root.mesh_dim_names or (f"#{d}" for d in range(root.ndim)))
    for d in range(root.ndim):  # spanned by no DTensor here: pipeline stages, or copies?
        if d not in spans[id(root)] and d not in copies and root.mesh.shape[d] > 1 and names[d] != "pp":
            raise GclipValueError(
                f"{e.where}: no DTensor on this rank spans dimension {names[d]!r} of its root mesh, so its "
                f"ranks may hold copies or other tensors: declare copies with replicated={names[d]!r}, or "
                "name the dimension 'pp' if it holds pipeline stages"
            )
    return counted_here and all(info.root_coord[d] == 0 for d in copies)


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
    mesh = getattr(world, "mesh", None)
    if mesh is None and placed:
        mesh = _info(placed[0].mesh).root
    spans: dict[int, set[int]] = {}
    for e in placed:
        info = _info(e.mesh)
        spans.setdefault(id(info.root), set()).update(info.spanned)
    me = dist.get_rank()
    out: list[tuple[int, ...]] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Placed):
            out.append(tuple(world.ranks[r] for r in _copies_of(entry, spans)))
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


def _copies_of(e: Placed, spans: dict[int, set[int]]) -> list[int]:
    """The global ranks holding the same local tensor as this rank: along its mesh's Replicate
    dimensions and along the root dimensions of copies; first the one that counts it (coordinate 0)."""
    info = _info(e.mesh)
    _owns_check = [p for p in e.placements if p.is_partial()]
    if _owns_check:
        raise GclipValueError(f"{e.where} is a Partial DTensor (not reduced yet)")
    index: list[Any] = [slice(None) if p.is_replicate() else c for p, c in zip(e.placements, info.coord)]
    same = {int(r) for r in e.mesh.mesh[tuple(index)].flatten().tolist()}
    copies = spans[id(info.root)] - info.spanned
    if e.declared not in (None, False):
        copies.update(_dims(info.root, e.declared, e.where))
    grid = info.root.mesh
    out: dict[int, tuple[int, ...]] = {}
    for r in same:
        coord = (grid == r).nonzero()[0].tolist()
        along: list[Any] = [slice(None) if d in copies else c for d, c in enumerate(coord)]
        for x in grid[tuple(along)].flatten().tolist():
            out[int(x)] = tuple((grid == int(x)).nonzero()[0].tolist())
    return sorted(out, key=out.__getitem__)  # by root coordinates: the one at 0 first
