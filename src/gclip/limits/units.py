"""AGC, adaptive gradient clipping unit-wise (NFNets, arXiv 2102.06171), over MPI.

Each output unit's gradient is clipped to ``clipping * max(||W_i||, eps)``: where
``||G_i|| >= `` that limit it is scaled by ``limit / max(||G_i||, 1e-6)`` (timm's
``utils/agc.py`` and optax's ``adaptive_grad_clip``, the same rule). A unit is named by
the layout: "out-first" (torch's, timm's): a row of a Linear weight, an output channel of
a convolution (the norm over every axis but the first; a vector or scalar is one unit);
"in-first" (optax's kernels, JAX's HWIO): the norm over the leading axes (axis 0 for 2-D
and 3-D, axes 0-2 for 4-D), as optax states it.

Where a sharding splits a unit over ranks (a row-parallel Linear holds a slice of every
row), its norm is a sum over them: ``split=`` names, per array, the communicator of the
ranks that hold its units' pieces, and the units' partial sums of squares ride one
all-reduce per communicator (every array split over it together). Sums are in float64;
the scaled gradient is rounded once to its dtype. A unit whose gradient norm is not
finite is left untouched, as gclip leaves a non-finite gradient (timm and optax would
multiply it by 0 or NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import GclipValueError
from .rules import check_number

__all__ = ["AGC", "unit_axes", "unit_factor"]

LAYOUTS = ("out-first", "in-first")


def unit_axes(shape: Sequence[int], layout: str) -> tuple[int, ...] | None:
    """The axes a unit's norm sums over (None: the whole array is one unit)."""
    ndim = len(shape)
    if layout == "out-first":
        return None if ndim <= 1 else tuple(range(1, ndim))
    if sum(1 for n in shape if n != 1) <= 1:  # optax: jnp.squeeze(x).ndim <= 1
        return None
    if ndim in (2, 3):
        return (0,)
    if ndim == 4:
        return (0, 1, 2)
    raise GclipValueError(
        f"AGC layout 'in-first' takes arrays of 1 to 4 dimensions, got shape {tuple(shape)}"
    )


def unit_factor(p_sq: Any, g_sq: Any, clipping: float, eps: float, xp: Any) -> Any:
    """The per-unit factor from the units' sums of squares of the weight and the gradient
    (``xp`` is numpy or torch): 1 where the unit is within its limit or not finite."""
    limit = xp.maximum(xp.sqrt(p_sq), xp.full_like(p_sq, eps)) * clipping
    g_norm = xp.sqrt(g_sq)
    factor = limit / xp.maximum(g_norm, xp.full_like(g_norm, 1e-6))
    keep = (g_norm < limit) | ~xp.isfinite(g_norm)
    return xp.where(keep, xp.ones_like(factor), factor)


def _unit_sq(x: np.ndarray, axes: tuple[int, ...] | None) -> np.ndarray:
    x64 = np.asarray(x, dtype=np.float64)
    return np.asarray(np.sum(x64 * x64, axis=axes, keepdims=True))


class AGC:
    """Adaptive gradient clipping, unit-wise: ``AGC(clipping, eps).step(params, grads)``.

    Args:
        clipping: the largest ratio of a unit's gradient norm to its weight norm (> 0).
        eps: the smallest weight norm a limit is taken from (>= 0): zero-initialised
            units can still move.
        layout: "out-first" (torch: rows of a Linear weight) or "in-first" (optax's kernels).
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3, *, layout: str = "out-first") -> None:
        self.clipping = check_number("clipping", clipping)
        self.eps = check_number("eps", eps, zero=True)
        if layout not in LAYOUTS:
            raise GclipValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout

    def step(
        self,
        params: Sequence[Any],
        grads: Sequence[Any],
        *,
        split: Sequence[Any] | None = None,
        inplace: bool = False,
    ) -> list[np.ndarray]:
        """The gradients clipped unit-wise (in place with ``inplace``), one per parameter.

        ``split``: one entry per array, None where each unit lies whole on this rank, or
        the mpi4py communicator of the ranks that each hold a piece of every unit (the
        arrays' pieces then have the same unit axis lengths on those ranks).
        """
        params, grads = list(params), list(grads)
        if len(params) != len(grads):
            raise GclipValueError(f"AGC needs one gradient per parameter, got {len(params)} and {len(grads)}")
        entries = [None] * len(grads) if split is None else list(split)
        if len(entries) != len(grads):
            raise GclipValueError(f"split needs one entry per array, got {len(entries)} for {len(grads)}")
        sums = []
        for i, (p, g) in enumerate(zip(params, grads)):
            if inplace and not (isinstance(g, np.ndarray) and g.flags.writeable):
                raise GclipValueError(
                    f"inplace=True needs writable numpy arrays, got {type(g).__name__} for grads[{i}]"
                )
            p, g = np.asarray(p), np.asarray(g)
            if p.shape != g.shape:
                raise GclipValueError(f"params[{i}] has shape {p.shape} but grads[{i}] has {g.shape}")
            axes = unit_axes(g.shape, self.layout)
            sums.append((_unit_sq(p, axes), _unit_sq(g, axes)))
        _reduce_split(sums, entries)
        out = []
        for g, (p_sq, g_sq) in zip(grads, sums):
            factor = unit_factor(p_sq, g_sq, self.clipping, self.eps, np)
            arr = np.asarray(g)
            if inplace:
                np.multiply(arr, factor, out=arr, casting="unsafe")
                out.append(arr)
            else:
                out.append((arr.astype(np.float64) * factor).astype(arr.dtype))
        return out


def _reduce_split(sums: list[tuple[np.ndarray, np.ndarray]], entries: list[Any]) -> None:
    """Sum the split arrays' unit sums over their communicators, one Allreduce per communicator."""
    from mpi4py import MPI

    by_comm: dict[int, tuple[Any, list[int]]] = {}
    for i, comm in enumerate(entries):
        if comm is not None and comm is not False and comm.Get_size() > 1:
            by_comm.setdefault(id(comm), (comm, []))[1].append(i)
    for comm, members in by_comm.values():
        flat = np.concatenate([np.concatenate([sums[i][0].ravel(), sums[i][1].ravel()]) for i in members])
        comm.Allreduce(MPI.IN_PLACE, flat)
        at = 0
        for i in members:
            for part in sums[i]:
                part.ravel()[:] = flat[at : at + part.size]
                at += part.size
