"""Local reductions of torch tensors, on the device where each tensor lives.

The engine's backend for ``gclip.torch`` (see ``engine.program``): the
same functions as ``partials`` (count, power_sum, max_abs, scaled_power_sum,
binned_digits, multiply_by), computed with torch ops. Every sum is
accumulated in float64; a float16, bfloat16 or float32 tensor is converted
chunk by chunk into one reused float64 buffer per device, so no full-size
float32 or float64 copy is ever made. Per-chunk partials stay on the device and
are added there: each function synchronises once per device, never once per
tensor or chunk; only the few numbers of the result cross to the host.

The reproducible mode gives the very integer digit counts of
``partials.BinnedPowerSum`` (in the bins the result keeps), so a norm is
bitwise the same from numpy arrays or torch tensors, on any layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import _kernels, partials
from ..partials import BinnedPowerSum

__all__ = [
    "CPU_CHUNK",
    "DEVICE_CHUNK",
    "TABLE_KINDS",
    "Tensors",
    "binned_digits",
    "chunk_size",
    "chunks",
    "count",
    "digits_with_torch_ops",
    "max_abs",
    "multiply_by",
    "power_sum",
    "scaled_power_sum",
]

CPU_CHUNK = 1 << 16  # elements converted at a time on the CPU: 512 KiB of float64, stays in L2
DEVICE_CHUNK = 1 << 20  # on an accelerator: 8 MiB of float64, few enough kernel launches
_NUMPY_VIEWABLE = (torch.float16, torch.float32, torch.float64)  # t.numpy() is a view, no copy


def chunk_size(device: torch.device) -> int:
    """Elements per working chunk on ``device`` (a multiple of BinnedPowerSum.BLOCK)."""
    return CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK


# ---------------------------------------------------------------------------
# walking tensors in bounded chunks


def chunks(t: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """1-D views of at most ``size`` elements that hold each element of ``t`` once.

    Views, never copies (a transposed or channels-last tensor is walked in its
    memory order).
    """
    for flat in _flat_views(t):
        for start in range(0, flat.numel(), size):
            yield flat[start : start + size]


def _flat_views(t: torch.Tensor) -> Iterator[torch.Tensor]:
    if t.numel() == 0:
        return
    if t.dim() <= 1:
        yield t.reshape(1) if t.dim() == 0 else t  # a 0-d tensor's view; a strided 1-D as it is
        return
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    dense = t.permute(order)
    if dense.is_contiguous():
        yield dense.view(-1)
        return
    for sub in dense.unbind(0):  # gaps between rows: walk the outer axis until the rest is dense
        yield from _flat_views(sub)


def _float64_chunks(arrays: Sequence[torch.Tensor]) -> Iterator[tuple[torch.device, torch.Tensor]]:
    """(device, chunk in float64) over every tensor: float64 chunks are views, the
    others are converted into one reused buffer per device (the caller uses a chunk
    before asking for the next; on an accelerator the stream keeps that order)."""
    buffers: dict[torch.device, torch.Tensor] = {}
    for t in arrays:
        size = chunk_size(t.device)
        for c in chunks(t, size):
            if c.dtype == torch.float64:
                yield t.device, c
                continue
            buf = buffers.get(t.device)
            if buf is None:
                buf = buffers[t.device] = torch.empty(size, dtype=torch.float64, device=t.device)
            out = buf[: c.numel()]
            out.copy_(c)  # converted on the fly, exactly (every float16/bfloat16/float32 is a float64)
            yield t.device, out


def _sum_on_devices(arrays: Sequence[torch.Tensor], per_chunk: Callable[[torch.Tensor], Any]) -> float:
    """sum of per_chunk(float64 chunk) over all chunks: added on each device, one sync per device."""
    parts: dict[torch.device, list[torch.Tensor]] = {}
    for device, c in _float64_chunks(arrays):
        parts.setdefault(device, []).append(per_chunk(c))
    return sum((float(torch.stack(ps).sum()) for ps in parts.values()), 0.0)


def _per_device(values: Sequence[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for v in values:
        out.setdefault(v.device, []).append(v)
    return out


# ---------------------------------------------------------------------------
# the engine's backend


def _by_path(arrays: Sequence[torch.Tensor]) -> tuple[list[Any], list[Any], list[Any]]:
    """(CPU tensors numpy views without a copy, CPU bfloat16, the rest): the first go to
    numpy's kernels as they are, bfloat16 to them through its bits or a float32 widening."""
    host: list[torch.Tensor] = []
    bf16: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for t in arrays:
        if t.device.type != "cpu":
            rest.append(t)
        elif t.dtype in _NUMPY_VIEWABLE:
            host.append(t)
        elif t.dtype == torch.bfloat16:
            bf16.append(t)
        else:
            rest.append(t)
    return host, bf16, rest


TABLE_KINDS = {torch.float32: _kernels.F32, torch.float64: _kernels.F64}


class Tensors(list):  # type: ignore[type-arg]
    """The distinct gradients of one call, with their table for the compiled kernels where the
    reading made one (``_gradients``: plain contiguous float32/float64 CPU tensors, apart
    in memory), read from the tensors on this call: nothing is kept between calls."""

    table: Any = None


def _table(arrays: Sequence[torch.Tensor]) -> Any:
    """The table of every tensor of ``arrays`` (None where it has none)."""
    return arrays.table if type(arrays) is Tensors else None


def count(arrays: Sequence[torch.Tensor]) -> int:
    """Elements in the tensors (no device work)."""
    return sum(t.numel() for t in arrays)


def power_sum(arrays: Sequence[torch.Tensor], p: float) -> tuple[float, bool]:
    """sum |x|**p accumulated in float64, and whether the engine must rescue it
    (overflow, or underflow of tiny values), as ``partials.power_sum``.

    CPU tensors that numpy can view without a copy (float16, float32, float64)
    are summed by ``partials`` itself: its compiled one-pass kernels square
    float32 in float64 at memory speed, where converting chunks here would
    pass over the data twice; contiguous CPU bfloat16 is squared from its bits
    by a compiled kernel (p = 2). The rest (other devices, other bfloat16) stays here.
    """
    if len(arrays) == 1 and arrays[0].is_cpu and arrays[0].dtype in _NUMPY_VIEWABLE:
        return partials.power_sum([arrays[0].numpy()], p)  # one numpy view: numpy's sum, as it is
    table, kernels = _table(arrays), _kernels.get()
    if table is not None and kernels is not None and p == 2.0 and len(arrays) >= _kernels.MANY:
        # many: one compiled call, as numpy's path takes their views (the same table: the same sum)
        total = kernels.sumsq(table)
        return total, partials.needs_rescue(
            total,
            lambda: _any(arrays, lambda c: c.any()),
            lambda: _any(arrays, lambda c: ~torch.isfinite(c).all()),
        )
    host, bf16, rest = _by_path(arrays)
    if not bf16 and not rest:  # all numpy views (the CPU's usual case): numpy's sum, as it is
        return partials.power_sum([t.numpy() for t in host], p)
    total = partials.power_sum([t.numpy() for t in host], p)[0] if host else 0.0
    kernels = _kernels.get() if p == 2.0 and bf16 else None
    for t in bf16:
        if kernels is not None and t.is_contiguous():  # its bits, squared in one compiled pass
            total += float(kernels.sumsq_bf16(t.view(torch.int16).numpy().view(np.uint16).reshape(-1)))
        else:
            rest.append(t)
    if not rest:
        pass  # every tensor summed above
    elif p == 2.0:
        total += _sum_on_devices(rest, lambda c: torch.dot(c, c))
    elif p == 1.0:
        total += _sum_on_devices(rest, lambda c: c.abs().sum())
    else:
        total += _sum_on_devices(rest, lambda c: c.abs().pow_(p).sum())
    return total, partials.needs_rescue(
        total,
        lambda: _any(arrays, lambda c: c.any()),
        lambda: _any(arrays, lambda c: ~torch.isfinite(c).all()),
    )


def _any(arrays: Sequence[torch.Tensor], flag: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Does ``flag`` hold for some chunk? (rare paths only; chunked: no full-size temporary)"""
    parts = _per_device([flag(c) for t in arrays for c in chunks(t, chunk_size(t.device))])
    return any(bool(torch.stack(ps).any()) for ps in parts.values())


def max_abs(arrays: Sequence[torch.Tensor]) -> tuple[float, bool]:
    """(max |x|, any NaN): min and max in one read, no temporary; one sync per device."""
    tops = []
    for t in arrays:
        if t.numel():
            lo, hi = torch.aminmax(t)
            tops.append(torch.maximum(hi, -lo).to(torch.float64))  # NaN propagates
    best, nan = 0.0, False
    for ps in _per_device(tops).values():
        m = torch.stack(ps).amax()
        got_top, got_nan = torch.stack([torch.where(m.isnan(), 0.0, m), m.isnan().double()]).tolist()
        best, nan = max(best, got_top), nan or bool(got_nan)
    return (0.0 if nan else best), nan


def scaled_power_sum(arrays: Sequence[torch.Tensor], p: float, top: float) -> float:
    """sum (|x| / top)**p for top = max|x| > 0: nothing overflows (the engine's rescue)."""
    return _sum_on_devices(arrays, lambda c: c.abs().div_(top).pow_(p).sum())


def multiply_by(arrays: Sequence[torch.Tensor], factor: float, foreach: bool | None) -> None:
    """Multiply each tensor in place, in its own dtype, by ``factor`` rounded toward zero.

    float64: the product, rounded once. float32, float16 and bfloat16: torch
    computes in float32 with the factor rounded toward zero to float32 (never up,
    so rounding the factor cannot lift the clipped norm above the limit), then
    rounds each product to the tensor's dtype. The factor travels as a 0-d
    tensor on the device, as torch's clip does: no sync, and foreach kernels keep
    it in float32 (given as a Python float, they round it to bfloat16 on the CPU).
    ``foreach``: False scales tensor by tensor, else with torch's foreach kernels.
    """
    if factor == 1.0 or not arrays:  # exactly 1: nothing to do, not even a read
        return
    if len(arrays) == 1 and arrays[0].is_cpu and arrays[0].dtype in _ONE_BY_ONE:
        # one CPU float32 or float64 tensor: the same product as below, by one 0-d tensor of its
        # dtype, made from numpy's (a factor as a Python number costs torch's mul_ twice as much)
        g = arrays[0]
        f = np.float64(factor) if g.dtype == torch.float64 else partials.float32_toward_zero(factor)
        g.mul_(torch.from_numpy(np.array(f)))
        return
    table, kernels = _table(arrays), _kernels.get()
    if table is not None and kernels is not None and foreach is not False and _in_float32(factor):
        # the compiled multiply over the table: the same products (float32 by the float32
        # factor, float64 by the factor), one call; autograd told, as torch's own mul_ does
        kernels.multiply_table(table, factor, partials.float32_toward_zero(factor))
        torch._C._increment_version(arrays)
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in arrays:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in groups.items():
        if dtype == torch.float64:
            f = torch.full((), factor, dtype=torch.float64, device=device)
        else:
            f32 = float(partials.float32_toward_zero(factor))
            f = torch.full((), f32, dtype=torch.float32, device=device)
        if foreach is False:
            for g in group:
                g.mul_(f)
        else:
            torch._foreach_mul_(group, f)


_ONE_BY_ONE = (torch.float32, torch.float64)


def _in_float32(factor: float) -> bool:
    """Is the float32 factor a normal float (or 0)? Elsewhere torch's multiply keeps the say."""
    return factor == 0.0 or _FLOAT32_TINY <= factor <= _FLOAT32_MAX


_FLOAT32_TINY, _FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------
# the reproducible mode: BinnedPowerSum's digits, computed on the device


def binned_digits(binned: BinnedPowerSum, arrays: Sequence[torch.Tensor]) -> np.ndarray:
    """The reproducible mode's local part, laid out as ``binned.local(arrays)``.

    CPU tensors that numpy can view without a copy go to ``binned.local`` itself
    (its compiled digit kernel: about 30 times faster than torch ops on the CPU),
    CPU bfloat16 too, widened to float32 a chunk at a time; the rest (other
    devices) to :func:`digits_with_torch_ops`. The two
    parts add up as two ranks' parts do: digit counts are integers.
    """
    host, bf16, rest = _by_path(arrays)
    if not host and not bf16:
        return digits_with_torch_ops(binned, arrays)
    out = binned.local([t.numpy() for t in host])
    if bf16:  # widened to float32 (exactly) a chunk at a time, into one reused buffer
        out += binned.local_stream(_float32_chunks(bf16), count(bf16))
    if rest:
        out += digits_with_torch_ops(binned, rest)  # inf + NaN is NaN, as across ranks
    return out


def _float32_chunks(arrays: Sequence[torch.Tensor]) -> Iterator[np.ndarray]:
    """Every element of the (CPU) tensors as float32, a chunk at a time in one reused buffer."""
    buf = torch.empty(CPU_CHUNK, dtype=torch.float32)
    for t in arrays:
        for c in chunks(t, CPU_CHUNK):
            out = buf[: c.numel()]
            out.copy_(c)
            yield out.numpy()


def digits_with_torch_ops(binned: BinnedPowerSum, arrays: Sequence[torch.Tensor]) -> np.ndarray:
    """:func:`binned_digits` computed with torch ops, on the device where each tensor lives.

    BinnedPowerSum cuts each value into digits on a fixed grid of bins, starting
    at the top bin of a block's largest value. A value's digit in a bin does not
    depend on where the folds started (above its own top bin the digits are 0),
    so any grouping gives the same digits in the bins the result keeps. Here the
    groups are rows of BLOCK values: every row gets its own top bin, all rows of
    a chunk are folded by the same few torch ops, and the digit counts add up on
    the device, as integers. Only the counts come back to the host.
    """
    per_device: dict[torch.device, _Bins] = {}
    for t in arrays:
        bins = per_device.get(t.device)
        if bins is None:
            bins = per_device[t.device] = _Bins(binned, t.device)
        for c in chunks(t, chunk_size(t.device)):
            bins.deposit(c)
    counts = [0] * binned.nbins
    special = 0.0
    for bins in per_device.values():
        row_counts, nan, inf = bins.result()
        counts = [a + b for a, b in zip(counts, row_counts)]
        special = math.nan if nan or math.isnan(special) else (math.inf if inf else special)
    return binned.pack(enumerate(counts), count(arrays), special)


_DIGIT_MASK = (1 << 24) - 1  # a row's digit sum (|s| < 2**53) is carried as hi * 2**24 + lo


class _Bins:
    """One device's digit counts per bin, as int64 pairs that cannot overflow."""

    def __init__(self, binned: BinnedPowerSum, device: torch.device) -> None:
        self.binned = binned
        self.lo = torch.zeros(binned.nbins, dtype=torch.int64, device=device)
        self.hi = torch.zeros(binned.nbins, dtype=torch.int64, device=device)
        self.flags = torch.zeros(2, dtype=torch.int64, device=device)  # rows holding NaN, inf
        self.rows = torch.zeros(chunk_size(device), dtype=torch.float64, device=device)

    def deposit(self, c: torch.Tensor) -> None:
        b = self.binned
        p, W, block = b.p, b.W, b.BLOCK
        n = c.numel()
        padded = -(-n // block) * block
        v = self.rows[:padded]
        v[:n].copy_(c)  # converted to float64 on the way, exactly
        v[n:].zero_()
        v = v.view(-1, block).abs_()  # rows of BLOCK values: each row's digit sums stay below 2**53
        m = v.amax(dim=1)  # NaN propagates
        self.flags += torch.stack([m.isnan().sum(), m.isinf().sum()])
        live = torch.isfinite(m) & (m > 0)  # other rows give no digits: zeros, or inf/NaN (flagged)
        v.masked_fill_(~live.unsqueeze(1), 0.0)
        # the row's top bin t, exactly as BinnedPowerSum._deposit computes it from the block's max
        fm, em = torch.frexp(m)
        gm, ge = torch.frexp(fm * fm if p == 2 else fm)
        ceil_log2 = ge.long() + p * em.long() - (gm == 0.5).long()
        top = -torch.div(-(ceil_log2 - W + 1), W, rounding_mode="floor")
        top = torch.where(live, top, b._BIN_LO + b.K - 1)  # any bin in range: those rows are 0
        k = torch.div(W * top, p, rounding_mode="floor")  # |x| * 2**-k puts bin t's unit at 1
        k = torch.where(live, k, 0)
        # 2**-k as two factors that are normal floats (|k| < 2046): a normal result is exact, and
        # a result that is not is far below the last bin kept, so it gives no digit either way
        k1 = torch.div(k, 2, rounding_mode="floor")
        v.mul_(_pow2(-k1).unsqueeze(1)).mul_(_pow2(k1 - k).unsqueeze(1))
        if p == 2:
            v.mul_(v)
        for i in range(b.K):
            q = torch.round(v)  # round half to even: the extractor trick's rounding
            sums = q.sum(dim=1).long()  # whole numbers below 2**53: exact in any order
            where = top - i - b._BIN_LO
            self.lo.index_add_(0, where, sums & _DIGIT_MASK)
            self.hi.index_add_(0, where, sums >> 24)
            if i + 1 < b.K:
                v.sub_(q).mul_(2.0**W)  # the remainder, scaled so the next bin's unit is 1 (exact)

    def result(self) -> tuple[list[int], bool, bool]:
        """(the counts per bin, any NaN, any inf), read from the device at once."""
        n = self.binned.nbins
        got = torch.cat([self.lo, self.hi, self.flags]).tolist()
        counts = [h * (1 << 24) + low for low, h in zip(got[:n], got[n : 2 * n])]
        return counts, got[2 * n] > 0, got[2 * n + 1] > 0


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e, exactly, for integer e in [-1022, 1023], built from its bits."""
    return ((e + 1023) << 52).view(torch.float64)
