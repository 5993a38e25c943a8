"""What the audit reads of a gradient: a few numbers, never a copy.

For each local gradient (a DTensor's local shard, or a plain tensor) the audit keeps
its **sketch**: the number of values, the float64 sum of squares, the plain sum (the
projection on the all-ones vector) and one projection on a Gaussian vector drawn from a
seed of its own. The sketch of the gradient as backward left it is taken after backward;
the sketch of the gradient the optimizer receives at the step, with the same seed. If the
optimizer's gradient is ``s`` times backward's, every projection is ``s`` times too, and
the sum of squares ``s**2`` times: the scale is read off the Gaussian projection and
checked on the other two. A gradient that is not a multiple of backward's (clipped per
value, partly scaled, rewritten) fails that check with probability one, since the
Gaussian vector is drawn independently of the values; in floating point, to the
tolerance of the gradient's dtype.

Why not a copy: a copy of every gradient doubles the gradients' memory (the reason
transformers #46113 runs out of memory); the sketch costs three numbers per tensor, and
the Gaussian vector is drawn in bounded chunks (``CHUNK`` values), so the extra memory is
one chunk at a time whatever the model's size. What it costs instead is time: one pass
over the gradients after backward and one at the step, each drawing the random vector.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["CHUNK", "Sketch", "factor", "local", "sketch", "unit_sketches", "unit_squares"]

CHUNK = 1 << 20  # values of the Gaussian vector drawn at once (8 MiB in float64)


class Sketch(NamedTuple):
    """One local gradient, summed up: enough to tell the factor another copy of it got."""

    count: int
    sumsq: float  # float64 sum of squares
    total: float  # float64 plain sum: the projection on the all-ones vector
    gauss: float  # the projection on a Gaussian vector drawn from ``seed``
    seed: int
    finite: bool  # no inf or NaN among the values
    dtype: str


def local(grad: Any) -> torch.Tensor:
    """The values this rank holds: a DTensor's local shard, or the tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


@torch.no_grad()
def sketch(grad: Any, seed: int) -> Sketch:
    """The sketch of one gradient (DTensor or plain), its Gaussian vector drawn from ``seed``."""
    values = local(grad).detach()
    flat = values.reshape(-1)
    device = flat.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    sumsq = total = gauss = 0.0
    finite = True
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK].to(torch.float64)
        draw = torch.randn(chunk.numel(), generator=generator, dtype=torch.float64, device=device)
        sumsq += float(torch.dot(chunk, chunk))
        total += float(chunk.sum())
        gauss += float(torch.dot(chunk, draw))
    if not (math.isfinite(sumsq) and math.isfinite(total) and math.isfinite(gauss)):
        finite = bool(torch.isfinite(flat).all())
    return Sketch(flat.numel(), sumsq, total, gauss, seed, finite, str(values.dtype).replace("torch.", ""))


RTOL = {"float64": 1e-9, "float32": 2e-6, "float16": 2e-3, "bfloat16": 1e-2}  # a product's rounding, and more


def factor(before: Sketch, after: Sketch) -> tuple[float | None, bool]:
    """The factor ``after`` is of ``before``, and whether every value got it.

    The factor's size is the ratio of the norms (as precise as the sums of squares); its
    sign, and the check that every value got it, come from the two projections, each to
    the rounding of the gradient's dtype. None: nothing non-zero went in (any factor
    fits). NaN: the values came back inf or NaN where they went in finite."""
    if before.count != after.count:
        return math.nan, False
    if not after.finite and before.finite:
        return math.nan, True
    if before.sumsq == 0.0 or not before.finite:
        return None, True
    rtol = RTOL.get(before.dtype, 1e-2)
    norm = math.sqrt(before.sumsq)
    size = math.sqrt(after.sumsq / before.sumsq)
    lead = before.gauss if abs(before.gauss) >= abs(before.total) / math.sqrt(before.count) else before.total
    ahead = after.gauss if lead is before.gauss else after.total
    scale = -size if lead * ahead < 0 else size
    # a projection on a vector of norm n is off by at most rtol * |scale| * norm * n where
    # every value got the factor (each product rounded); more means some value did not
    slack = 8 * rtol * size * norm + 1e-300
    agree = abs(after.gauss - scale * before.gauss) <= slack
    agree = agree and abs(after.total - scale * before.total) <= slack * math.sqrt(before.count)
    return scale, agree


# -- per unit (the audit's --agc): a row of a matrix, an output channel; a vector is one unit


def _units(values: torch.Tensor) -> torch.Tensor:
    """The local values as (units, values per unit), in torch's out-first layout (timm's)."""
    if values.dim() <= 1:
        return values.reshape(1, values.numel())
    return values.reshape(values.shape[0], math.prod(values.shape[1:]))  # (an empty shard: 0 rows)


@torch.no_grad()
def unit_sketches(grad: Any, seed: int) -> list[Sketch]:
    """One sketch per local unit of ``grad`` (its Gaussian vectors drawn from ``seed``), so
    that a unit-wise clip's factor is read unit by unit; rows are drawn in bounded chunks."""
    values = local(grad).detach()
    rows = _units(values)
    dtype = str(values.dtype).replace("torch.", "")
    generator = torch.Generator(device=rows.device)
    generator.manual_seed(seed)
    step = max(1, CHUNK // max(1, rows.shape[1]))
    out: list[Sketch] = []
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].to(torch.float64)
        draw = torch.randn(chunk.shape, generator=generator, dtype=torch.float64, device=chunk.device)
        sums = zip((chunk * chunk).sum(1).tolist(), chunk.sum(1).tolist(), (chunk * draw).sum(1).tolist())
        for sumsq, total, gauss in sums:
            finite = math.isfinite(sumsq) and math.isfinite(total) and math.isfinite(gauss)
            out.append(Sketch(rows.shape[1], sumsq, total, gauss, seed, finite, dtype))
    return out


@torch.no_grad()
def unit_squares(tensor: Any) -> list[float]:
    """Each local unit's float64 sum of squares (a parameter's: the weight's norm AGC reads)."""
    rows = _units(local(tensor).detach()).to(torch.float64)
    return (rows * rows).sum(1).tolist()
