"""The oracle for parallel layouts: every rank's arrays, de-duplicated by tensor and shard.

Independent of gclip's counting: it never looks at the groups declared for
``replicated=``. It takes every piece every rank holds, keeps one per
(tensor name, shard), checks that the copies it drops are bit-identical to the
one it keeps, and sums the squares with math.fsum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def unique_pieces(pieces: Iterable) -> dict:
    """(name, part) -> array, one per tensor shard; copies must be equal."""
    kept: dict = {}
    for p in pieces:
        key = (p.name, p.part)
        if key in kept:
            assert np.array_equal(kept[key], p.array), f"copies of {key} differ"
        else:
            kept[key] = np.array(p.array, dtype=np.float64)
    return kept


def norm(pieces: Iterable, p: float = 2.0) -> float:
    values = np.concatenate([a.ravel() for a in unique_pieces(pieces).values()])
    if math.isinf(p):
        return float(np.max(np.abs(values)))
    return math.fsum(float(abs(v)) ** p for v in values) ** (1.0 / p)
