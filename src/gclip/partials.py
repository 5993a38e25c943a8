"""The sums of numpy arrays: what one rank computes from its own arrays, and the factor applied.

The engine's backend for numpy (``gclip.torch._partials`` has the same functions for
torch), with the compiled kernels of ``_kernels`` where the arrays are many or large.
No MPI here: real and simulated ranks run the same code. :func:`power_sum` reads once
(:func:`max_abs` and :func:`scaled_power_sum` are its rescue), :func:`multiply_by` applies
the factor, and :class:`BinnedPowerSum` is the reproducible mode's integer digit counts
(ReproBLAS-style), which ranks add exactly, so the norm has the same bits for any layout.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction

import numpy as np

from . import _kernels

__all__ = [
    "BLOCK",
    "CHUNK",
    "BinnedPowerSum",
    "binned_digits",
    "chunk_size",
    "count",
    "float32_toward_zero",
    "iter_chunks",
    "left_to_numpy",
    "max_abs",
    "multiply_by",
    "needs_rescue",
    "power_sum",
    "scaled_power_sum",
]

CHUNK = 1 << 16  # the largest working block: 512 KiB of float64, stays in L2
MIN_CHUNK = 1 << 12  # below this, numpy's per-call cost dominates
MEMORY_SHARE = 0.025  # working buffers stay below 2.5% of the shard (or MIN_CHUNK)
BLOCK = _kernels.BLOCK  # the reproducible mode's blocks: one top bin each, digit sums exact
POW2_LIMIT = 1000  # 2.0**k is a normal float64 for |k| < POW2_LIMIT (else ldexp does the scaling)


def chunk_size(arrays: Sequence[np.ndarray], buffers: int = 1) -> int:
    """Elements per working block for these arrays: ``buffers`` float64 blocks
    take at most MEMORY_SHARE of the arrays' own bytes, within [MIN_CHUNK, CHUNK],
    in whole BLOCKs."""
    n = int(MEMORY_SHARE * sum(a.nbytes for a in arrays) / (8 * buffers))
    n = max(MIN_CHUNK, min(CHUNK, n))
    return -(-n // BLOCK) * BLOCK


_FLOAT64 = np.dtype(np.float64)
_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)  # native byte order only: the kernels read its bits
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


# walking arrays in bounded chunks


def iter_chunks(a: np.ndarray, chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """Yield 1-D views of ``a`` (any shape and strides) of at most ``chunk`` elements: views,
    never copies, so writes through them reach ``a``."""
    if a.size == 0:
        return
    if a.ndim <= 1 or a.flags.c_contiguous or a.flags.f_contiguous:
        flat = a.reshape(1) if a.ndim == 0 else a if a.ndim == 1 else a.ravel(order="K")  # views
        for start in range(0, flat.size, chunk):
            yield flat[start : start + chunk]
        return
    for sub in a:  # non-contiguous: walk the first axis until the rest is simple
        yield from iter_chunks(sub, chunk)


class _Scratch:
    """One float64 working buffer per call, so no chunk allocates: made on first use and no
    larger than the largest chunk seen (a float64 array that BLAS reads directly never pays
    for it, and a small one pays only its own size)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self._buf = np.empty(0, dtype=np.float64)
        self._chunk = chunk

    def get(self, n: int) -> np.ndarray:
        if self._buf.size < n:
            self._buf = np.empty(min(max(n, 2 * self._buf.size), self._chunk), dtype=np.float64)
        return self._buf[:n]

    def abs64(self, chunk: np.ndarray) -> np.ndarray:
        """|chunk| in float64, in the buffer."""
        out = self.get(chunk.size)
        np.abs(chunk, out=out)  # converts to float64 on the way
        return out

    def as64(self, chunk: np.ndarray) -> np.ndarray:
        """The chunk in float64: itself, or converted into the buffer (``get``'s growth written
        out: this is the hot path of a list of small float32 arrays)."""
        if chunk.dtype == _FLOAT64:
            return chunk
        n = chunk.size
        if self._buf.size < n:
            self._buf = np.empty(min(max(n, 2 * self._buf.size), self._chunk), dtype=np.float64)
        out = self._buf[:n]
        np.copyto(out, chunk, casting="safe")
        return out


# the three kinds of partial (the engine's backend for numpy arrays: count,
# power_sum, max_abs, scaled_power_sum, binned_digits)


def count(arrays: Sequence[np.ndarray]) -> int:
    """Elements in the arrays."""
    return arrays[0].size if len(arrays) == 1 else sum([a.size for a in arrays])


def binned_digits(binned: BinnedPowerSum, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The reproducible mode's local part: ``binned.local(arrays)``."""
    return binned.local(arrays)


def power_sum(arrays: Sequence[np.ndarray], p: float) -> tuple[float, bool]:
    """(sum |x|**p over the arrays, accumulated in float64, in one read; rescue): ``rescue`` is
    True where the caller must take the two-pass scaled route instead (:func:`needs_rescue`;
    :func:`max_abs` then :func:`scaled_power_sum`)."""
    total = 0.0
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # judged below (a dot warns too)
        rest = arrays
        if p == 2.0 and len(arrays) >= _kernels.MANY:  # many arrays: one compiled call for all
            total, rest = _compiled_sumsq(arrays)
        left = []
        for a in rest:  # the common case, one call per array, no working buffer
            if p == 2.0 and a.dtype == _FLOAT64 and a.ndim == 1 and a.flags.c_contiguous:
                total += float(a.dot(a))  # the commonest of _one_call_sum's cases, inline
                continue
            s = _one_call_sum(a, p)
            if s is None:
                left.append(a)
            else:
                total += s
        scratch: _Scratch | None = None
        for a in left:
            if p == 2.0 and a.size <= MIN_CHUNK and a.flags.c_contiguous:  # float32, float16
                # one chunk (a chunk is at least MIN_CHUNK): its float64 copy and dot, the
                # chunked route's own operations, without its buffer and generator
                flat = (a if a.ndim == 1 else a.ravel()).astype(_FLOAT64)
                total += float(flat.dot(flat))
                continue
            if scratch is None:
                chunk = chunk_size(arrays)
                scratch = _Scratch(chunk)
            total += _chunked_sum(a, p, scratch, chunk)
    if _SAFE_LO <= total <= _SAFE_HI:  # the common case, without building the questions below
        return total, False
    return total, needs_rescue(
        total,
        lambda: any(np.any(c) for a in arrays for c in iter_chunks(a)),
        lambda: not all(np.isfinite(c).all() for a in arrays for c in iter_chunks(a)),
    )


def needs_rescue(total: float, any_nonzero: Callable[[], bool], any_nonfinite: Callable[[], bool]) -> bool:
    """Must the engine take the two-pass scaled route for this plain sum of |x|**p?

    Yes where it over- or underflowed: outside the safe range, unless the data is
    all zeros (the sum is exact) or holds inf or NaN (the norm IS inf or NaN).
    The two questions about the data are asked only on those rare paths.
    """
    if _SAFE_LO <= total <= _SAFE_HI:
        return False
    if total == 0.0 and not any_nonzero():
        return False  # all zeros: exact
    if not math.isfinite(total) and any_nonfinite():
        return False  # the data holds inf or NaN
    return True


def _compiled_sumsq(arrays: Sequence[np.ndarray]) -> tuple[float, Sequence[np.ndarray]]:
    """(sum of squares of the arrays the kernels take, the arrays left to numpy)."""
    kernels = _kernels.get()
    table = kernels.table_for(arrays) if kernels is not None else None
    if table is None or not table.compiled:
        return 0.0, arrays
    return kernels.sumsq(table), left_to_numpy(arrays, table)  # type: ignore[union-attr]


def left_to_numpy(arrays: Sequence[np.ndarray], table: _kernels.Table) -> Sequence[np.ndarray]:
    """The arrays a table leaves to numpy (float16, strided, byte-swapped, subclasses)."""
    if table.compiled == len(arrays):
        return ()
    return [a for a, kind in zip(arrays, table.kind.tolist()) if not kind]


_SAFE_HI = 2.0**960  # ranks may still add up without overflow
_SAFE_LO = 2.0**-900  # anything lost to underflow is below 2**-120 of this


def _one_call_sum(a: np.ndarray, p: float) -> float | None:
    """sum x**2 in one call with no working buffer (BLAS dot on float64, the
    compiled kernels on large float32 and float16), or None: the chunked route is needed."""
    if p != 2.0 or not (a.flags.c_contiguous or a.flags.f_contiguous):
        return None
    if a.dtype == _FLOAT64:
        flat = a if a.ndim == 1 else a.ravel(order="K")  # a view
        return float(flat.dot(flat))  # the method: np.dot's dispatch costs a Python call
    if a.size >= _kernels.MIN_SIZE and (a.dtype == _FLOAT32 or a.dtype == _FLOAT16):
        kernels = _kernels.get()
        if kernels is not None:  # one pass at memory speed, float64 accumulation
            flat = a if a.ndim == 1 else a.ravel(order="K")
            if a.dtype == _FLOAT32:
                return float(kernels.sumsq_f32(flat))
            return float(kernels.sumsq_f16(flat.view(np.uint16)))
    return None


def _chunked_sum(a: np.ndarray, p: float, scratch: _Scratch, chunk: int) -> float:
    total = 0.0
    for c in iter_chunks(a, chunk):
        if p == 2.0:
            c64 = scratch.as64(c)
            total += float(np.dot(c64, c64))
        elif p == 1.0:
            total += float(np.add.reduce(scratch.abs64(c)))
        else:
            b = scratch.abs64(c)
            np.power(b, p, out=b)
            total += float(np.add.reduce(b))
    return total


def max_abs(arrays: Sequence[np.ndarray]) -> tuple[float, bool]:
    """(max |x|, any NaN). NaN travels as a flag: MPI's MAX may drop it."""
    best = 0.0
    nan = False
    for a in arrays:
        for c in iter_chunks(a):
            m = float(max(np.max(c), -np.min(c)))  # two reads, no temporary
            if math.isnan(m):
                nan = True
            elif m > best:
                best = m
    return best, nan


def scaled_power_sum(arrays: Sequence[np.ndarray], p: float, top: float) -> float:
    """sum (|x| / top)**p for top = max|x| > 0: the largest term is exactly 1, so
    nothing overflows and what underflows is negligible next to it, for any p."""
    chunk = chunk_size(arrays)
    scratch = _Scratch(chunk)
    total = 0.0
    with np.errstate(under="ignore"):
        for a in arrays:
            for c in iter_chunks(a, chunk):
                b = scratch.abs64(c)
                np.divide(b, top, out=b)
                np.power(b, p, out=b)
                total += float(np.add.reduce(b))
    return total


def multiply_by(arrays: Sequence[np.ndarray], factor: float, out: Sequence[np.ndarray]) -> None:
    """``out[i] = arrays[i] * factor`` (finite, >= 0), each in its own dtype (see
    :func:`_multiply_one`). ``out`` is ``arrays`` itself for an in-place scale: then a factor of
    exactly 1 touches nothing, not even a read, and many arrays go in one compiled call
    through the table the argument checks read for them (``_kernels.Checked``)."""
    if factor == 1.0:
        if out is not arrays:
            for a, b in zip(arrays, out):
                np.copyto(b, a)
        return
    # beyond float32's normal range, a float32 factor loses bits (or is clamped): float32 then
    # goes the float16 way, in float64, rounded once
    in_float32 = factor == 0.0 or _FLOAT32_TINY <= factor <= _FLOAT32_MAX
    table = arrays.table if type(arrays) is _kernels.Checked and arrays.writable and out is arrays else None
    kernels = _kernels.get() if table is not None and table.compiled and in_float32 else None
    if kernels is None:
        f32 = None  # the float32 factor, computed once, where a float32 array asks for it
        for a, b in zip(arrays, out):
            if f32 is None and a.dtype.itemsize == 4 and in_float32:
                f32 = float32_toward_zero(factor)
            _multiply_one(a, factor, f32, b)
        return
    f32 = float32_toward_zero(factor)
    for a in left_to_numpy(arrays, table):  # type: ignore[arg-type]
        _multiply_one(a, factor, f32, a)
    kernels.multiply_table(table, factor, f32)  # type: ignore[arg-type]  # the rest, in one call


def _multiply_one(src: np.ndarray, factor: float, f32: np.float32 | None, dst: np.ndarray) -> None:
    """dst = src * factor in src's dtype, one pass, no full-size temporary.

    float64: the plain product. float32: one float32 multiply by ``f32``, the factor
    rounded toward zero to float32 (:func:`float32_toward_zero`; None for other dtypes):
    the factor's rounding never lifts a value, so each result is at most half an ulp
    above the product (the product's own rounding) and less than 2**-23 + 2**-24 below
    it, relative. float16, and float32 where ``f32`` is None (a factor outside float32's normal
    range): computed in float64 and rounded once (an 11-bit factor would be off by up to 5e-4).
    """
    if src.dtype.itemsize == 8:
        np.multiply(src, factor, out=dst)
    elif src.dtype.itemsize == 4 and f32 is not None:
        np.multiply(src, f32, out=dst)
    else:
        np.multiply(src, factor, out=dst, dtype=np.float64, casting="same_kind")


def float32_toward_zero(factor: float) -> np.float32:
    """The factor (>= 0) rounded to float32 toward zero (never up): what float32 values (and
    torch's float16 and bfloat16, computed in float32) are multiplied by. Read through
    float32's bytes: about half the cost of numpy's scalars (0.6 against 1.3 us)."""
    x = min(float(factor), _FLOAT32_MAX)  # gclip.scale's factor may be beyond float32's range
    packed = _F32.pack(x)  # rounded to nearest
    (f32,) = _F32.unpack(packed)
    if f32 > x:  # rounded up: the float32 one step toward zero (the bits of a positive one, less 1)
        (f32,) = _F32.unpack(_U32.pack(_U32.unpack(packed)[0] - 1))
    out: np.float32 = np.float32(f32)
    return out


_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")
_EXTRACTOR = 1.5 * 2.0**52  # (r + M) - M rounds r to an integer, for |r| < 2**51


class BinnedPowerSum:
    """Reproducible sum |x|**p for p in {1, 2}: the same bits for any layout.

    Every value v = |x|**p is cut into K digits on a fixed grid of bins, bin j
    holding multiples of 2**(W*j). A block of values is first scaled by a power
    of two (exact), then each fold rounds the remainder to the bin's grid with
    the extractor trick q = (r + M) - M. A value's digit in bin j does not
    depend on where the folds started, so the digit *counts* (integers) are a
    property of the multiset of values alone; integers add exactly, in any
    order. The result keeps the K bins below the top one of the global maximum:
    relative error below N * 2**(-W*(K-1)) before the final rounding, which is
    faithful for N < 2**35 elements.

    Layout: ``[count, special, digits...]``: ``special`` carries inf/NaN, and
    each bin count travels as three base-2**24 float64 digits, so the SUM of up
    to 2**29 ranks stays exact.
    """

    W = 44  # bits per bin
    K = 3  # folds (bins kept below the top)
    BLOCK = BLOCK  # block sums of W-bit digits stay below 2**53: exact
    _BIN_LO = -52  # enough for 2**-2150 (subnormal squared)
    _BIN_HI = 48  # enough for 2**2048 (max float squared)
    _DIGITS = 3
    _DIGIT_BITS = 24

    def __init__(self, p: float) -> None:
        if p not in (1.0, 2.0):
            raise ValueError(f"reproducible=True supports norm_type 1, 2 or inf, got {p!r}")
        self.p = int(p)
        self.nbins = self._BIN_HI - self._BIN_LO + 1
        self.size = 2 + self._DIGITS * self.nbins

    def local(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        counts = np.zeros((self.nbins, 2), dtype=np.int64)  # per bin: low word, and multiples of 2**32
        special = 0.0
        size = count(arrays)
        many = len(arrays) >= _kernels.MANY
        kernels = _kernels.get() if size >= _kernels.MIN_SIZE or many else None
        rest = arrays
        if kernels is not None and many:  # one compiled call for every array it takes
            table = kernels.table_for(arrays)
            if table is not None and table.compiled:
                special += kernels.digits(table, self.p, counts, self.W, self._BIN_LO)
                rest = left_to_numpy(arrays, table)
        # numpy: two bounded buffers; compiled: none, so whole arrays (cut at multiples of BLOCK)
        chunk = chunk_size(arrays, buffers=2)
        buffers = _Scratch(chunk), _Scratch(chunk)
        for a in rest:
            if kernels is not None and a.dtype in (_FLOAT32, _FLOAT64):
                whole = -(-max(a.size, 1) // BLOCK) * BLOCK
                for c in iter_chunks(a, whole):
                    special += kernels.digits_view(c, self.p, counts, self.W, self._BIN_LO)
            else:
                for c in iter_chunks(a, chunk):
                    special += self._deposit(c, buffers, counts)
        return self._pack(counts, size, special)

    def local_stream(self, chunks: Iterable[np.ndarray], size: int) -> np.ndarray:
        """:meth:`local` of 1-D float32/float64 chunks given one at a time (the same buffer may
        come back refilled: each is used before the next is asked for); ``size`` elements in all.
        A value's digits do not depend on where its block starts, so any cut gives local's."""
        counts = np.zeros((self.nbins, 2), dtype=np.int64)
        special = 0.0
        kernels = _kernels.get()
        buffers, room = (_Scratch(0), _Scratch(0)), 0
        for c in chunks:
            if kernels is not None:
                special += kernels.digits_view(c, self.p, counts, self.W, self._BIN_LO)
                continue
            blocks = -(-c.size // BLOCK) * BLOCK  # _deposit works in whole blocks
            if blocks > room:
                buffers, room = (_Scratch(blocks), _Scratch(blocks)), blocks
            special += self._deposit(c, buffers, counts)
        return self._pack(counts, size, special)

    def _pack(self, counts: np.ndarray, size: int, special: float) -> np.ndarray:
        """:meth:`pack` of the counts as the compiled kernels keep them (low word, multiples of 2**32)."""
        bins = np.flatnonzero(counts.any(axis=1)).tolist()
        return self.pack(((i, int(counts[i, 0]) + (int(counts[i, 1]) << 32)) for i in bins), size, special)

    def pack(self, bins: Iterable[tuple[int, int]], size: int, special: float) -> np.ndarray:
        """The local part, [count, special, digits...], from (bin, digit count) pairs: each
        count as base-2**24 float64 digits, so the SUM over ranks stays exact."""
        out = np.zeros(self.size)
        out[0] = size
        out[1] = special
        base = 1 << self._DIGIT_BITS
        for i, n in bins:
            for d in range(self._DIGITS - 1):
                out[2 + i * self._DIGITS + d] = n % base
                n //= base
            out[2 + i * self._DIGITS + self._DIGITS - 1] = n
        return out

    def _deposit(self, c: np.ndarray, buffers: tuple[_Scratch, _Scratch], counts: np.ndarray) -> float:
        """Adds the digit counts of one 1-D chunk to ``counts``; returns the inf/NaN seen.

        Each block of BLOCK values (from the chunk's start) has its own top bin t,
        from its own max |x|: the smallest t with max|x|**p <= 2**(W*(t+1) - 1).
        A block holding inf or NaN is special: its digits are not counted.
        """
        n, p, W, B = c.size, self.p, self.W, self.BLOCK
        nb = -(-n // B)
        v = buffers[0].get(nb * B)
        q = buffers[1].get(nb * B)
        np.abs(c, out=v[:n])  # in float64
        v[n:] = 0.0
        blocks = v.reshape(nb, B)
        top = np.max(blocks, axis=1)  # NaN where the block holds one
        special = 0.0
        bad = ~(top < np.inf)
        if bad.any():
            special = float(np.sum(top[bad]))  # NaN if any, else inf
            blocks[bad] = 0.0
            top[bad] = 0.0
        fm, em = np.frexp(top)  # exact: top = fm * 2**em
        fp = fm * fm if p == 2 else fm
        gm, ge = np.frexp(fp)
        ceil_log2 = ge + p * em - (gm == 0.5)
        t = -((-(ceil_log2 - W + 1)) // W)
        k = (W * t) // p  # scale |x| by 2**-k (exact): bin t's unit becomes 1
        if np.all(np.abs(k) < POW2_LIMIT):
            np.multiply(blocks, np.ldexp(1.0, -k.astype(np.int32))[:, None], out=blocks)
        else:  # 2**-k itself is out of range: let ldexp do it
            np.ldexp(blocks, -k.astype(np.int32)[:, None], out=blocks)
        if p == 2:
            np.multiply(v, v, out=v)
        low = counts[:, 0]
        for i in range(self.K):
            # the digit in bin t - i: v rounded to the bin's unit (1, after the rescaling below)
            np.add(v, _EXTRACTOR, out=q)
            np.subtract(q, _EXTRACTOR, out=q)
            sums = np.add.reduce(q.reshape(nb, B), axis=1)  # exact: below 2**53
            np.add.at(low, t - i - self._BIN_LO, sums.astype(np.int64))
            if i + 1 < self.K:  # the remainder, scaled so the next bin's unit is 1 (exact)
                np.subtract(v, q, out=v)
                np.multiply(v, 2.0**W, out=v)
        carry = low >> 32  # a chunk adds below 2**59 per bin: keep the low words below 2**32
        counts[:, 1] += carry
        low -= carry << 32
        return special

    def exact(self, combined: np.ndarray) -> Fraction | float:
        """The combined sum as an exact fraction (or inf/NaN)."""
        if combined[1] != 0.0:
            return float(combined[1])
        digits = combined[2:].reshape(self.nbins, self._DIGITS)
        used = np.flatnonzero(digits.any(axis=1))
        if not used.size:
            return Fraction(0)
        top = int(used[-1])  # the top bin of the global maximum: keep K bins from it down
        base = 1 << self._DIGIT_BITS
        total = Fraction(0)
        for i in range(top, max(top - self.K, -1), -1):
            count = sum(int(d) * base**j for j, d in enumerate(digits[i]))
            total += Fraction(count) * Fraction(2) ** (self.W * (i + self._BIN_LO))
        return total

    def _power(self, total: Fraction | float) -> tuple[float, int]:
        """The sum as (mant, exp): sum = mant * 2**(p*exp), mant rounded once."""
        if isinstance(total, float) or total == 0:
            return float(total), 0
        # scale into range before rounding to float once
        shift = (total.numerator.bit_length() - total.denominator.bit_length()) // self.p
        scaled = total * Fraction(2) ** (-self.p * shift)  # exact
        return float(scaled), shift

    def power(self, combined: np.ndarray) -> tuple[float, int]:
        """The combined sum as (mant, exp), sum = mant * 2**(p*exp), from one decoding of the
        digits (``engine.root`` gives the norm)."""
        return self._power(self.exact(combined))
