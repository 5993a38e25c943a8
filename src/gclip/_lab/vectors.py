"""Whole-vector measures the lab reports on one process: the p-norm and the cosine."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["cosine", "vector_norm"]


def vector_norm(x: np.ndarray, p: float) -> float:
    """The p-norm of a vector, scaled first so that huge or tiny values neither overflow nor vanish."""
    if x.size == 0:
        return 0.0
    a = np.abs(np.asarray(x, dtype=np.float64))
    m = float(np.max(a))
    if m == 0.0 or not math.isfinite(m) or math.isinf(p):
        return m
    return m * float(np.sum((a / m) ** p)) ** (1.0 / p)


def cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    """cos of the angle between two vectors; None (undefined) if either is zero or not finite."""
    if a.size == 0 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    ma, mb = float(np.max(np.abs(a))), float(np.max(np.abs(b)))
    if ma == 0.0 or mb == 0.0:
        return None
    u, v = a / ma, b / mb  # scaled: the dot product and the norms cannot overflow
    c = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
    return max(-1.0, min(1.0, c))
