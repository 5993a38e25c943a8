"""The gradients that ``gclip.torch`` clips, read for the engine (``engine.check``).

A parameter's ``.grad`` (None skipped, as torch does) or a tensor itself; a
DTensor as its local tensor and the entry its placements imply (``gclip.torch._dtensor``).
The same gradient given twice counts and is scaled once; two that overlap in memory
in part are an error. :func:`backend`'s reader gives back :class:`Gradients`, which
scale themselves in place (``_partials.multiply_by``): the torch backend, whole.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .. import _kernels, engine, reader
from ..errors import GclipTypeError, GclipValueError
from . import _dtensor, _partials

__all__ = ["FLOAT_DTYPES", "Gradients", "backend", "gradients"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DENSE_DTYPES = frozenset(FLOAT_DTYPES)
_STRIDED = torch.strided


def _as_list(value: Any, name: str) -> list[Any]:
    """A tensor -> [it]; any iterable (a generator too) read exactly once."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise GclipTypeError(f"{name} must be a tensor or an iterable of tensors, got {type(value).__name__}")
    return list(value)


def _checked(g: Any, where: str) -> torch.Tensor:
    if not isinstance(g, torch.Tensor):
        hint = " (named_parameters()? pass the parameters alone)" if isinstance(g, tuple) else ""
        raise GclipTypeError(f"{where} must be a tensor, got {type(g).__name__}{hint}")
    if _dtensor.is_dtensor(g):
        _checked(_dtensor.local(g), where)  # its local tensor is what this rank holds and scales
        return g
    if g.device.type == "meta":
        raise GclipValueError(
            f"{where} is on the meta device: it holds no values, so there is no norm to take "
            "(materialise the model first, e.g. to_empty() and its initialisation)"
        )
    if g.layout != torch.strided:
        raise GclipTypeError(f"{where} is a {g.layout} tensor; gclip clips dense tensors")
    if g.dtype not in FLOAT_DTYPES:
        raise GclipTypeError(
            f"{where} has dtype {g.dtype}; gclip clips float16, bfloat16, float32 or float64"
        )
    return g


class Gradients(NamedTuple):
    """The gradients read for one call: the arrays as read (``engine.Grads``)."""

    tensors: list[torch.Tensor]  # each distinct gradient once, as counted (a DTensor's local tensor)
    entries: list[Any]  # its replicated= entry (None: none given; a DTensor's: _dtensor.Placed)
    wheres: list[str]  # where it came from, for messages
    foreach: bool | None = None  # how the factor is applied: False, tensor by tensor
    targets: list[torch.Tensor] | None = None  # what is scaled, where not ``tensors`` (Partial grads)

    def scaled(self, factor: float, inplace: bool) -> None:
        """Each gradient multiplied in place by ``factor`` (torch's clip is always in place)."""
        _partials.multiply_by(self.scaled_tensors, factor, self.foreach)

    @property
    def scaled_tensors(self) -> list[torch.Tensor]:
        """The local tensors the scale multiplies: a Partial gradient's own, not its reduced copy."""
        return self.tensors if self.targets is None else self.targets


def _read(
    items: Any,
    replicated: Any,
    inplace: bool,
    *,
    of_parameters: bool,
    foreach: bool | None,
    probe: torch.Tensor | None = None,
) -> Any:
    """The engine's reader for tensors: (the gradients, each distinct one once, their entries)."""
    read = gradients(items, replicated, of_parameters=of_parameters, probe=probe, foreach=foreach)
    if inplace:  # refused here, the error is agreed; torch's multiply would raise on this rank alone
        for g, where in zip(read.scaled_tensors, read.wheres):
            if g.is_contiguous() and g.numel():
                continue  # dense: no stride 0 along an axis of more than one element
            if any(stride == 0 and n > 1 for n, stride in zip(g.shape, g.stride())):
                raise GclipValueError(
                    f"{where} is expanded (stride 0: several elements are one memory location) and "
                    "cannot be scaled in place; pass a tensor of its own (.clone())"
                )
    return read, read.tensors, read.entries


@functools.cache
def backend(of_parameters: bool, foreach: bool | None) -> engine.Backend:
    """Tensors as the engine reads them (parameters' .grad, or the tensors themselves)."""
    read = functools.partial(_read, of_parameters=of_parameters, foreach=foreach)
    return engine.Backend(read, _partials)


def probed_backend(foreach: bool | None, probe: torch.Tensor) -> engine.Backend:
    """:func:`backend` for parameters, with ``probe`` counted as one more tensor of this rank's
    own (a GradScaler's found_inf as inf or 0: see ``gclip.torch``)."""
    read = functools.partial(_read, of_parameters=True, foreach=foreach, probe=probe)
    return engine.Backend(read, _partials)


def gradients(
    items: Any,
    replicated: Any,
    *,
    of_parameters: bool,
    reduce: bool = True,
    probe: torch.Tensor | None = None,
    foreach: bool | None = None,
) -> Gradients:
    """The gradients to clip: parameters' .grad (None skipped) or the tensors themselves.

    The same gradient given twice counts once and is scaled once; two that
    overlap in memory in part are an error. ``reduce``: Partial gradients are reduced (a
    collective) to be counted; False: read alone, to be scaled (no communication).
    ``probe``: one more plain tensor, this rank's own, counted after the others. ``foreach``:
    how the scale is applied (``Gradients.foreach``).
    """
    name = "parameters" if of_parameters else "tensors"
    items = _as_list(items, name)
    alone = replicated is not None and not isinstance(replicated, (list, tuple))
    if alone:  # one entry alone (True, False, a group, a name): for every plain tensor
        replicated = [replicated] * len(items)
    if replicated is not None and len(replicated) != len(items):
        raise GclipValueError(f"replicated has {len(replicated)} entries for {len(items)} {name}")
    placed: dict[tuple[int, str], Any] = {}  # a DTensor's one Placed entry, however often it is given
    picked: list[tuple[str, torch.Tensor, Any]] = []
    partial: _Partials | None = None  # made at the first DTensor
    for i, item in enumerate(items):
        if of_parameters:
            if not isinstance(item, torch.Tensor):
                _checked(item, f"parameters[{i}]")  # raises: says what it is
            if item.grad is None:
                continue  # as torch: a parameter without a gradient is skipped
            where, g = f"parameters[{i}].grad", item.grad
        else:
            if item is None:
                raise GclipTypeError(f"tensors[{i}] is None: pass only the gradients that exist")
            where, g = f"tensors[{i}]", item
        entry = None if replicated is None else replicated[i]
        if type(g) is torch.Tensor and g.dtype in _DENSE_DTYPES and g.layout is _STRIDED and not g.is_meta:
            picked.append((where, g, entry))  # a plain dense float tensor: what _checked passes
            continue
        g = _checked(g, where)
        if _dtensor.is_dtensor(g):  # its placements say what it holds; an entry only adds copies
            if alone and not _dtensor._is_names(entry):
                entry = None
            if entry is True or (entry is not None and entry is not False and not _dtensor._is_names(entry)):
                raise GclipTypeError(
                    f"{where} is a DTensor: its placements say what it holds; replicated= takes, for a "
                    f"DTensor, only mesh dimension names of copies outside its mesh, got {entry!r}"
                )
            key = (id(g), repr(entry))
            if key not in placed:
                partial = partial or _Partials()
                placements = partial.reduced_placements(g)
                signature = (
                    tuple(g.shape),
                    str(g.dtype),
                    _dtensor.describe(placements),
                    tuple(g.device_mesh.shape),
                )
                placed[key] = _dtensor.Placed(g.device_mesh, placements, entry, where, signature)
            g, entry = _dtensor.local(g), placed[key]
        picked.append((where, g, entry))
    if probe is not None:
        picked.append(("the GradScaler's found_inf", probe, False))
    # one gradient: nothing to repeat or overlap, and its multiply needs no table (_partials)
    table = _plain_table(picked) if len(picked) > 1 else None
    kept = picked if table is not None or len(picked) < 2 else _distinct(picked)
    tensors = _partials.Tensors([g for _, g, _ in kept])
    tensors.table = table if table is not None and table.compiled else None  # (0: not all of a kind)
    # Partial sums: their reduced copies are what is counted
    counted = partial.reduce(tensors) if reduce and partial is not None else tensors
    return Gradients(
        counted,
        [e for _, _, e in kept],
        [w for w, _, _ in kept],
        foreach,
        targets=None if counted is tensors else tensors,
    )


class _Partials:
    """The call's ``Partial`` DTensor gradients (tensor parallel without FSDP: the norms' weights
    under SequenceParallel), reduced as torch's own clip reduces them, but one all-reduce per
    (mesh, Partial dimension, dtype, device) group, not per tensor; none when there are none.

    The reduced copy is what is counted (as ``Replicate`` on those dimensions: once); the
    gradient itself stays Partial and is scaled in place (a sum scaled is its terms scaled).
    The all-reduce runs over the tensor's own mesh dimension while the arguments are read, before
    gclip's header, as torch's clip reduces them: a rank whose list lacks a Partial gradient its
    mesh peers hold leaves them waiting there, as torch's would."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, tuple[int, ...], str]] = {}  # id(local) -> (mesh, dims, op)

    def reduced_placements(self, g: Any) -> tuple[Any, ...]:
        """g's placements with each Partial sum or average read as Replicate (once reduced)."""
        from torch.distributed.tensor import Replicate

        dims = tuple(d for d, p in enumerate(g.placements) if p.is_partial())
        if not dims:
            return tuple(g.placements)
        ops = {str(getattr(g.placements[d], "reduce_op", "sum")) for d in dims}
        if len(ops) != 1 or not ops <= {"sum", "avg"}:
            return tuple(g.placements)  # refused by the counting, on every rank together
        self.seen[id(_dtensor.local(g))] = (g.device_mesh, dims, ops.pop())
        return tuple(Replicate() if d in dims else p for d, p in enumerate(g.placements))

    def reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.seen:
            return tensors
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, t in enumerate(tensors):
            how = self.seen.get(id(t))
            if how is not None:
                mesh, dims, op = how
                groups.setdefault((id(mesh), dims, op, t.dtype, t.device), []).append(i)
        out = list(tensors)
        for (_, dims, op, _, _), members in groups.items():
            mesh = self.seen[id(tensors[members[0]])][0]
            flat = torch.cat([tensors[i].reshape(-1) for i in members])  # a copy: the grads stay Partial
            for d in dims:
                dist.all_reduce(flat, group=mesh.get_group(d))
                if op == "avg":
                    flat.div_(mesh.size(d))
            start = 0
            for i in members:
                n = tensors[i].numel()
                out[i] = flat[start : start + n].view(tensors[i].shape)
                start += n
        return out


def _distinct(picked: list[tuple[str, torch.Tensor, Any]]) -> list[tuple[str, torch.Tensor, Any]]:
    """Drop repeats of one gradient (the same tensor, or the same view of one memory);
    refuse gradients that share memory in part. Only tensors of one storage are compared."""
    by_memory: dict[tuple[Any, int], list[int]] = {}
    first: dict[Any, int] = {}  # a gradient's identity -> its first position
    repeat: dict[int, int] = {}
    compiling = torch.compiler.is_compiling()
    for i, (_, g, _) in enumerate(picked):
        if id(g) in first:
            repeat[i] = first[id(g)]
            continue
        first[id(g)] = i
        if g.numel() and not compiling and _has_memory(g):
            by_memory.setdefault((g.device, g.untyped_storage().data_ptr()), []).append(i)
    for members in by_memory.values():
        if len(members) > 1:
            repeat.update(_same_memory(picked, members))
    for i, j in repeat.items():
        (where_j, _, entry_j), (where_i, _, entry_i) = picked[j], picked[i]
        if not reader._same_entry(entry_j, entry_i):
            raise GclipValueError(
                f"{where_j} and {where_i} are the same gradient but replicated gives them different "
                f"entries ({entry_j!r}, {entry_i!r})"
            )
    return [item for i, item in enumerate(picked) if i not in repeat]


def _plain_table(picked: list[tuple[str, torch.Tensor, Any]]) -> Any:
    """Where the gradients are plainly distinct (plain CPU tensors, each contiguous, no two the
    same object, no two byte ranges meeting: one sort for the whole list), their table for the
    compiled kernels (``_partials.Tensors``), read from each tensor once; an empty Table
    where they are distinct but not all contiguous float32 or float64 (or one requires grad:
    its numpy view is refused, as before). None: the item-by-item reading (``_distinct``) says
    which gradients repeat and which overlap."""
    if torch.compiler.is_compiling():
        return None
    ptr, size, kind, nbytes = [], [], [], []
    for _, g, _ in picked:
        if type(g) is not torch.Tensor or not g.is_cpu or not g.is_contiguous():
            return None
        ptr.append(g.data_ptr())
        size.append(g.numel())
        kind.append(0 if g.requires_grad else _partials.TABLE_KINDS.get(g.dtype, 0))
        nbytes.append(g.element_size())
    lo, n = np.array(ptr, np.int64), np.array(size, np.int64)
    if len(picked) > 1:
        if len({id(g) for _, g, _ in picked}) < len(picked):
            return None
        hi = lo + n * np.array(nbytes, np.int64)
        full = n > 0
        order = np.argsort(lo[full], kind="stable")
        start, end = lo[full][order], hi[full][order]
        if np.any(start[1:] < np.maximum.accumulate(end)[:-1]):
            return None
    if not all(kind):
        return _NO_TABLE
    return _kernels.Table(lo, n, np.array(kind, np.int64), len(picked))


_NO_TABLE = _kernels.Table(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0)


def _has_memory(g: torch.Tensor) -> bool:
    """Can its memory be compared? Not for tensors that hold none (FakeTensorMode): those are
    told apart by identity only (nor while compiling: the caller asks that once)."""
    if type(g) is torch.Tensor or type(g) is torch.nn.Parameter:
        return True  # a plain tensor: the common case, at once
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(g)


def _same_memory(picked: list[tuple[str, torch.Tensor, Any]], members: list[int]) -> dict[int, int]:
    """Among gradients of one storage: the same view -> its first; spans that overlap otherwise: an error."""
    tensors = [g for _, g, _ in picked]

    def same_view(i: int, j: int) -> bool:
        a, b = tensors[i], tensors[j]
        return bool(
            a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
        )

    return reader.same_memory(
        members,
        span=lambda i: _span(tensors[i]),
        same_view=same_view,
        shares=lambda i, j: True,  # spans that meet: torch cannot tell an interleaving, so refused
        overlap=lambda lo, hi: GclipValueError(
            f"{picked[lo][0]} and {picked[hi][0]} overlap in memory without being the same tensor: "
            "each value must be given once"
        ),
    )


def _span(g: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] of a non-empty tensor's elements."""
    lo = hi = g.data_ptr()
    for n, stride in zip(g.shape, g.stride()):
        step = (n - 1) * stride * g.element_size()
        lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
    return lo, hi + g.element_size()
