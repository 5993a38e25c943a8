"""Compiled kernels (numba): installed with gclip where numba has wheels.

numpy alone cannot square float32 values in float64 without a conversion pass,
nor fuse the reproducible mode's folds, and it pays one call per array; a
compiled loop does each at memory speed, over one array or a whole list in one
call. The kernels compute what the numpy code in ``partials`` computes:

- ``sumsq``: sum of float64(x)**2 (float64 accumulators, reordered freely: the
  order of a float sum is not part of the default mode's contract, its accuracy
  is: ~1e-13 at 1e7 elements); float32, float64, and float16 and bfloat16 given
  as their bits;
- ``digits``: the reproducible mode's digit counts: in the bins the result
  keeps, the very integers of the numpy folds (the same round-half-even
  extraction, over blocks of KERNEL_BLOCK_BYTES where numpy's hold BLOCK values:
  see ``_jit.digits`` for why the blocks may differ);
- ``multiply_table``: x *= s in place (float32 arrays by the float32 scale given).

A list of arrays goes in one call through a :class:`Table` of (address, size,
kind) that :func:`Kernels.table` reads from the arrays themselves on every call:
nothing is kept between calls, so a list that changes, or an array resized or
given another dtype, is simply read afresh.

``GCLIP_KERNELS=0`` keeps to numpy. numba caches the compiled code on disk
(``__pycache__``), so only a machine's first call compiles.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "BLOCK",
    "KERNEL_BLOCK_BYTES",
    "MANY",
    "MIN_SIZE",
    "Checked",
    "Kernels",
    "Table",
    "get",
    "kernel_block",
]

MIN_SIZE = 1 << 15  # elements: below this numpy's path is as fast and numba's import is not worth it
MANY = 16  # arrays: from this many on, one compiled call beats a numpy call per array
BLOCK = 512  # the reproducible mode's block: one top bin, digit sums exact (shared with partials)
# the compiled folds' block, in bytes: a value's digits in the bins the result keeps do not
# depend on its block, so any block gives the same result; the kernels add digits as int64 (a
# block's digit sum stays below 2**55), and a longer block pays its fixed costs (the top bin, the
# deposits, the accumulators' horizontal sums) over more values, as long as a block and the next
# one (whose max the fold loop reads) stay in L1 with room to spare: 2048 float32 or 1024 float64
# values. On a 32 KiB L1 (AMD Zen 4) blocks of 16 KiB were 21-30% slower at 1e7 values, 4-12 KiB
# within 3% of each other
KERNEL_BLOCK_BYTES = 8 << 10


def kernel_block(itemsize: int) -> int:
    """Values per block of the compiled folds, for an item size of 4 or 8 bytes."""
    return KERNEL_BLOCK_BYTES // itemsize


# numpy's array flags (ndarraytypes.h)
_ALIGNED, _WRITEABLE = 0x100, 0x400
F32, F64 = 1, 2  # Table.kind (as in _jit); 0: not for the kernels (numpy's path takes it)


class Table(NamedTuple):
    """Where a list's arrays live, read on this call: ``kind[i]`` is F32 or F64
    for a native, aligned, contiguous array the kernels take, 0 otherwise."""

    ptr: np.ndarray  # int64 addresses of the data
    size: np.ndarray  # int64 elements
    kind: np.ndarray  # int64
    compiled: int  # entries of a kind the kernels take

    def overlaps(self) -> bool:
        """Do any two compiled entries share memory (the same array twice included)? A yes or no
        for the whole list at once, vectorised: where it says yes, the checks read the list item
        by item and ``reader.same_memory`` says which arrays, and whether they are repeats."""
        on = self.kind != 0
        start = self.ptr[on]
        end = start + self.size[on] * np.where(self.kind[on] == F32, 4, 8)
        full = end > start
        start, end = start[full], end[full]
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
        return bool(np.any(start[1:] < np.maximum.accumulate(end)[:-1]))


class Checked(list[np.ndarray]):
    """A list of arrays with the table the argument checks read for it on this call.

    It is gclip's own list (the caller's arrays, or the distinct arrays read from
    them), so nothing changes it before the call ends; the sum, the scale and the
    digits reuse the table instead of reading the headers again."""

    table: Table
    writable: bool  # read with the writable flag required (good for an in-place scale)


class Kernels:
    """The compiled functions, and the array headers' layout they read."""

    def __init__(self, fns: Any, layout: np.ndarray | None) -> None:
        self.fns = fns
        self._layout = layout
        self.sumsq_f32 = fns.sumsq  # one 1-D float32 or float64 array
        self.sumsq_bf16 = fns.sumsq_bf16  # one 1-D uint16 array: bfloat16 bits (gclip.torch)
        self.sumsq_f16 = fns.sumsq_f16  # one 1-D contiguous uint16 array: float16 bits

    def table(self, arrays: Any, writable: bool = False) -> Table | None:
        """The arrays' table: read from the headers in one compiled call, or where they cannot
        be read here (or GCLIP_RAW_HEADERS=0), from each array's ``__array_interface__``."""
        if self._layout is None or os.environ.get("GCLIP_RAW_HEADERS", "1") == "0":
            return _interface_table(arrays, writable)
        n = len(arrays)
        try:
            ids = np.fromiter(map(id, arrays), np.int64, n)
        except OverflowError:  # pragma: no cover - an address above 2**63
            return None
        ptr, size, kind = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        lay = self._layout.copy()
        if writable:
            lay[-1] |= _WRITEABLE
        compiled = self.fns.inspect(ids, lay, ptr, size, kind)
        return Table(ptr, size, kind, int(compiled))

    def table_for(self, arrays: Any, writable: bool = False) -> Table | None:
        """The table the checks read for this very list on this call, else :meth:`table`."""
        if type(arrays) is Checked and (arrays.writable or not writable):
            return arrays.table
        return self.table(arrays, writable)

    def sumsq(self, t: Table) -> float:
        return float(self.fns.sumsq_table(t.ptr, t.size, t.kind))

    def multiply_table(self, t: Table, s64: float, s32: np.float32) -> None:
        self.fns.scale_table(t.ptr, t.size, t.kind, s64, s32)

    def digits(self, t: Table, p: int, counts: np.ndarray, width: int, bin_lo: int) -> float:
        """Adds the table's digit counts to ``counts`` (nbins x 2: low, high words); returns
        the inf/NaN seen (0.0 if none)."""
        return float(
            self.fns.digits_table(t.ptr, t.size, t.kind, p, counts, width, bin_lo, KERNEL_BLOCK_BYTES)
        )

    def digits_view(self, x: np.ndarray, p: int, counts: np.ndarray, width: int, bin_lo: int) -> float:
        """:meth:`digits` of one 1-D float32 or float64 view (any stride)."""
        return float(self.fns.digits(x, p, counts, width, bin_lo, kernel_block(x.itemsize)))


def _interface_table(arrays: Any, writable: bool) -> Table:
    """The table from Python's side (an array's ``__array_interface__``): what the header reads
    give, at a few microseconds per array."""
    n = len(arrays)
    ptr, size, kind = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    compiled = 0
    for i, a in enumerate(arrays):
        k = _expected_kind(a, writable)
        if k:
            ptr[i], size[i], kind[i] = a.__array_interface__["data"][0], a.size, k
            compiled += 1
    return Table(ptr, size, kind, compiled)


@functools.lru_cache(maxsize=1)
def get() -> Kernels | None:
    """The compiled kernels, or None (numba missing, or GCLIP_KERNELS=0)."""
    if os.environ.get("GCLIP_KERNELS", "1") == "0":
        return None
    return _build()


@functools.lru_cache(maxsize=1)  # once per process, whatever get's cache says
def _build() -> Kernels | None:
    try:
        from . import _jit as fns  # numba: imported here only, never at gclip's import
    except Exception:  # noqa: BLE001 - numba absent or unusable here: numpy does the work
        return None
    return Kernels(fns, _header_layout(fns.inspect))


# array headers: numpy's PyArrayObject fields, after the object header


def _header_layout(inspect: Any) -> np.ndarray | None:
    """The offsets of an array header's fields, checked on probe arrays whose
    answers Python knows; None (lists go through numpy) if any answer differs."""
    if sys.implementation.name != "cpython":
        return None
    head = object.__basicsize__  # PyObject_HEAD: ob_type is its last field
    layout = np.array(  # in _jit's slot order; numpy's PyArrayObject_fields after the head
        [
            head - 8,  # ob_type
            head,  # data
            head + 8,  # nd
            head + 16,  # dimensions (then strides, base)
            head + 48,  # flags
            head + 40,  # descr
            id(np.ndarray),
            id(np.dtype(np.float32)),
            id(np.dtype(np.float64)),
            _ALIGNED,  # flags every compiled entry needs (and one contiguity flag)
        ],
        dtype=np.int64,
    )
    base = np.zeros((6, 8), np.float32)
    probes: list[Any] = [
        base,
        np.zeros((3, 4), np.float64, order="F"),
        base[:, ::2],  # not contiguous
        np.zeros(5, ">f8"),  # not native
        np.zeros(0, np.float64),
        np.zeros(3, np.float16),
        np.zeros((), np.float64),
        base.T,
        np.frombuffer(bytes(16), np.float64),  # read-only
        [1.0],
    ]
    try:
        ids = np.fromiter(map(id, probes), np.int64, len(probes))
        for writable in (False, True):
            lay = layout.copy()
            lay[-1] |= _WRITEABLE if writable else 0
            n = len(probes)
            ptr, size, kind = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
            inspect(ids, lay, ptr, size, kind)
            for i, a in enumerate(probes):
                if kind[i] != _expected_kind(a, writable):
                    return None
                if kind[i] and (ptr[i] != a.__array_interface__["data"][0] or size[i] != a.size):
                    return None
    except Exception:  # noqa: BLE001 - any surprise: lists go through numpy
        return None
    return layout


def _expected_kind(a: Any, writable: bool) -> int:
    """F32 or F64 for a native, aligned, contiguous (and, if asked, writable) ndarray, else 0."""
    if type(a) is not np.ndarray or (a.dtype is not _F32 and a.dtype is not _F64):
        return 0
    flags = a.flags
    if not (flags.c_contiguous or flags.f_contiguous) or not flags.aligned:
        return 0
    if writable and not flags.writeable:
        return 0
    return F32 if a.dtype is _F32 else F64


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
