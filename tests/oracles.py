"""Oracles that share no code with gclip: exact rational arithmetic and the contract's rule.

- :func:`exact_power_sum`: sum |x|**p (p = 1 or 2) of float values, exactly, as a Fraction
  (each float is an integer times a power of two; Python integers add those exactly).
- :func:`exact_norm`: the L2 norm from that exact sum, correctly rounded to a float.
- :func:`contract_values`: the seed contract, scale = min(1, limit / norm) (1 for a zero
  norm), then each value rounded to 12 decimals; computed in exact arithmetic, it gives for
  each value the results a float computation may round to (one, but for values within a few
  ulps of a rounding tie).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np

DIGITS = 12  # the contract rounds to 12 decimals


def _mantissas(values) -> tuple[list[int], list[int]]:
    """Each finite float as m * 2**e with integer m (53 bits at most)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(x)):
        raise ValueError("exact sums are for finite values")
    frac, exp = np.frexp(x)  # x = frac * 2**exp, 0.5 <= |frac| < 1
    m = np.ldexp(frac, 53).astype(np.int64)  # exact: 53 bits
    return [int(v) for v in m], [int(v) - 53 for v in exp]


def exact_power_sum(values, p: int = 2) -> Fraction:
    """sum |x|**p for p in (1, 2), exactly."""
    assert p in (1, 2)
    ms, es = _mantissas(values)
    if not ms:
        return Fraction(0)
    low = min(es) * p
    total = sum(abs(m) ** p << (e * p - low) for m, e in zip(ms, es) if m)
    return Fraction(total) * Fraction(2) ** low


def exact_norm(values) -> float:
    """The L2 norm, correctly rounded (to within 2**-64 relative before the one rounding)."""
    total = exact_power_sum(values, 2)
    if total == 0:
        return 0.0
    bits = total.numerator.bit_length() - total.denominator.bit_length()
    k = max(0, (160 - bits) // 2 + 1)  # isqrt then carries >= 80 exact bits
    root = math.isqrt(total.numerator * 4**k // total.denominator)
    return float(Fraction(root, 2**k))


def gathered(comm, arrays: Iterable) -> np.ndarray:
    """Every rank's values (as float64), in rank order: the whole gradient, on every rank."""
    mine = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    local = np.concatenate(mine) if mine else np.zeros(0)
    return np.concatenate(comm.allgather(local))


class Allowed:
    """The results the contract allows for one value: a few 12-decimal numbers, or (where
    floats are coarser than 1e-12) the floats within half a unit and the slack of the exact x."""

    def __init__(self, exact: Decimal, slack: Decimal, unit: Decimal) -> None:
        scaled = exact * unit
        lo = int((scaled - Decimal("0.5") - slack).to_integral_value(rounding="ROUND_FLOOR"))
        hi = int((scaled + Decimal("0.5") + slack).to_integral_value(rounding="ROUND_CEILING"))
        self.exact, self.slack, self.unit = exact, slack, unit
        self.values: set[float] | None = None
        if hi - lo <= 8:
            near = [k for k in range(lo, hi + 1) if abs(Decimal(k) - scaled) <= Decimal("0.5") + slack]
            self.values = {float(Fraction(k, 10**DIGITS)) for k in near}

    def __contains__(self, got: float) -> bool:
        if self.values is not None:
            return got in self.values
        off = abs(Decimal(got) - self.exact) * self.unit
        return off <= Decimal("0.5") + self.slack + Decimal(math.ulp(got)) * self.unit

    def __repr__(self) -> str:
        return repr(sorted(self.values)) if self.values is not None else f"~{self.exact:.17g}"


def contract_values(
    shards: Sequence[Sequence[float]], limit: float, slack_ulps: int = 8
) -> list[list[Allowed]]:
    """For every value of every shard, what the contract allows for it.

    Exact: the norm from the exact sum of squares (80 significant digits), the scale
    min(1, limit / norm), 1 for a zero norm; then x = value * scale rounded to 12 decimals.
    A float computation of x may be off by a few ulps, which moves the 12-decimal rounding
    only when x lies within those ulps of a tie: then both neighbours are allowed.
    """
    flat = [float(v) for s in shards for v in s]
    total = exact_power_sum(flat, 2)
    unit = Decimal(10) ** DIGITS
    with localcontext() as ctx:
        ctx.prec = 80
        if total == 0:
            scale = Decimal(1)
        else:
            norm = (Decimal(total.numerator) / Decimal(total.denominator)).sqrt()
            scale = min(Decimal(1), Decimal(limit) / norm)
        out = []
        for shard in shards:
            allowed = []
            for v in shard:
                x = Decimal(float(v)) * scale  # the exact clipped value (to 80 digits)
                slack = Decimal(math.ulp(abs(float(x)))) * slack_ulps * unit if scale != 1 else Decimal(0)
                allowed.append(Allowed(x, slack, unit))
            out.append(allowed)
    return out


def follows_contract(got: Sequence[Sequence[float]], allowed: list[list[Allowed]]) -> str:
    """'' if every value is one the contract allows, else the first that is not."""
    if [len(s) for s in got] != [len(s) for s in allowed]:
        return f"layout {[len(s) for s in got]} != {[len(s) for s in allowed]}"
    for i, (values, options) in enumerate(zip(got, allowed)):
        for j, (v, ok) in enumerate(zip(values, options)):
            if v not in ok:
                return f"shard {i} value {j}: {v!r} not in {ok!r}"
    return ""
