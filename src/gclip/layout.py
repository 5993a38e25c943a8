"""Parallel layouts: which rank counts which array, so every element counts exactly once.

A rank holds disjoint shards (counted where they are) and copies of tensors that a group of
ranks holds identically (a DP replica group, the TP ranks for a layer norm, the first and last
pipeline stage for a tied embedding). A copy counts on its group's rank 0 only: exact, no
division by the number of copies, no extra collective. ``replicated=`` takes one entry per
array: ``False`` (a shard), ``True`` (the same on every rank of ``comm``), or a communicator
(a subgroup of ``comm``; a :class:`Group` on simulated ranks) of the ranks holding copies.

The ranks of a group must agree on what they hold: rank i of a group adds H(group, i, what it
holds) - H(group, i+1, what it holds) to two "ring" sums in the engine's header, so the sum over
a group is exactly 0 when every member holds the same, and not 0 (but with probability ~2**-40)
otherwise: the check costs no collective. :class:`Mesh` names a layout's axes and builds the groups.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .errors import GclipTypeError, GclipValueError

__all__ = [
    "AXES",
    "EVERY_ARRAY",
    "Counting",
    "Group",
    "Mesh",
    "Placement",
    "counting",
    "for_ranks",
    "is_flag",
    "is_group",
    "is_shard",
    "ranges",
]

AXES = ("pp", "dp", "tp", "ep")  # the names a Mesh knows, in their usual order
_RING_BITS = 20  # per hash: sums of +-2**20 terms stay exact in float64 for 2**32 terms


class Counting(NamedTuple):
    """Which of this rank's arrays it counts, and the test that the ranks agree on it.

    ``owned[i]``: this rank counts array i (a copy counts on one rank of its group).
    ``ring``: this rank's share of the two ring sums (see the module docstring).
    ``summary``: what this rank declared, gathered only to explain a disagreement,
    which ``explain(summaries)`` says in one line.
    """

    owned: Sequence[bool] | None = None  # None: every array is this rank's
    ring: tuple[float, float] = (0.0, 0.0)
    summary: Any = None
    explain: Callable[[list[Any]], str] | None = None


EVERY_ARRAY = Counting()


def for_ranks(replicated: Any, size: int) -> list[Any]:
    """``replicated=`` of R simulated ranks, one entry per rank: one list for every rank (flags),
    or one list per rank (``replicated[r]``, with :class:`Group` entries for groups)."""
    nested = isinstance(replicated, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in replicated)
    if not nested or not replicated:
        return [replicated] * size
    if len(replicated) != size:
        raise GclipValueError(f"replicated has {len(replicated)} lists for {size} ranks")
    return list(replicated)


@dataclass(frozen=True)
class Group:
    """A group of simulated ranks holding identical copies: ``members`` in
    world ranks (group rank order), ``rank`` this member's position."""

    members: tuple[int, ...]
    rank: int

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.members)


def is_flag(entry: Any) -> bool:
    """A flag (True, False; None), not a group."""
    return entry is None or isinstance(entry, (bool, np.bool_))


def is_shard(entry: Any) -> bool:
    """False: this rank's own shard, counted here (None, "no copy here", is refused apart)."""
    return isinstance(entry, (bool, np.bool_)) and not entry


def is_group(entry: Any) -> bool:
    """A communicator or a simulated Group (not a flag)."""
    return isinstance(entry, Group) or (hasattr(entry, "Get_rank") and hasattr(entry, "Get_size"))


# who counts what


class _Holding(NamedTuple):
    members: tuple[int, ...]  # the group, in world ranks of comm
    position: int  # this rank's place in it


def counting(
    entries: Sequence[Any] | None, arrays: Sequence[np.ndarray], *, rank: int, size: int, comm: Any = None
) -> Counting:
    """The Counting for this rank: what it counts and its share of the ring sums.

    ``entries`` has one entry per array (see the module docstring); ``comm``
    is the clip's communicator (None on simulated ranks, where groups are
    :class:`Group`).
    """
    if entries is None:
        return EVERY_ARRAY
    owned: list[bool] = []
    held: dict[tuple[int, ...], list[tuple[tuple[int, ...], str]]] = {}
    where: dict[tuple[int, ...], int] = {}
    for i, (entry, a) in enumerate(zip(entries, arrays)):
        if entry is None:
            raise no_copy_here(i)
        if is_shard(entry):
            owned.append(True)
            continue
        if is_flag(entry):
            holding = _Holding(tuple(range(size)), rank)
        elif is_group(entry):
            holding = _holding(entry, comm, rank, size, i)
        else:
            raise GclipTypeError(
                f"replicated[{i}] must be True, False or a communicator, got {type(entry).__name__}"
            )
        owned.append(holding.position == 0)
        held.setdefault(holding.members, []).append((tuple(a.shape), _dtype_code(a.dtype)))
        where[holding.members] = holding.position
    ring = [0.0, 0.0]
    for members, items in held.items():
        k, i = len(members), where[members]
        what = repr(items)
        for slot, salt in enumerate((b"gclip-a", b"gclip-b")):
            ring[slot] += _ring(salt, members, i, what) - _ring(salt, members, (i + 1) % k, what)
    summary = {members: items for members, items in held.items()}
    return Counting(owned, (ring[0], ring[1]), summary, _explain)


def no_copy_here(index: int) -> GclipTypeError:
    """The error for a None entry: None means "this rank holds no copy" (Mesh.tied,
    Mesh.entry), so an array declared so is not this rank's to count; it is refused
    rather than counted as a shard."""
    return GclipTypeError(
        f"replicated[{index}] is None (no copy on this rank): leave that array out of grads, "
        "or pass False for a shard, True or a group for a copy"
    )


def _dtype_code(dtype: Any) -> str:
    """numpy's code ('<f4'); a torch dtype's name ('torch.bfloat16': gclip.torch's tensors)."""
    return dtype.str if isinstance(dtype, np.dtype) else str(dtype)


def _ring(salt: bytes, members: tuple[int, ...], position: int, what: str) -> float:
    key = salt + repr((members, position, what)).encode()
    return float(zlib.crc32(key) & ((1 << _RING_BITS) - 1))


def _holding(entry: Any, comm: Any, rank: int, size: int, index: int) -> _Holding:
    if isinstance(entry, Group):
        members, position = entry.members, entry.rank
        if len(set(members)) != len(members) or not all(0 <= m < size for m in members):
            raise GclipValueError(
                f"replicated[{index}]: group {members} is not a set of ranks in 0..{size - 1}"
            )
        if members[position] != rank:
            raise GclipValueError(
                f"replicated[{index}]: rank {rank} is not member {position} of group {members}"
            )
        return _Holding(members, position)
    if comm is None:
        raise GclipTypeError(
            f"replicated[{index}]: simulated ranks take a gclip.layout.Group, not a communicator"
        )
    return _Holding(_members(entry, comm, index), entry.Get_rank())


_TRANSLATED: dict[tuple[int, int], tuple[Any, Any, tuple[int, ...]]] = {}


def _members(sub: Any, comm: Any, index: int) -> tuple[int, ...]:
    """The ranks of ``sub`` as ranks of ``comm``, in sub's order; computed once per pair."""
    try:
        key = (sub.py2f(), comm.py2f())
    except Exception:  # noqa: BLE001 - not an mpi4py communicator
        raise GclipTypeError(
            f"replicated[{index}] must be an mpi4py communicator, got {type(sub).__name__}"
        ) from None
    cached = _TRANSLATED.get(key)
    if cached is not None and cached[0]() is sub and cached[1]() is comm:
        return cached[2]
    from mpi4py import MPI

    if sub == MPI.COMM_NULL:
        raise GclipValueError(f"replicated[{index}] is MPI.COMM_NULL: this rank is not in that group")
    g_sub, g_comm = sub.Get_group(), comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(g_sub, list(range(sub.Get_size())), g_comm)
    finally:
        g_sub.Free()
        g_comm.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise GclipValueError(f"replicated[{index}]: the communicator has ranks outside comm")
    members = tuple(int(r) for r in ranks)
    _TRANSLATED[key] = (weakref.ref(sub), weakref.ref(comm), members)
    return members


def _explain(summaries: list[Any]) -> str:
    """One line naming a group whose members disagree, from every rank's summary."""
    groups: dict[tuple[int, ...], None] = {}
    for summary in summaries:
        groups.update(dict.fromkeys(summary or {}))
    for members in groups:
        views = {r: repr((summaries[r] or {}).get(members)) for r in members if r < len(summaries)}
        kinds = list(dict.fromkeys(views.values()))
        if len(kinds) > 1:
            common = max(kinds, key=lambda k: sum(v == k for v in views.values()))
            odd = [r for r, v in views.items() if v != common]
            first = (summaries[odd[0]] or {}).get(members)
            usual = (summaries[next(r for r in members if views[r] == common)] or {}).get(members)
            return (
                f"the ranks of group {ranges(members)} disagree on the copies they hold: "
                f"{'rank' if len(odd) == 1 else 'ranks'} {ranges(odd)} {_held(first)}, "
                f"the others {_held(usual)}"
            )
    return "ranks disagree on the arrays they declared replicated"


def ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5': rank lists stay short in messages."""
    out: list[str] = []
    ranks = list(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _held(items: Any) -> str:
    if not items:
        return "declare none"
    shapes = ", ".join(
        f"{list(shape)} {dt[len('torch.') :] if dt.startswith('torch.') else np.dtype(dt).name}"
        for shape, dt in items
    )
    return f"declare {len(items)} array{'s' * (len(items) != 1)} ({shapes})"


# named meshes


class Placement(NamedTuple):
    """How a tensor lies on a mesh, by axis names (as DTensor gives each axis a placement).

    ``replicated``: the axes along which its copies are identical; ``sharded``:
    the axes along which it is cut into different pieces; any other axis holds
    other tensors (pipeline stages). ``tied``: an axis across whose first and
    last index the same tensor lives (the embedding shared by the first and the
    last pipeline stage). Axes a mesh does not have are ignored, so one model's
    placements serve every mesh.
    """

    replicated: tuple[str, ...] = ()
    sharded: tuple[str, ...] = ()
    tied: str | None = None


def _check_mesh(axes: dict[str, Any], size: int) -> None:
    if not axes:
        raise GclipValueError("Mesh needs at least one axis, e.g. Mesh(comm, dp=2, tp=2)")
    for name, n in axes.items():
        if name not in AXES:
            raise GclipValueError(f"Mesh: unknown axis {name!r}; the axes are {', '.join(AXES)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GclipValueError(f"Mesh: axis {name} must be a whole number >= 1, got {n!r}")
    if math.prod(axes.values()) != size:
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise GclipValueError(f"Mesh: {shape} = {math.prod(axes.values())} ranks, but the world has {size}")


def _agree_on_mesh(every: Sequence[tuple[str | None, str]]) -> None:
    """Every rank's (error, axes): the same error on every rank if any rank has one, or if
    the ranks asked for different meshes (their groups would not match)."""
    errors = [(r, message) for r, (message, _) in enumerate(every) if message is not None]
    if errors:
        r, message = errors[0]
        same = all(m == message for m, _ in every)
        raise GclipValueError(message if same else f"{message} (on rank {r} of {len(every)})")
    asked: dict[str, list[int]] = {}
    for r, (_, axes) in enumerate(every):
        asked.setdefault(axes, []).append(r)
    if len(asked) > 1:
        said = "; ".join(
            f"{'rank' if len(rs) == 1 else 'ranks'} {ranges(rs)}: {axes}" for axes, rs in asked.items()
        )
        raise GclipValueError(f"Mesh: the ranks ask for different meshes ({said})")


class Mesh:
    """Named axes over the ranks of ``comm``, and the groups of a layout.

    ``Mesh(comm, pp=2, dp=2, tp=2)``: the axes in the order given, their
    product the size of ``comm``; the last axis varies fastest over the
    ranks, so a TP group is consecutive ranks (as Megatron-LM lays it out).
    ``comm`` may be an mpi4py communicator, or ``(rank, size)`` for simulated
    ranks (the groups are then :class:`Group`).

    A tensor's entry for ``replicated=`` says on which axes its copies are
    identical: ``mesh.replicated("dp")`` for a TP shard replicated over data
    parallel ranks, ``mesh.replicated("dp", "tp")`` for a layer norm that every
    TP rank duplicates, ``mesh.tied("pp", replicated=("dp",))`` for an embedding
    tied between the first and last stage. Any axis not named holds different
    values (shards, or other stages' tensors). Groups are made once (the
    communicator's collective ``Split``, on every rank) and kept.
    """

    def __init__(self, comm: Any, **axes: int) -> None:
        if isinstance(comm, tuple):
            rank, size = comm
            self.comm = None
        else:
            if not (hasattr(comm, "Get_rank") and hasattr(comm, "Split")):
                raise GclipTypeError(
                    f"Mesh needs an mpi4py communicator or (rank, size), got {type(comm).__name__}"
                )
            rank, size = comm.Get_rank(), comm.Get_size()
            self.comm = comm
        try:
            _check_mesh(axes, size)
            error = None
        except GclipValueError as exc:
            error = exc
        if self.comm is not None:  # one allgather, once: every rank raises together, or none does
            asked = ",".join(f"{k}={v!r}" for k, v in axes.items())
            _agree_on_mesh(self.comm.allgather((None if error is None else str(error), asked)))
        elif error is not None:
            raise error
        self.axes: tuple[str, ...] = tuple(axes)
        self.shape: dict[str, int] = dict(axes)
        self.rank, self.size = rank, size
        place = np.unravel_index(rank, tuple(axes.values()))
        self.coords: dict[str, int] = dict(zip(self.axes, map(int, place)))
        self._groups: dict[Any, Any] = {}

    @classmethod
    def parse(cls, comm: Any, text: str) -> Mesh:
        """``Mesh.parse(comm, "pp=2,dp=2,tp=2")``: the command-line spelling."""
        axes: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            if not sep or not value.strip().isdigit():
                raise GclipValueError(f"layout {text!r}: write axes as NAME=N, e.g. pp=2,dp=2,tp=2")
            if name.strip() in axes:
                raise GclipValueError(f"layout {text!r}: axis {name.strip()!r} is given twice")
            axes[name.strip()] = int(value)
        return cls(comm, **axes)

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{k}={v}' for k, v in self.shape.items())})"

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.shape.items())

    def rank_of(self, **coords: int) -> int:
        """The world rank at these coordinates (axes not given: this rank's)."""
        full = {**self.coords, **coords}
        return int(np.ravel_multi_index(tuple(full[a] for a in self.axes), tuple(self.shape.values())))

    def _check_axes(self, axes: Sequence[str]) -> tuple[str, ...]:
        for a in axes:
            if a not in self.shape:
                raise GclipValueError(f"{self!r} has no axis {a!r}")
        return tuple(a for a in self.axes if a in axes)

    def replicated(self, *axes: str) -> Any:
        """The group of ranks that differ from this one only along ``axes`` (False: this rank alone)."""
        axes = self._check_axes(axes)
        if math.prod(self.shape[a] for a in axes) == 1:
            return False
        return self._group(("over", axes), self._color_over(axes))

    def entry(self, placement: Placement) -> Any:
        """The ``replicated=`` entry of a tensor placed so: False, a group, or None
        (a tied tensor on a rank that holds no copy)."""
        reps = tuple(a for a in placement.replicated if a in self.shape)
        if placement.tied and placement.tied in self.shape and self.shape[placement.tied] > 1:
            return self.tied(placement.tied, replicated=reps)
        return self.replicated(*reps)

    def tied(self, axis: str, stages: Sequence[int] = (0, -1), replicated: Sequence[str] = ()) -> Any:
        """The group holding a tensor tied across ``stages`` of ``axis`` (e.g. the
        embedding of the first and the last pipeline stage), also replicated
        over ``replicated``. On a rank not on those stages: None (it holds no copy, so
        it leaves the tensor out of grads; a None entry in ``replicated=`` is refused)."""
        (axis,) = self._check_axes((axis,))
        reps = self._check_axes(replicated)
        if axis in reps:
            raise GclipValueError(f"tied: axis {axis!r} cannot also be replicated")
        chosen = sorted({s % self.shape[axis] for s in stages})
        on = self.holds_tied(axis, stages)
        color = None if not on else self._color_over((axis, *reps))
        group = self._group(("tied", axis, tuple(chosen), reps), color)
        if not on:
            return None
        return group if len(chosen) * math.prod(self.shape[a] for a in reps) > 1 else False

    def holds_tied(self, axis: str, stages: Sequence[int] = (0, -1)) -> bool:
        n = self.shape[axis]
        return self.coords[axis] in {s % n for s in stages}

    def _color_over(self, axes: tuple[str, ...]) -> int:
        """Ranks that agree on every axis outside ``axes`` get the same color."""
        rest = [a for a in self.axes if a not in axes]
        color = 0
        for a in rest:
            color = color * self.shape[a] + self.coords[a]
        return color

    def _group(self, key: Any, color: int | None) -> Any:
        """Made once per key; on MPI by Split, a collective: every rank asks for every key."""
        if key in self._groups:
            return self._groups[key]
        if self.comm is None:
            group = None if color is None else Group(*self._members(key, color))
        else:
            from mpi4py import MPI

            sub = self.comm.Split(MPI.UNDEFINED if color is None else color, self.rank)
            group = None if sub == MPI.COMM_NULL else sub
        self._groups[key] = group
        return group

    def _members(self, key: Any, color: int) -> tuple[tuple[int, ...], int]:
        """Simulated ranks: the world ranks with this key's color, and this rank's place."""
        members = []
        for r in range(self.size):
            other = Mesh((r, self.size), **self.shape)
            if key[0] == "tied" and not other.holds_tied(key[1], key[2]):
                continue
            axes = key[1] if key[0] == "over" else (key[1], *key[3])
            if other._color_over(axes) == color:
                members.append(r)
        return tuple(members), members.index(self.rank)

    def free(self) -> None:
        """Free the communicators this mesh made (MPI only)."""
        for g in self._groups.values():
            if g is not None and hasattr(g, "Free"):
                g.Free()
        self._groups.clear()
