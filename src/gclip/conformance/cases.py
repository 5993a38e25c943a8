"""The cases: the contract's checks for N = 1..5, edge cases, and seeded random layouts."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

from ..gallery.contract import seed_checks

__all__ = ["Case", "make_cases"]


class Case(NamedTuple):
    label: str
    shards: list[list[float]]
    limit: float
    exact: bool  # the contract's checks compare with ==, as the original incident report does


def make_cases(count: int, seed: int) -> list[Case]:
    """The contract's checks for N = 1..5, the edge cases, then ``count`` random layouts."""
    cases = [
        Case(f"contract N={n}: {c.label}", c.shards, c.limit, True)
        for n in range(1, 6)
        for c in seed_checks(n)
    ]
    cases += _edge_cases()
    rng = random.Random(seed)
    cases += [_random_case(rng, i) for i in range(count)]
    return cases


def _edge_cases() -> list[Case]:
    return [
        Case("edge: limit equals the norm", [[3, 0], [4]], 5, False),
        Case("edge: negative values", [[-3.0, 1.5], [], [-4.0]], 2.5, False),
        Case("edge: one element on each of 8 shards", [[1.0]] * 8, 2.0, False),
        Case("edge: tiny values", [[3e-9, -4e-9], [1e-9]], 1e-9, False),
        Case("edge: large values", [[300.0, -400.0], [1200.0]], 100.0, False),
        Case("edge: only empty shards", [[], [], []], 1.0, False),
        Case("edge: zero limit, several shards", [[1.0, -2.0], [3.0]], 0, False),
    ]


def _random_case(rng: random.Random, i: int) -> Case:
    """One random layout: every knob the contract has, drawn from a seeded stream."""
    ranks = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 8])
    widths = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7]) for _ in range(ranks)]
    kind = rng.random()
    if kind < 0.1:
        shards: list[list[float]] = [[0] * w for w in widths]
    elif kind < 0.35:
        shards = [[rng.randint(-9, 9) for _ in range(w)] for w in widths]
    else:
        mag = 10 ** rng.uniform(-2.0, 2.5)
        shards = [[float(f"{rng.uniform(-1, 1) * mag:.6g}") for _ in range(w)] for w in widths]
    norm = math.sqrt(math.fsum(v * v for s in shards for v in s))
    pick = rng.random()
    if pick < 0.1:
        limit: float = 0.0
    elif norm == 0.0:
        limit = float(f"{rng.uniform(0.1, 5):.6g}")
    elif pick < 0.35:  # above the norm: unchanged
        limit = float(f"{norm * rng.uniform(1.05, 3.0):.6g}")
    else:  # below: clipped
        limit = float(f"{norm * rng.uniform(0.05, 0.95):.6g}")
    return Case(f"random #{i} ({ranks} shards)", shards, limit, False)
