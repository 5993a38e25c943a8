"""Oracles for the gclip.torch tests: gradients as float64 arrays, norms by math.fsum.

No gclip code here: the oracle reads the values the tests hand it, converts
them exactly to float64 (every float16, bfloat16 and float32 value is a
float64), and adds exactly rounded powers with math.fsum.
"""

from __future__ import annotations

import math

import numpy as np
import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# how far a scaled element may land from the exact product: the scale rounded toward
# zero to float32 (< 2**-23), the float32 product (2**-24), the final rounding (the unit roundoff)
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def float64(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a new float64 array (exact)."""
    return t.detach().to("cpu", torch.float64).numpy().copy()


def fsum_norm(arrays, p: float = 2.0) -> float:
    """The p-norm of all the arrays' values as one vector."""
    values = np.abs(np.concatenate([np.ravel(a) for a in arrays])) if arrays else np.zeros(0)
    if math.isinf(p):
        return float(values.max()) if values.size else 0.0
    return math.fsum((values**p).tolist()) ** (1.0 / p)


def scale_error(dtype: torch.dtype) -> float:
    """The largest relative distance of a scaled element from the exact product."""
    if dtype == torch.float64:
        return 2.0**-52
    return UNIT_ROUNDOFF[dtype] + 2.0**-22


def scaled_once(before: np.ndarray, after: torch.Tensor, scale: float) -> tuple[bool, str]:
    """Is ``after`` ``before * scale`` rounded once in its dtype (not twice, not unscaled)?"""
    expected = before * scale
    got = float64(after)
    info = torch.finfo(after.dtype)
    tolerance = scale_error(after.dtype) * np.abs(expected) + info.tiny * info.eps  # (subnormals)
    off = np.abs(got - expected) - tolerance
    if off.size and off.max() > 0:
        i = int(off.argmax())
        return False, f"{after.dtype}: element {i} is {got.flat[i]!r}, expected {expected.flat[i]!r}"
    return True, ""
