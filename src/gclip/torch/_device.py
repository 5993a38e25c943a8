"""gclip.torch's sync-free path: the norm, its agreement and the scale, all on the device.

The checks are the engine's (``engine.check``: arguments, layout, DTensor placements),
made on the host from metadata alone (shapes, dtypes, meshes: nothing is read from a
device). Then, with no value read on the host:

1. each (device, dtype) group's sum of |x|**p, accumulated in float64 by torch's foreach
   norm, one kernel per group, however many tensors it holds;
2. the header, a float64 tensor on the process group's device: this rank's error flag, the
   fingerprint of its arguments and their squares, its power sum, the layout's ring sums
   (``layout``, ``_dtensor``), as the engine's header (``engine.header``) is;
3. ONE all-reduce (SUM) of it (none on one rank);
4. the verdict and the scale as tensors: ``bad`` when a rank failed, the fingerprints differ
   or a ring sum is not 0; the norm (NaN where bad); the scale min(1, max_norm / norm),
   exactly 1 where bad or where the norm is not finite; rounded toward zero to float32
   (``torch.nextafter``) for float32/16 gradients;
5. ``torch._foreach_mul_`` by that scale, one kernel per (device, dtype) group.

The agreement: every rank holds the same ``bad``, so a failure anywhere leaves every rank's
gradients as they were (scale 1) and returns a NaN norm. It is raised on every rank, the
same error (``engine.agreed_error``; the reports gathered then, a collective on the error
path only): at once when the header lives on the CPU (reading a CPU tensor costs no sync);
else the flag is copied to pinned host memory without blocking, and read at the next call
of gclip.torch (the copy is long done by then) or by :func:`check`. Under
``torch.compile`` a failure is the NaN norm and the untouched gradients, not raised.

Used for finite p, ``reproducible=False`` and ``error_if_nonfinite=False`` (which reads
the norm, as torch's does): tensors on an accelerator, and under ``torch.compile``. CPU
tensors keep the host path: its compiled kernels (numba) square float32 in float64 at memory
speed, and reading a CPU header costs no sync. The norm of float64 values beyond 1e154
overflows here (inf: the gradients untouched); the host path rescues it (``engine.rescued``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import engine, layout
from ..errors import GclipValueError
from . import _compile

__all__ = ["FORCE", "check", "clip", "eligible"]

FORCE = False  # tests: take this path for CPU tensors too (as it is taken for CUDA ones)

_ERROR, _H1, _H1SQ, _H2, _H2SQ, _POWER, _RING1, _RING2 = range(8)


class _Pending(NamedTuple):
    """A verdict not yet read: the flag on the host (pinned), when it is there, what to report."""

    flag: torch.Tensor
    ready: Any  # a CUDA event, or None (already on the host)
    world: Any
    reports: tuple[Any, str, Any]  # this rank's error report, its arguments, its layout summary
    explain: Any


_PENDING: list[_Pending] = []


def eligible(world: Any, items: Sequence[Any], norm_type: Any, reproducible: bool, nonfinite: bool) -> bool:
    """Does a call on ``items`` (tensors or parameters) take this path? (Only metadata is read.)"""
    if reproducible or nonfinite or (world.size > 1 and not hasattr(world, "process_group")):
        return False
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        return False  # 'inf' and bad values: the host path says what is wrong
    if not (math.isfinite(p) and p > 0):
        return False
    if FORCE or torch.compiler.is_compiling():
        return True
    first = items[0] if len(items) else None  # one look, not one per tensor: lists share a device
    return isinstance(first, torch.Tensor) and first.device.type not in ("cpu", "meta")


def check() -> None:
    """Raise, on every rank together, a failure the device path has not raised yet."""
    if not _PENDING:
        return
    pending = _PENDING.pop()
    if pending.ready is not None:
        pending.ready.synchronize()  # done long ago in practice: the copy was queued last step
    if pending.flag.item():
        _raise_agreed(pending.world, pending.reports, pending.explain)


def clip(
    world: Any,
    items: Any,
    max_norm: Any,
    backend: engine.Backend,
    *,
    replicated: Any,
    counting: Any,
    inplace: bool,
    norm_type: Any = 2.0,
) -> torch.Tensor:
    """One call on the device: the global norm as a float64 0-d tensor, the gradients scaled."""
    if not torch.compiler.is_compiling():
        check()  # a failure of the last call is raised here, on every rank
    options = {"rank": world.rank, "size": world.size, "replicated": replicated, "counting": counting}
    if torch.compiler.is_compiling():
        checked = _traced_check(items, max_norm, backend, norm_type, inplace, **options)
    else:
        checked = engine.check(items, max_norm, backend, norm_type=norm_type, inplace=inplace, **options)
    arrays = list(checked.arrays)
    owned = checked.counting.owned
    counted = arrays if owned is None else [a for a, own in zip(arrays, owned) if own]
    device = _header_device(world, arrays)
    p = checked.spec.norm_type
    power = torch.zeros((), dtype=torch.float64, device=device)
    for group in _by_device_and_dtype(counted).values():
        norms = torch._foreach_norm(group, p, dtype=torch.float64)
        part = torch.stack(norms)
        power = power + (part * part if p == 2.0 else part.pow(p)).sum().to(device)
    h1, h2 = _fingerprint(checked.spec)
    ring = checked.counting.ring if checked.error is None else (0.0, 0.0)
    error = 1.0 if checked.error is not None else 0.0
    head, tail = _constants((error, h1, h1 * h1, h2, h2 * h2), (ring[0], ring[1]), device)
    header = torch.cat([head, power.reshape(1), tail])
    if world.size > 1:
        dist.all_reduce(header, group=world.process_group)
    size = float(world.size)
    mismatch = (header[_H1SQ] * size != header[_H1] ** 2) | (header[_H2SQ] * size != header[_H2] ** 2)
    bad = (header[_ERROR] > 0) | mismatch | (header[_RING1] != 0) | (header[_RING2] != 0)
    total = header[_POWER]
    norm = torch.sqrt(total) if p == 2.0 else total ** (1.0 / p)
    norm = torch.where(bad, torch.nan, norm)
    if max_norm is not engine.NO_LIMIT and checked.limit is not None:
        scale = torch.clamp(checked.limit / norm, max=1.0)
        scale = torch.where(bad | ~torch.isfinite(norm), 1.0, scale)
        targets = checked.grads.scaled_tensors if checked.grads is not None else []
        for (dev, dtype), group in _by_device_and_dtype(targets).items():
            torch._foreach_mul_(group, _factor(scale.to(dev), dtype))
    _defer(world, bad, checked, device)
    out_device = arrays[0].device if arrays else device
    return norm.to(out_device)


def _fingerprint(spec: Any) -> tuple[float, float]:
    """The arguments' fingerprint, ``engine.Spec.fingerprint`` (a constant of a compiled graph)."""
    if not torch.compiler.is_compiling():
        return tuple(spec.fingerprint)
    return _crc_halves(spec.describe())


@_compile.constant_result
def _crc_halves(description: str) -> tuple[float, float]:
    """``engine.Spec.fingerprint`` from its description, computed once at trace time (zlib
    cannot be traced); tests/test_torch_device.py checks the two agree."""
    crc = zlib.crc32(description.encode())
    return float(crc & 0xFFFF) + 1.0, float(crc >> 16) + 1.0


class _Spec(NamedTuple):
    """The checked settings of a compiled call (``engine.Spec``'s fields that this path reads)."""

    norm_type: float
    text: str  # ``engine.Spec.describe()``

    def describe(self) -> str:
        return self.text


@_compile.constant_result
def _settings(norm_type: Any, max_norm: Any) -> tuple[bool, float, float, str]:
    """(refused?, p, limit (NaN: none), the description): ``engine.check``'s settings, checked
    once at trace time (its cached Spec cannot be traced: a lock guards its fingerprint)."""
    got = engine.check([], max_norm, norm_type=norm_type, rank=0, size=1)
    limit = math.nan if got.limit is None else float(got.limit)
    return got.error is not None, float(got.spec.norm_type), limit, got.spec.describe()


def _traced_check(
    items: Any, max_norm: Any, backend: engine.Backend, norm_type: Any, inplace: bool, **options: Any
) -> engine.Arguments:
    """``engine.check`` as torch.compile traces it: the settings are constants of the graph (a
    refused setting is the header's error flag); an argument refused while reading raises at
    trace time, on the rank that traces it."""
    refused, p, limit, text = _settings(norm_type, max_norm)
    spec: Any = _Spec(p, text)
    error: BaseException | None = GclipValueError("the settings are refused") if refused else None
    grads: Any = None
    arrays: Any = ()
    counting = layout.EVERY_ARRAY
    if error is None:
        grads, arrays, entries = backend.read(items, options["replicated"], inplace)
        counting = options["counting"](grads, entries, arrays)
    lim = None if math.isnan(limit) else limit
    return engine.Arguments(grads, arrays, spec, lim, counting, error, options["size"], False, backend)


_CONSTANTS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(
    head: tuple[float, ...], tail: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The header's host-known slots on ``device``. A training loop passes the same arguments
    and layout every step: they are copied to the device once, then reused."""
    key = (head, tail, device)
    got = _CONSTANTS.get(key)
    if got is None or torch.compiler.is_compiling():
        got = (
            torch.tensor(head, dtype=torch.float64, device=device),
            torch.tensor(tail, dtype=torch.float64, device=device),
        )
        if not torch.compiler.is_compiling() and not _is_fake(got[0]):
            if len(_CONSTANTS) > 64:
                _CONSTANTS.clear()
            _CONSTANTS[key] = got
    return got


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (FakeTensorMode, tracing): it holds no values to read."""
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def _factor(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale for gradients of ``dtype``: float64 as it is; else float32 rounded toward
    zero (never up: the clipped norm cannot rise above the limit by the rounding)."""
    if dtype == torch.float64:
        return scale
    f32 = scale.to(torch.float32)
    return torch.where(f32.to(torch.float64) > scale, torch.nextafter(f32, torch.zeros_like(f32)), f32)


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple[Any, Any], list[torch.Tensor]]:
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _header_device(world: Any, arrays: Sequence[torch.Tensor]) -> torch.device:
    """Where the header lives: NCCL's current CUDA device, gloo's CPU; the first gradient's
    device on one rank or for other backends (one that takes both, "cpu:gloo,cuda:nccl")."""
    first = arrays[0].device if arrays else torch.device("cpu")
    if world.size > 1:
        backend = str(dist.get_backend(world.process_group))
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        if backend == "gloo":
            return torch.device("cpu")
    return first


def _defer(world: Any, bad: torch.Tensor, checked: Any, device: torch.device) -> None:
    """Keep the verdict to raise: read now where that costs no sync, else at the next call."""
    if torch.compiler.is_compiling():
        return  # the NaN norm and untouched gradients say it (see check)
    if _is_fake(bad):
        return  # no values anywhere (FakeTensorMode): nothing to read
    reports = (engine.error_report(checked.error), checked.spec.describe(), checked.counting.summary)
    explain = checked.counting.explain
    if device.type == "cpu":
        if bad.item():  # a CPU tensor: no device to wait for
            _raise_agreed(world, reports, explain)
        return
    flag = torch.empty((), dtype=torch.bool, pin_memory=torch.cuda.is_available())
    flag.copy_(bad, non_blocking=True)
    event = torch.cuda.Event() if device.type == "cuda" else None
    if event is not None:
        event.record()
    _PENDING[:] = [_Pending(flag, event, world, reports, explain)]


def _raise_agreed(world: Any, mine: tuple[Any, str, Any], explain: Any) -> None:
    """Every rank's reports gathered (the error path's own collective), one error raised."""
    every = _gather(world, mine)
    if any(err is not None for err, _, _ in every) or len({args for _, args, _ in every}) > 1:
        mismatch = all(err is None for err, _, _ in every)
        raise engine.agreed_error([(err, args) for err, args, _ in every], mismatch=mismatch)
    told = explain or (lambda _: "ranks disagree on which arrays they hold")
    raise GclipValueError(told([summary for _, _, summary in every]))


def _gather(world: Any, item: Any) -> list[Any]:
    if world.size == 1:
        return [item]
    if hasattr(world, "process_group"):
        items: list[Any] = [None] * world.size
        dist.all_gather_object(items, item, group=world.process_group)
        return items
    return list(world.comm.allgather(item))
