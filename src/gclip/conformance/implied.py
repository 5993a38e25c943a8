"""What scale a clip applied, and which norm that scale implies.

A clip multiplies every value by one number. Given what went in and what came
out, that number is recovered by least squares, per unit (a shard of the
single-process judge, a rank of the distributed one, a rank of a real training
step for ``gclip.testing.diagnose``). From it: the norm the function must have
used (``max_norm / scale``), compared with the true global norm and with the
norms a learner may have computed instead (their own rank's, all but one
rank's, the sum of the local norms...). This turns "unknown" into a hint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "SAME",
    "Applied",
    "applied",
    "digits_to_tell",
    "implied_norm",
    "norm_hints",
    "same_scale",
    "scale_words",
    "split_line",
    "unit_lines",
]

SAME = 1e-9  # two float64 scales closer than this (relative) are the same scale
NEAR_FLOAT32 = 3e-6  # a norm off by at most this (relative) was computed in lower precision
# above these norms a sum of squares overflows when it is computed in float32 (float16)
FLOAT32_NORM = math.sqrt(float(np.finfo(np.float32).max))
FLOAT16_NORM = math.sqrt(float(np.finfo(np.float16).max))


class Applied(NamedTuple):
    """The factor one unit was multiplied by, as well as it can be told."""

    scale: float | None  # None: nothing non-zero went in, so any factor fits
    uniform: bool  # every value got that factor (within the tolerance)
    departure: float  # the largest |after - scale * before|
    top: float  # the largest |before|: how well the scale can be told (departure / top)


def applied(
    before: Sequence[np.ndarray], after: Sequence[np.ndarray], rtol: float, atol: float = 0.0
) -> Applied:
    """The least-squares factor after ~ scale * before, over all of a unit's values.

    ``rtol`` is the relative precision of the values (their dtype's), ``atol``
    an absolute one (the contract's rounding to 12 decimals)."""
    b = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in before] or [np.zeros(0)])
    a = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in after] or [np.zeros(0)])
    if b.shape != a.shape or not np.all(np.isfinite(a)):
        return Applied(None, False, math.inf, 0.0)
    top = float(np.max(np.abs(b))) if b.size else 0.0
    if top == 0.0:
        return Applied(None, True, 0.0, 0.0)
    bb, ab = float(np.dot(b / top, b / top)), float(np.dot(a / top, b / top))
    scale = ab / bb
    departure = float(np.max(np.abs(a - scale * b)))
    return Applied(scale, departure <= atol + rtol * max(abs(scale), rtol) * top, departure, top)


def same_scale(a: float | None, b: float | None, rtol: float = SAME) -> bool:
    if a is None or b is None:
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


def implied_norm(scale: float | None, max_norm: float) -> float | None:
    """The norm a scale implies: max_norm / scale when it clipped; None when it cannot tell."""
    if scale is None or scale <= 0.0 or scale >= 1.0 - SAME:
        return math.inf if scale == 0.0 and max_norm > 0 else None
    return max_norm / scale


def scale_words(scale: float | None, max_norm: float, digits: int = 6) -> str:
    """'scale 0.4 (implies norm 5)', 'left unchanged (scale 1)', 'nothing to scale'."""
    if scale is None:
        return "nothing to scale"
    if abs(scale - 1.0) <= SAME:
        return "left unchanged (scale 1)"
    norm = implied_norm(scale, max_norm)
    if norm is None:
        return f"scale {scale:.{digits}g}"
    return f"scale {scale:.{digits}g} (implies norm {norm:.{digits}g})"


def digits_to_tell(a: float, b: float, same: float = SAME) -> int:
    """Significant digits that show two close numbers apart (6 when they are far apart, or
    closer than ``same``, relative)."""
    gap = abs(a - b) / max(abs(a), abs(b), 1e-300)
    if gap <= same or gap >= 1e-5:
        return 6
    return min(15, math.ceil(-math.log10(gap)) + 2)


FLOAT32_ROUNDING = 2.0**-21  # scales this close (relative) may differ by float32 roundings alone


def split_line(unit: str, sets: Sequence[tuple[Sequence[int], float | None]], max_norm: float) -> str:
    """'  rank 0's arrays were scaled differently: array 0: scale 0.4 (implies norm 5); arrays 1, 2:
    ...', each scale with the digits that tell it from the others; where they are apart by no more
    than float32 roundings, it says so (values rounded to float32 on the way give such scales)."""
    scales = [s for _, s in sets if s is not None]
    digits = max([digits_to_tell(a, b) for a in scales for b in scales] or [6])
    parts = "; ".join(
        f"array{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}: {scale_words(s, max_norm, digits)}"
        for ids, s in sets
    )
    line = f"  {unit}'s arrays were scaled differently: {parts}"
    top = max(scales, default=0.0)
    if len(scales) > 1 and top > 0 and (top - min(scales)) / top <= FLOAT32_ROUNDING:
        line += " (apart by float32 rounding alone: were the values rounded to float32?)"
    return line


def norm_hints(
    norm: float,
    sumsq: Sequence[float],
    counts: Sequence[int],
    kind: str,
    rtol: float = SAME,
    global_norm: float | None = None,
    parts: Sequence[Sequence[float]] | None = None,
) -> list[str]:
    """What a norm equals, among the norms a clip may compute by mistake.

    ``sumsq[u]`` and ``counts[u]`` are unit u's sum of squares and element
    count; ``rtol`` how close it must be to be the global norm (the values'
    precision). Returns phrases such as "the norm without rank 2", best first.
    ``global_norm``: the true one when units hold copies (a layout), so that
    the sum over units counts some values more than once. ``parts[u]``: unit
    u's sum of squares array by array, when a unit holds several (a rank's
    list): then each unit's first or last array left out is a candidate too.
    """
    local = [math.sqrt(s) for s in sumsq]
    total = math.fsum(sumsq)
    every = math.sqrt(total)
    exact = every if global_norm is None else global_norm
    units = len(sumsq)
    candidates: list[tuple[str, float]] = [("the global norm", exact)]
    if abs(every - exact) > rtol * exact:
        candidates.append((f"the norm of every value on every {kind}, copies counted each time", every))
    elif parts is not None:  # an off-by-one over each unit's list (copies would blur it)
        for which, pick in (("first", 0), ("last", -1)):
            left = math.fsum(p[pick] for p in parts if p)
            candidates.append(
                (f"the norm without each {kind}'s {which} array", math.sqrt(max(0.0, total - left)))
            )
    if units > 1:
        for k in range(units):
            if sumsq[k] > 0:
                rest = math.sqrt(max(0.0, math.fsum(sumsq) - sumsq[k]))
                candidates.append((f"the norm without {kind} {k} (its values left out)", rest))
        candidates += [
            ("the sum of the local norms (norms added instead of squares)", math.fsum(local)),
            ("the largest local norm", max(local)),
            ("the mean of the local norms", math.fsum(local) / units),
            (f"{kind} 0's own norm", local[0]),
        ]
    n = sum(counts)
    if n > 1:
        candidates.append(
            ("the root-mean-square (the norm divided by sqrt of the element count)", exact / math.sqrt(n))
        )
    if exact > 0 and abs(norm - exact) <= rtol * exact:
        return ["the global norm"]
    loose = max(rtol, 1e-7)
    # a candidate equal to the global norm here (one rank holds every value) explains no difference;
    # real code adds torch's epsilon and sums in float32: a candidate is still named through them
    found = []
    for name, value in candidates[1:]:
        if value <= 0 or abs(value - exact) <= max(loose, NEAR_FLOAT32) * exact:
            continue
        benign = _benign(norm, value, loose, abs(value - exact) > 1e-7)
        if benign is not None:
            found.append(name + benign)
    if not found and exact > 0:
        off = (norm - exact) / exact
        if abs(norm - exact - 1e-6) <= 1e-8 + rtol * exact:  # 1e-6 give or take 1%, or the precision
            found.append("the global norm + 1e-6 (an epsilon added to the norm, as torch does)")
        elif abs(off) <= NEAR_FLOAT32:
            found.append(f"the global norm off by {off:+.2g} relative (rounding, e.g. float32 arithmetic)")
        else:
            found.append(f"no norm we know ({norm / exact:.4g} times the global norm)")
    return found


def _benign(norm: float, value: float, loose: float, beyond_epsilon: bool = True) -> str | None:
    """How ``norm`` is ``value``: '' exactly (within ``loose``), ' + 1e-6 (torch's epsilon)',
    ', off by float32 rounding', both; None when it is not. ``beyond_epsilon``: the value differs
    from the global norm by more than the epsilon blurs (else the epsilon cannot tell them apart)."""
    for eps, tol, words in (
        (0.0, loose, ""),
        (1e-6, loose, " + 1e-6 (torch's epsilon)"),
        (0.0, NEAR_FLOAT32, ", off by float32 rounding"),
        (1e-6, NEAR_FLOAT32, " + 1e-6 (torch's epsilon), off by float32 rounding"),
    ):
        if eps and not beyond_epsilon:
            continue
        if abs(norm - value - eps) <= tol * value + (1e-8 if eps else 0.0):
            return words
    return None


def unit_lines(
    kind: str,
    applied_by_unit: Sequence[Applied],
    sumsq: Sequence[float],
    counts: Sequence[int],
    max_norm: float,
    expected_scale: float,
    global_norm: float,
    rtol: float = SAME,
    precision: Sequence[float] | None = None,
    parts: Sequence[Sequence[float]] | None = None,
) -> list[str]:
    """Short lines for a learner: the scale each unit applied, against the expected one.

    ``rtol``: how close two units' scales must be to count as one (the values' precision);
    ``precision``: per unit, how precisely its scale is known (default ``rtol``): where every
    unit applied one scale, the most precise unit's is compared with the expected one."""
    told = [(u, a) for u, a in enumerate(applied_by_unit) if a.scale is not None]
    scales = [a.scale or 0.0 for _, a in told]
    known = [rtol] * len(applied_by_unit) if precision is None else list(precision)
    digits = max(
        [digits_to_tell(a.scale or 0.0, expected_scale, min(known[u], SAME)) for u, a in told] or [6]
    )
    lines = [
        f"expected: scale {expected_scale:.{digits}g} on every {kind} "
        f"(global norm {global_norm:.{digits}g}, max_norm {max_norm:g})"
    ]
    if not told:
        return lines
    odd = [u for u, a in told if not a.uniform]
    if len(odd) == 1:
        lines.append(f"{kind} {odd[0]}: not one scale (its values were scaled by different factors)")
    elif odd:
        lines.append(
            f"{kind}s {', '.join(map(str, odd))}: not one scale (values scaled by different factors)"
        )
    if all(same_scale(s, scales[0], rtol) for s in scales):
        best = min(told, key=lambda ua: known[ua[0]])
        s, sharp = best[1].scale or 0.0, known[best[0]]
        words = scale_words(s, max_norm, digits)
        if same_scale(s, expected_scale, sharp):
            lines.append(f"applied: the same {words} on every {kind}, as expected")
            return lines
        if same_scale(s, expected_scale, rtol):  # within the values' precision, yet the case fails
            off = (s - expected_scale) / expected_scale
            lines.append(f"applied: the same {words} on every {kind}, {off:+.2g} relative off the expected")
        else:
            lines.append(f"applied: the same {words} on every {kind}")
        norm = implied_norm(s, max_norm)
        if norm is not None and math.isfinite(norm):
            hints = norm_hints(norm, sumsq, counts, kind, sharp, global_norm, parts)
            lines.append(f"  the implied norm {norm:.{digits}g} is {'; or '.join(hints)}")
        elif norm == math.inf and 0 < global_norm < math.inf:
            lines.append(
                f"  the implied norm is inf, the global norm {global_norm:.6g}: {_overflow(global_norm)}"
            )
        elif abs(s - 1.0) <= SAME and global_norm > max_norm:
            lines.append(f"  left unchanged although the global norm {global_norm:.6g} is above max_norm")
        elif abs(s - 1.0) <= SAME:  # nothing to clip, yet the values moved by a rounding's worth
            lines.append(
                f"  the global norm {global_norm:.6g} is within max_norm: a clip leaves the values as "
                f"they are, and these were scaled by {s - 1.0:+.2g} relative"
            )
        return lines
    lines.append(f"applied: different scales on different {kind}s (a clip must apply one scale everywhere)")
    for u, a in told:
        norm = implied_norm(a.scale, max_norm)
        own = ""
        if norm is not None and math.isfinite(norm) and sumsq[u] > 0:
            mine = math.sqrt(sumsq[u])
            if abs(norm - mine) <= max(rtol, 1e-7) * norm:
                own = ": its own norm"
            elif abs(norm - mine - 1e-6) <= 1e-8 + rtol * norm:  # torch's clip_grad_norm_ on its shard
                own = ": its own norm + 1e-6 (torch's epsilon)"
        lines.append(f"  {kind} {u}: {scale_words(a.scale, max_norm, digits)}{own}")
    return lines


def _overflow(global_norm: float) -> str:
    """Why a clip may have seen an infinite norm where the global one is finite."""
    if global_norm >= FLOAT32_NORM:
        return f"its sum of squares overflowed (in float32 it does above a norm of {FLOAT32_NORM:.2g})"
    if global_norm >= FLOAT16_NORM:
        return f"its sum of squares overflowed (in float16 it does above a norm of {FLOAT16_NORM:.3g})"
    return "a scale of 0 (did its norm overflow?)"
