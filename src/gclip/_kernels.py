"""Optional compiled kernels, for large shards, when numba is installed (``gclip[fast]``).

numpy alone cannot square float32 values in float64 without a conversion pass,
nor fuse the reproducible mode's folds; a compiled loop does both at memory
speed. The kernels compute exactly what the numpy code in ``partials`` does:

- ``sumsq_f32``: sum of float64(x)**2 over a float32 array (float64 accumulators,
  reordered freely: the order of a float sum is not part of the default mode's
  contract, its accuracy is: ~1e-13 at 1e7 elements);
- ``digits``: the reproducible mode's digit counts of one chunk, the very
  integers the numpy folds give (same extraction, rint = round half to even;
  sums of whole digits below 2**53 per block, exact in any order).

Set ``GCLIP_KERNELS=0`` to keep to numpy. Compiled code is cached on disk by
numba, so only the first run on a machine pays the compile time.
"""

from __future__ import annotations

import functools
import os
from typing import Any

__all__ = ["MIN_SIZE", "get"]

MIN_SIZE = 1 << 15  # below this, numpy's path is as fast and numba's import is not worth it


@functools.lru_cache(maxsize=1)
def get() -> Any:
    """The compiled kernels, or None (numba missing, or GCLIP_KERNELS=0)."""
    if os.environ.get("GCLIP_KERNELS", "1") == "0":
        return None
    try:
        return _compile()
    except Exception:  # noqa: BLE001 - numba absent or unusable here: numpy does the work
        return None


def _compile() -> Any:
    import math
    from types import SimpleNamespace

    import numba
    import numpy as np

    # reassociation only: every sum below is of float64 values (sumsq) or of
    # whole numbers below 2**53 (digits), and the other operations are exact
    jit = numba.njit(fastmath={"reassoc"}, nogil=True, cache=True)
    prefetch = _prefetch_intrinsic()

    @jit
    def sumsq(c):
        s = 0.0
        for i in range(c.size):
            v = np.float64(c[i])
            s += v * v
        return s

    @jit
    def sumsq_f32(x):
        # blocks of 1 KiB, each asking for the block 16 KiB ahead: with two ranks
        # streaming at once, the hardware prefetcher alone leaves the loop waiting
        # on memory (measured: 1.3x slower than BLAS, 1.0x with the hints)
        s = 0.0
        n = x.size
        for start in range(0, n, _BLOCK):
            for line in range(start + _AHEAD, min(start + _BLOCK + _AHEAD, n), _LINE):
                prefetch(x, line)
            s += sumsq(x[start : start + _BLOCK])
        return s

    @jit
    def digits(c, square, scale, width, block):
        # |x| * scale (a power of two in range: exact), squared or not, then three folds:
        # the digit is the remainder rounded to the bin's unit (1 after rescaling), and the
        # remainder is rescaled by 2**width for the next bin
        unit = math.ldexp(1.0, width)
        d0 = 0
        d1 = 0
        d2 = 0
        for start in range(0, c.size, block):
            f0 = 0.0
            f1 = 0.0
            f2 = 0.0
            for i in range(start, min(start + block, c.size)):
                v = abs(np.float64(c[i])) * scale
                if square:
                    v = v * v
                q = np.rint(v)
                f0 += q
                v = (v - q) * unit
                q = np.rint(v)
                f1 += q
                v = (v - q) * unit
                f2 += np.rint(v)
            d0 += np.int64(f0)
            d1 += np.int64(f1)
            d2 += np.int64(f2)
        return d0, d1, d2

    return SimpleNamespace(sumsq_f32=sumsq_f32, digits=digits)


_BLOCK = 256  # float32 elements summed between prefetch hints
_AHEAD = 4096  # how far ahead the hints reach (16 KiB)
_LINE = 16  # float32 elements per 64-byte cache line


def _prefetch_intrinsic():
    """``prefetch(a, i)``: a hint that a[i] will be read soon (LLVM's
    llvm.prefetch: read, keep in all cache levels). Never faults."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, idx):
        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            rw, locality, data = (ir.Constant(i32, v) for v in (0, 3, 1))
            builder.call(fn, [builder.bitcast(ptr, i8p), rw, locality, data])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return prefetch
