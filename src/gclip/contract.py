"""The contract of the original incident report, single process: ``clip_shards(shards, limit)``.

Given disjoint gradient shards and a non-negative limit, return the same shard
layout scaled by ``min(1, limit / global_L2_norm)``; a zero norm uses scale 1;
values are rounded to 12 decimals. The report's seven checks, for any N (each
check's numbers times N), are lab data: :func:`gclip.gallery.contract.seed_checks`.

``clip_shards`` runs the library's own global strategy on simulated ranks (one
per shard) in the reproducible mode, so it gives the very bits a real
``mpirun`` of the same layout gives, whatever the rank count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import engine
from .clip import clip_simulated
from .errors import GclipTypeError, GclipValueError

__all__ = ["DIGITS", "clip_shards", "rounded", "validate_shards"]

DIGITS = 12  # the contract rounds results to 12 decimals


def validate_shards(shards: object) -> list[list[float]]:
    """A list of lists of real numbers, or a one-line error naming the culprit."""
    if not isinstance(shards, (list, tuple)):
        raise GclipTypeError(f"shards must be a list of lists of numbers, got {type(shards).__name__}")
    out = []
    for i, shard in enumerate(shards):
        if not isinstance(shard, (list, tuple)):
            raise GclipTypeError(f"shard {i} must be a list of numbers, got {type(shard).__name__}")
        for j, v in enumerate(shard):
            if not engine._real(v):  # a real number, not a bool
                raise GclipTypeError(f"shard {i} item {j} must be a number, got {type(v).__name__}")
        try:
            out.append([float(v) for v in shard])
        except OverflowError:
            raise GclipValueError(f"shard {i} holds an integer too large for a float") from None
    return out


def clip_shards(shards: Sequence[Sequence[float]], limit: float) -> list[list[float]]:
    """Scale every shard by min(1, limit / global L2 norm), rounded to 12 decimals.

    The library's own engine runs on one simulated rank per shard."""
    limit = engine.max_norm(limit, "limit")
    values = validate_shards(shards)
    if not values:
        return []
    results = clip_simulated([[np.asarray(s, dtype=np.float64)] for s in values], limit, reproducible=True)
    return [rounded(r.grads[0]) for r in results]


def rounded(values: np.ndarray | Sequence[float]) -> list[float]:
    """The contract's rounding: Python floats rounded to 12 decimals."""
    return [round(float(v), DIGITS) for v in np.asarray(values, dtype=np.float64).ravel()]
