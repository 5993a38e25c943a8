"""The distributed judge's cases: what each of R ranks holds, and the limit.

Each case gives every rank a list of float arrays (its ``grads``): the
contract's checks with their shards spread over the ranks, ranks that hold
several arrays, none, or only empty ones, uneven sizes and shapes, float32
and float64, a zero norm and a zero limit, and seeded random layouts. Cases
are data (numpy arrays), pickled for the ranks: the judge computes what gclip
gives on the very same inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..gallery.contract import seed_checks

__all__ = ["GROUPS", "RankCase", "make_rank_cases", "norm_of"]

# (title, label prefix) in the order the report lists them
GROUPS = (
    ("the contract's checks (N = 1..5)", "contract"),
    ("who holds what", "holdings"),
    ("float32 and float64", "dtypes"),
    ("edge cases", "edge"),
    ("random layouts", "random"),
)


class RankCase(NamedTuple):
    label: str
    ranks: list[list[np.ndarray]]  # ranks[r]: the arrays rank r passes as grads
    max_norm: float


def norm_of(case: RankCase) -> float:
    """The case's global norm, from its definition (every value once), in float64."""
    return math.sqrt(math.fsum(float(np.sum(np.square(a, dtype=np.float64))) for r in case.ranks for a in r))


def _f64(values: list) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _contract(size: int) -> list[RankCase]:
    """The contract's seven checks for N = 1..5: shard i goes to rank i mod R."""
    out = []
    for n in range(1, 6):
        for check in seed_checks(n):
            ranks = [[_f64(s) for s in check.shards[r::size]] for r in range(size)]
            out.append(RankCase(f"contract N={n}: {check.label}", ranks, float(check.limit)))
    return out


def _filled(rng: np.random.Generator, shape: tuple[int, ...], dtype: str = "float64") -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _holdings(size: int, rng: np.random.Generator) -> list[RankCase]:
    last = size - 1
    every = [[_filled(rng, (w,)) for w in (3, 1, 5)] for _ in range(size)]
    cases = [RankCase("holdings: every rank holds three arrays", every, 1.0)]
    if size > 1:
        ranks = [[] if r == 0 else [_filled(rng, (4,)), _filled(rng, (2,))] for r in range(size)]
        cases.append(RankCase("holdings: rank 0 holds no arrays", ranks, 1.0))
        ranks = [[] if r == last else [_filled(rng, (4,))] for r in range(size)]
        cases.append(RankCase(f"holdings: rank {last} holds no arrays", ranks, 1.0))
        ranks = [[_filled(rng, (6,))] if r == 0 else [] for r in range(size)]
        cases.append(RankCase("holdings: only rank 0 holds arrays", ranks, 1.0))
        empty = [np.zeros(0), np.zeros((0, 3))]
        ranks = [empty if r == 1 else [_filled(rng, (3,))] for r in range(size)]
        cases.append(RankCase("holdings: rank 1 holds only empty arrays", ranks, 1.0))
    ranks = [[np.zeros(0)] for _ in range(size)]
    cases.append(RankCase("holdings: every rank holds only an empty array", ranks, 1.0))
    ranks = [[_filled(rng, (3, 4)), _filled(rng, (2, 3, 2))] for _ in range(size)]
    cases.append(RankCase("holdings: 2-D and 3-D arrays", ranks, 2.0))
    sizes = [(1,), (1000,), (37,), (250,)]
    ranks = [[_filled(rng, sizes[r % len(sizes)])] for r in range(size)]
    cases.append(RankCase("holdings: uneven sizes (1 to 1000 values)", ranks, 3.0))
    return cases


def _dtypes(size: int, rng: np.random.Generator) -> list[RankCase]:
    f32 = [[_filled(rng, (8,), "float32"), _filled(rng, (3,), "float32")] for _ in range(size)]
    mixed = [[_filled(rng, (5,), "float32"), _filled(rng, (4,))] for _ in range(size)]
    by_rank = [[_filled(rng, (6,), "float32" if r == 0 else "float64")] for r in range(size)]
    return [
        RankCase("dtypes: float32 on every rank", f32, 1.0),
        RankCase("dtypes: float32 and float64 on each rank", mixed, 1.0),
        RankCase("dtypes: float32 on rank 0, float64 elsewhere", by_rank, 1.0),
    ]


def _edge(size: int, rng: np.random.Generator) -> list[RankCase]:
    def every(make, limit: float, label: str) -> RankCase:
        return RankCase(f"edge: {label}", [make(r) for r in range(size)], limit)

    zero = every(lambda r: [np.zeros(3), np.zeros(2)], 1.0, "zero norm (all values 0)")
    base = [[_filled(rng, (4,))] for _ in range(size)]
    norm = math.sqrt(math.fsum(float(np.sum(a[0] ** 2)) for a in base))
    return [
        zero,
        RankCase("edge: zero limit", base, 0.0),
        RankCase("edge: limit equals the norm", base, norm),
        RankCase("edge: below the limit: unchanged", base, norm * 2),
        every(lambda r: [_filled(rng, (3,)) * 1e-9], 1e-9, "tiny values"),
        every(lambda r: [_filled(rng, (3,)) * 1e100], 1e99, "huge values (squares near 1e200)"),
        every(lambda r: [-np.abs(_filled(rng, (3,)))], 0.5, "negative values"),
    ]


def _random(size: int, rng: np.random.Generator, i: int) -> RankCase:
    """One random layout: how many arrays each rank holds, their shapes, dtypes, scale and limit."""
    kind = rng.random()
    mag = 10 ** rng.uniform(-2.0, 2.5)
    ranks = []
    for _ in range(size):
        arrays = []
        for _ in range(int(rng.choice([0, 1, 1, 2, 2, 3, 4]))):
            shape = (int(rng.choice([0, 1, 2, 3, 5, 8, 13, 40])),)
            if rng.random() < 0.15:
                shape = (int(rng.integers(1, 4)), int(rng.integers(1, 5)))
            dtype = "float32" if rng.random() < 0.3 else "float64"
            if kind < 0.1:
                arrays.append(np.zeros(shape, dtype=dtype))
            elif kind < 0.3:
                arrays.append(rng.integers(-9, 10, shape).astype(dtype))
            else:
                arrays.append((rng.uniform(-1, 1, shape) * mag).astype(dtype))
        ranks.append(arrays)
    case = RankCase("", ranks, 1.0)
    norm = norm_of(case)
    pick = rng.random()
    if pick < 0.1:
        limit = 0.0
    elif norm == 0.0:
        limit = float(rng.uniform(0.1, 5))
    elif pick < 0.35:
        limit = norm * float(rng.uniform(1.05, 3.0))  # above the norm: unchanged
    else:
        limit = norm * float(rng.uniform(0.05, 0.95))  # below: clipped
    count = sum(len(r) for r in ranks)
    return RankCase(f"random #{i} ({count} arrays on {size} ranks)", ranks, float(f"{limit:.6g}"))


def make_rank_cases(size: int, count: int, seed: int) -> list[RankCase]:
    """Every case for ``size`` ranks: the fixed ones, then ``count`` random layouts from ``seed``."""
    rng = np.random.default_rng([seed, size, 1])  # the fixed cases' values: the same for every run
    cases = _contract(size) + _holdings(size, rng) + _dtypes(size, rng) + _edge(size, rng)
    stream = np.random.default_rng([seed, size, 2])
    return cases + [_random(size, stream, i) for i in range(count)]
