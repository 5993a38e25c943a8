"""The contract of the original incident report, single process: ``clip_shards(shards, limit)``.

Given disjoint gradient shards and a non-negative limit, return the same shard
layout scaled by ``min(1, limit / global_L2_norm)``; a zero norm uses scale 1;
values are rounded to 12 decimals. The original incident report's seven checks,
for any N (each check's numbers times N), are :func:`seed_checks`.

``clip_shards`` runs the library's own global strategy on simulated ranks (one
per shard) in the reproducible mode, so it gives the very bits a real
``mpirun`` of the same layout gives, whatever the rank count.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from . import _validate
from .clip import clip_simulated
from .errors import GclipTypeError, GclipValueError

__all__ = ["DIGITS", "Check", "clip_shards", "rounded", "seed_checks", "validate_shards"]

DIGITS = 12  # the contract rounds results to 12 decimals


class Check(NamedTuple):
    label: str
    shards: list[list[float]]
    limit: float
    expected: list[list[float]]


def seed_checks(n: int) -> list[Check]:
    """The original incident report's seven checks for a given N (the report uses N = 1..5)."""

    def r(x: float) -> float:  # as the report writes it
        return round(x, DIGITS)

    return [
        Check("norm spans two shards", [[3 * n, 0], [0, 4 * n]], 2 * n, [[r(1.2 * n), 0], [0, r(1.6 * n)]]),
        Check("uneven shard widths", [[3 * n], [4 * n, 0]], 2 * n, [[r(1.2 * n)], [r(1.6 * n), 0]]),
        Check("below limit remains unchanged", [[n], [n]], 2 * n, [[n], [n]]),
        Check("single shard same global rule", [[3 * n, 4 * n]], 3 * n, [[r(1.8 * n), r(2.4 * n)]]),
        Check("zero norm", [[0, 0], []], n, [[0, 0], []]),
        Check("zero limit", [[n]], 0, [[0]]),
        Check("empty shards", [], n, []),
    ]


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def validate_shards(shards: object) -> list[list[float]]:
    """A list of lists of real numbers, or a one-line error naming the culprit."""
    if not isinstance(shards, (list, tuple)):
        raise GclipTypeError(f"shards must be a list of lists of numbers, got {type(shards).__name__}")
    out = []
    for i, shard in enumerate(shards):
        if not isinstance(shard, (list, tuple)):
            raise GclipTypeError(f"shard {i} must be a list of numbers, got {type(shard).__name__}")
        for j, v in enumerate(shard):
            if not _is_number(v):
                raise GclipTypeError(f"shard {i} item {j} must be a number, got {type(v).__name__}")
        try:
            out.append([float(v) for v in shard])
        except OverflowError:
            raise GclipValueError(f"shard {i} holds an integer too large for a float") from None
    return out


def clip_shards(shards: Sequence[Sequence[float]], limit: float) -> list[list[float]]:
    """Scale every shard by min(1, limit / global L2 norm), rounded to 12 decimals.

    The library's own engine runs on one simulated rank per shard."""
    limit = _validate.max_norm(limit, "limit")
    values = validate_shards(shards)
    if not values:
        return []
    results = clip_simulated([[np.asarray(s, dtype=np.float64)] for s in values], limit, reproducible=True)
    return [rounded(r.grads[0]) for r in results]


def rounded(values: np.ndarray | Sequence[float]) -> list[float]:
    """The contract's rounding: Python floats rounded to 12 decimals."""
    return [round(float(v), DIGITS) for v in np.asarray(values, dtype=np.float64).ravel()]
