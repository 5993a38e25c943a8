"""The original incident report's seven checks of the contract (``gclip.contract``), for any N.

Lab data, as the gallery's bugs are: the judge grades a clip on them, the demo and
the tests replay them. The contract's function itself, ``clip_shards``, is the core's.
"""

from __future__ import annotations

from typing import NamedTuple

from ..contract import DIGITS

__all__ = ["Check", "seed_checks"]


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
