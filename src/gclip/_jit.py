"""The compiled kernels themselves (numba), imported only by ``_kernels.get()``.

Module-level functions, so numba's on-disk cache finds them again in the next
process. See ``_kernels`` for what each computes; every constant the compiled
code depends on is in this file (numba's cache is invalidated by this file's
changes only).
"""

from __future__ import annotations

import math
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

F32, F64 = 1, 2  # the table's kinds (0: left to numpy)
_C_CONTIGUOUS, _F_CONTIGUOUS = 0x1, 0x2  # numpy's array flags (ndarraytypes.h)
_HI = 1 if sys.byteorder == "little" else 0  # a float64's high 32-bit word

# LLVM operations numba has no Python spelling for


_I32, _I64 = ir.IntType(32), ir.IntType(64)
_DOUBLE = ir.DoubleType()


def _load(builder, addr, ty):
    return builder.load(builder.inttoptr(addr, ty.as_pointer()))


@intrinsic
def peek64(typingctx, addr):  # the int64 at an address (an array header's field)
    return types.int64(types.int64), lambda ctx, b, sig, args: _load(b, args[0], _I64)


@intrinsic
def peek32(typingctx, addr):  # the int32 at an address, widened
    return types.int64(types.int64), lambda ctx, b, sig, args: b.sext(_load(b, args[0], _I32), _I64)


def _pointer(dtype):  # an address as a typed pointer, for numba.carray
    def make(typingctx, addr):
        ptr = types.CPointer(dtype)

        def codegen(ctx, b, sig, args):
            return b.inttoptr(args[0], ctx.get_value_type(ptr))

        return ptr(types.int64), codegen

    return intrinsic(make)


@intrinsic
def absbits(typingctx, x):  # |x| as the unsigned integer of its bits: ordered as |x| is
    width = x.bitwidth
    ret = types.uint32 if width == 32 else types.uint64

    def codegen(ctx, b, sig, args):
        ty = ir.IntType(width)
        return b.and_(b.bitcast(args[0], ty), ir.Constant(ty, (1 << (width - 1)) - 1))

    return ret(x), codegen


@intrinsic
def umax(typingctx, a, c):  # stays in the operands' width (numba would widen): 8 lanes for float32
    def codegen(ctx, b, sig, args):
        return b.select(b.icmp_unsigned(">", args[0], args[1]), args[0], args[1])

    return a(a, a), codegen


@intrinsic
def as_float(typingctx, bits):  # absbits back to the float, widened to float64
    width = bits.bitwidth

    def codegen(ctx, b, sig, args):
        f = b.bitcast(args[0], ir.FloatType() if width == 32 else _DOUBLE)
        return b.fpext(f, _DOUBLE) if width == 32 else f

    return types.float64(bits), codegen


@intrinsic
def from_bits(typingctx, b):  # the float64 whose bits these are
    return types.float64(types.int64), lambda ctx, b, sig, args: b.bitcast(args[0], _DOUBLE)


@intrinsic
def hiword(typingctx, w):  # a float64's high word without its sign bit
    def codegen(ctx, b, sig, args):
        return b.and_(args[0], ir.Constant(_I32, 0x7FFFFFFF))

    return types.uint32(types.uint32), codegen


@intrinsic
def bits64(typingctx, x):
    return types.int64(types.float64), lambda ctx, b, sig, args: b.bitcast(args[0], _I64)


@intrinsic
def fma(typingctx, x, y, z):  # x*y + z rounded once
    def codegen(ctx, b, sig, args):
        fn = b.module.declare_intrinsic("llvm.fma", [_DOUBLE], ir.FunctionType(_DOUBLE, [_DOUBLE] * 3))
        return b.call(fn, args)

    return types.float64(types.float64, types.float64, types.float64), codegen


ptr32 = _pointer(types.float32)
ptr64 = _pointer(types.float64)
ptr_u32 = _pointer(types.uint32)


# the kernels

carray = numba.carray
# exact code: every rounding below is the numpy path's, in its order
jit = numba.njit(nogil=True, cache=True)


# the slots of the layout array _kernels passes (offsets into an array object, then the
# addresses of numpy.ndarray and of the native float32 and float64 dtypes, then the flags needed)
_TYPE, _DATA, _ND, _DIMS, _FLAGS, _DESCR, _NDARRAY, _DESCR32, _DESCR64, _NEED = range(10)


@numba.njit(cache=True)  # holds the GIL: no other thread changes the arrays while they are read
def inspect(ids, lay, ptr, size, kind):
    compiled = 0
    for j in range(ids.size):
        o = ids[j]
        kind[j] = ptr[j] = size[j] = 0
        if peek64(o + lay[_TYPE]) != lay[_NDARRAY]:  # an exact ndarray (no subclass): its fields follow
            continue
        descr = peek64(o + lay[_DESCR])
        k = F32 if descr == lay[_DESCR32] else F64 if descr == lay[_DESCR64] else 0
        flags = peek32(o + lay[_FLAGS])
        if k == 0 or flags & lay[_NEED] != lay[_NEED] or flags & (_C_CONTIGUOUS | _F_CONTIGUOUS) == 0:
            continue
        dims = peek64(o + lay[_DIMS])
        n = 1
        for d in range(peek32(o + lay[_ND])):
            n *= peek64(dims + 8 * d)
        kind[j] = k
        ptr[j] = peek64(o + lay[_DATA])
        size[j] = n
        compiled += 1
    return compiled


# The sums of squares. Each value is widened to float64 and squared with one fused
# multiply-add: the square of a float32, float16 or bfloat16 is exact in float64, so the
# fused operation rounds only the sum, as a multiply then an add would. Reassociation lets
# the compiler keep independent vector accumulators (4 x 8 float64 lanes with AVX-512, 4 x 4
# with AVX2): the loop then reads at memory speed. No software prefetch: the hardware's
# streams keep up with one plain loop, and the hints (a run of 256 values, each hinting 16 KiB
# ahead) cost the float32 loop 15-25% on an AVX-512 EPYC, one or two processes streaming.
# Reassociation and contraction only in these sums: the order of a float64 sum is free
fast_fma = numba.njit(fastmath={"reassoc", "contract"}, nogil=True, cache=True)


@fast_fma
def sumsq(x):  # float32 (or float64: then each square is rounded once, in the fused operation)
    s = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        s += v * v
    return s


@intrinsic
def half_as_float(typingctx, bits):  # an IEEE half's bits as the float64 it is (exact)
    def codegen(ctx, b, sig, args):
        return b.fpext(b.bitcast(args[0], ir.HalfType()), _DOUBLE)

    return types.float64(types.uint16), codegen


@fast_fma
def sumsq_f16(u):
    # float16 given as its uint16 bits (numba has no float16 arithmetic): widened exactly (with
    # F16C, a vector conversion to float32, then to float64), squared in float64
    s = 0.0
    for i in range(u.size):
        v = half_as_float(u[i])
        s += v * v
    return s


# a bfloat16 is a float32's top half: a 32-bit word holds two of them, and two integer
# operations on the word (a mask, a shift) give both as float32 bits, where widening each
# 16-bit value on its own takes a shuffle and a shift per value; the square of a widened
# bfloat16 is exact in float64 (8 bits of mantissa), so a fused multiply-add rounds only the sum
_BF16_HI = np.uint32(0xFFFF0000)
_BF16_LO = np.uint32(16)


@fast_fma
def _sumsq_bf16_words(w):
    s = 0.0
    for i in range(w.size):
        x = w[i]
        hi = as_float(np.uint32(x & _BF16_HI))  # the word's upper bfloat16 (little-endian: the later one)
        lo = as_float(np.uint32(x << _BF16_LO))  # the lower one
        s += hi * hi
        s += lo * lo
    return s


@jit
def _square_bf16(b):
    v = as_float(np.uint32(np.uint32(b) << np.uint32(16)))
    return v * v


@jit
def sumsq_bf16(u):
    # bfloat16 given as its uint16 bits (numpy has no bfloat16): squared in float64, in one
    # pass over the 32-bit words that hold two values each (one value apart at an odd start
    # or end); no float32 copy of the array is ever made
    n = u.size
    if u.strides[0] != 2:  # a strided view: value by value
        s = 0.0
        for i in range(n):
            s += _square_bf16(u[i])
        return s
    if n == 0:
        return 0.0
    head = 1 if u.ctypes.data % 4 else 0  # a word-aligned start for the words
    s = _square_bf16(u[0]) if head else 0.0
    m = (n - head) // 2
    if m:
        s += _sumsq_bf16_words(carray(ptr_u32(u.ctypes.data + 2 * head), m))
    if head + 2 * m < n:
        s += _square_bf16(u[n - 1])
    return s


@jit
def sumsq_table(ptr, size, kind):
    s = 0.0
    for j in range(ptr.size):
        if kind[j] == F32:
            s += sumsq(carray(ptr32(ptr[j]), size[j]))
        elif kind[j] == F64:
            s += sumsq(carray(ptr64(ptr[j]), size[j]))
    return s


@jit
def _scale_run(x, s):
    for i in range(x.size):
        x[i] *= s


@jit
def scale_table(ptr, size, kind, s64, s32):
    for j in range(ptr.size):
        if kind[j] == F32:
            _scale_run(carray(ptr32(ptr[j]), size[j]), s32)
        elif kind[j] == F64:
            _scale_run(carray(ptr64(ptr[j]), size[j]), s64)


# -- the reproducible mode's digits ---------------------------------------


@jit
def _top_bin(m, p, width):
    # the numpy path's (frexp, fm*fm rounded once): the smallest t with m**p <= 2**(width*(t+1) - 1),
    # frexp read from the bits (no call) for normal m > 0
    b = bits64(m)
    e = b >> 52
    if e == 0:  # subnormal
        fm, em = math.frexp(m)
    else:
        fm = from_bits((b & 0xFFFFFFFFFFFFF) | (1022 << 52))  # m = fm * 2**em, fm in [0.5, 1)
        em = e - 1022
    fp = fm * fm if p == 2 else fm  # in [0.25, 1): frexp(fp) is (fp, 0) or (2 fp, -1)
    ge = 0 if fp >= 0.5 else -1
    gm = fp if fp >= 0.5 else 2.0 * fp
    ceil_log2 = ge + p * em - (1 if gm == 0.5 else 0)
    return -((-(ceil_log2 - width + 1)) // width)


@jit
def _absmax_hi(y):
    # contiguous float64: the largest high word of |y| (sign, exponent, 20 bits of mantissa),
    # 8 lanes of 32 bits where the whole values would take 4 of 64
    w = carray(ptr_u32(y.ctypes.data), 2 * y.size)
    m = np.uint32(0)
    for i in range(y.size):
        m = umax(m, hiword(w[2 * i + _HI]))
    return m


@jit
def _block_top(y, p, width):
    # (t, m): the block's top bin and its max |y| or a value of the same top bin; m is
    # 0.0 for a block of zeros, inf or NaN for a special block (t unused then)
    if y.itemsize == 8 and y.strides[0] == 8:
        h = np.int64(_absmax_hi(y))
        if 0 < h < 0x7FF00000:  # the max lies in [lo, hi]: its t is known when theirs agree
            lo = from_bits(h << 32)
            t = _top_bin(lo, p, width)
            if t == _top_bin(from_bits(((h + 1) << 32) - 1), p, width):
                return t, lo
    m = as_float(_absmax(y))
    if 0.0 < m < np.inf:
        return _top_bin(m, p, width), m
    return 0, m


@jit
def _absmax(y):
    if y.size == 0:  # never read y[0] of an empty view
        return absbits(y.dtype.type(0.0))
    m = absbits(y[0])
    for i in range(1, y.size):
        m = umax(m, absbits(y[i]))
    return m


@jit
def _folds_sq32(y, z, m0, m1, m2, one):
    # float32 squared: x*x is exact in float64, so one fma is the product and the
    # extraction's rounding at once. t = (v + M): its low bits are the digit (M's
    # last bit is worth the bin's unit); the remainder v - q is exact; fold 2 extracts
    # from r0 - q1 = r0 + ((M1 + M2) - t1) - M2, both steps exact. fma(a, one, b) is
    # a + b on the multiply units (``one`` is 1.0 the compiler cannot see), which
    # would otherwise idle while the adders are the bottleneck. z (as long as y) is the
    # next block: its max is taken here, its loads overlapping this block's arithmetic
    c12 = m1 + m2
    a0 = a1 = a2 = 0
    mz = absbits(z[0])
    for i in range(y.size):
        x = np.float64(y[i])
        t0 = fma(x, x, m0)
        r0 = fma(x, x, m0 - t0)
        t1 = fma(r0, one, m1)
        a0 += bits64(t0)
        a1 += bits64(t1)
        a2 += bits64(r0 + (c12 - t1))
        mz = umax(mz, absbits(z[i]))
    n = y.size  # every term carried its constant's bits: off they come (modular, exact)
    return a0 - n * bits64(m0), a1 - n * bits64(m1), a2 - n * bits64(m2), as_float(mz)


@jit
def _folds(y, z, p, m0, m1, m2, one):
    # float64 squares (rounded once, as numpy's v*v) or |x|: then the same extraction
    c12 = m1 + m2
    a0 = a1 = a2 = 0
    mz = absbits(z[0])
    for i in range(y.size):
        x = np.float64(y[i])
        v = x * x if p == 2 else abs(x)
        t0 = fma(v, one, m0)
        r0 = v + (m0 - t0)
        t1 = fma(r0, one, m1)
        a0 += bits64(t0)
        a1 += bits64(t1)
        a2 += bits64(r0 + (c12 - t1))
        mz = umax(mz, absbits(z[i]))
    n = y.size
    return a0 - n * bits64(m0), a1 - n * bits64(m1), a2 - n * bits64(m2), as_float(mz)


@jit
def _folds_scaled(y, p, k, width):
    # the numpy path itself, value by value: for blocks so large or small that
    # the unscaled constants above would leave float64's normal range
    # (each digit, a whole number below 2**width, is added as an integer: a block's digit sum
    # may pass 2**53, where a float64 sum would round)
    e = 1.5 * 2.0**52
    unit = 2.0**width
    f0 = f1 = f2 = 0
    for i in range(y.size):
        v = math.ldexp(abs(np.float64(y[i])), -k)
        if p == 2:
            v = v * v
        q = (v + e) - e
        f0 += np.int64(q)
        v = (v - q) * unit
        q = (v + e) - e
        f1 += np.int64(q)
        v = (v - q) * unit
        f2 += np.int64((v + e) - e)
    return f0, f1, f2


@jit
def _deposit(counts, b, d):
    # counts[b] = (low, high) words: high carries multiples of 2**32, so no sum wraps
    lo = counts[b, 0] + d
    if lo > 2**62 or lo < -(2**62):
        carry = lo >> 32
        counts[b, 1] += carry
        lo -= carry << 32
    counts[b, 0] = lo


_RUN = 8  # blocks folded as one, with one top bin, where none of them rises above it


@jit
def _constants(t, width):  # the folds' extraction constants for top bin t, or m0 = 0.0 out of range
    u = width * t  # the top bin's unit is 2**u
    if 52 + u <= 1023 and u - 2 * width >= -1000:
        m0 = from_bits((52 + u + 1023) << 52 | 1 << 51)  # 1.5 * 2**(52 + u)
        m1 = from_bits((52 + u - width + 1023) << 52 | 1 << 51)
        m2 = from_bits((52 + u - 2 * width + 1023) << 52 | 1 << 51)
        return m0, m1, m2
    return 0.0, 0.0, 0.0


@jit
def _blocks(x, p, counts, width, bin_lo, block):
    # each block: its max |x| gives its top bin t (the next block's max is taken in this
    # block's fold loop, where its loads overlap the arithmetic), then the three folds
    special = 0.0
    n = x.size
    if n == 0:  # nothing to read, not even the first block's max
        return special
    t, m = _block_top(x[:block], p, width)
    for start in range(0, n, block):
        y = x[start : start + block]
        nxt = start + block
        fused = nxt + block <= n  # the next block is full: its max comes with this block's folds
        z = x[nxt : nxt + block] if fused else y
        mz = -1.0  # not taken
        if not m < np.inf:  # inf or NaN: the block is special, its digits are not counted
            special += m
        elif m > 0.0:
            m0, m1, m2 = _constants(t, width)
            if m0 > 0.0:
                one = m / m  # 1.0, unknown to the compiler
                if p == 2 and x.itemsize == 4:
                    d0, d1, d2, mz = _folds_sq32(y, z, m0, m1, m2, one)
                else:
                    d0, d1, d2, mz = _folds(y, z, p, m0, m1, m2, one)
            else:
                d0, d1, d2 = _folds_scaled(y, p, (width * t) // p, width)
            _deposit(counts, t - bin_lo, d0)
            _deposit(counts, t - 1 - bin_lo, d1)
            _deposit(counts, t - 2 - bin_lo, d2)
        if nxt < n:  # the next block's top bin
            if fused and mz >= 0.0:
                m = mz
                t = _top_bin(m, p, width) if 0.0 < m < np.inf else 0
            else:
                t, m = _block_top(x[nxt : nxt + block], p, width)
    return special


@jit
def digits(x, p, counts, width, bin_lo, block):
    # runs of _RUN blocks folded with the top bin t of the run's first block, the run's own max
    # taken in the same loop: a value's digits in the bins the result keeps are the same for any
    # top bin from its own block's up to the global one (the digits above its own are 0, those
    # below are the cascade's), so where no block of the run rises above t, the run's digits are
    # its blocks' (one deposit and one horizontal sum per run instead of per block); a run that
    # does rise, holds inf or NaN, zeros or values out of the constants' range goes block by block
    if x.itemsize == 8:  # float64 reads twice the bytes: its loop does better reading the next block
        return _blocks(x, p, counts, width, bin_lo, block)  # ahead (its max), as _blocks does
    special = 0.0
    n = x.size
    run = _RUN * block
    start = 0
    while start < n:
        end = min(start + run, n)
        t, m = _block_top(x[start : start + block], p, width)
        if 0.0 < m < np.inf and end - start > block:
            m0, m1, m2 = _constants(t, width)
            if m0 > 0.0:
                y = x[start:end]
                one = m / m  # 1.0, unknown to the compiler
                if p == 2 and x.itemsize == 4:
                    d0, d1, d2, my = _folds_sq32(y, y, m0, m1, m2, one)
                else:
                    d0, d1, d2, my = _folds(y, y, p, m0, m1, m2, one)
                if 0.0 < my < np.inf and _top_bin(my, p, width) <= t:
                    _deposit(counts, t - bin_lo, d0)
                    _deposit(counts, t - 1 - bin_lo, d1)
                    _deposit(counts, t - 2 - bin_lo, d2)
                    start = end
                    continue
        special += _blocks(x[start:end], p, counts, width, bin_lo, block)
        start = end
    return special


@jit
def digits_table(ptr, size, kind, p, counts, width, bin_lo, block_bytes):
    special = 0.0
    for j in range(ptr.size):
        if kind[j] == F32:
            special += digits(carray(ptr32(ptr[j]), size[j]), p, counts, width, bin_lo, block_bytes // 4)
        elif kind[j] == F64:
            special += digits(carray(ptr64(ptr[j]), size[j]), p, counts, width, bin_lo, block_bytes // 8)
    return special
