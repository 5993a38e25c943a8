"""``gclip.testing.diagnose``: what a real training step's clip did, from its gradients before and after.

Every rank passes the gradients it held before its clip and after it. From
them: the scale each rank applied (least squares, ``implied.applied``),
whether all ranks applied the same one, the norm that scale implies, and the
true global norm (``gclip.global_norm`` on the gradients before). Each
strategy of the gallery gives the scale it would have applied on each rank
(``gclip.gallery.global_norm(..., mode=NAME)``: one small all-reduce each, no copy of
the gradients); the strategies whose scales equal the observed ones on every
rank are the matches. Every rank returns the same :class:`Diagnosis`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import gallery
from ..errors import GclipValueError
from . import implied
from .hangs import rank_list
from .verdict import NEAR_MISS_BUGS

__all__ = ["Diagnosis", "diagnose"]

RTOL = {"float64": 1e-9, "float32": 2e-6, "float16": 2e-3}  # how close two scales are "the same"


class Diagnosis(NamedTuple):
    """What one clip step did, the same on every rank."""

    scales: list[float | None]  # per rank: the scale it applied (None: it held nothing non-zero)
    same_scale: bool  # every rank applied the same scale
    uniform: list[bool]  # per rank: every value got the one scale
    implied_norms: list[float | None]  # per rank: max_norm / scale, when it clipped
    global_norm: float  # the true norm of the gradients before the clip
    expected_scale: float  # min(1, max_norm / global_norm)
    matches: list[str]  # the strategies whose scales equal the observed ones on every rank
    bug: str | None  # None: the clip is correct; a gallery bug's name; or "unknown"
    clipped: bool  # the step was clipped (else most bugs cannot be told apart)
    local_norms: list[float]  # per rank: the norm of what it holds (copies counted)
    lines: list[str]  # the report, for a learner
    grade: str = "pass"  # "pass", "near miss" (the correct clip with torch's epsilon) or "fail"
    benign: tuple[str, ...] = ()  # beside the bug: what real code adds (torch's epsilon)
    split: list[list[tuple[list[int], float]]] | None = None  # per rank, where its arrays got
    # different scales: (the arrays, their scale) for each scale; None where every rank used one
    narrowed: tuple[int, ...] = ()  # the ranks whose float64 values came back rounded to float32

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _arrays(value: Any, what: str) -> list[np.ndarray]:
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):
        value = [value]
    out = []
    for v in value:
        if hasattr(v, "detach"):  # torch
            v = v.detach().cpu().numpy()
        out.append(np.asarray(v))
    return out


def _check(before: list[np.ndarray], after: list[np.ndarray]) -> str | None:
    if len(before) != len(after):
        return f"{len(before)} arrays before the clip but {len(after)} after"
    for i, (b, a) in enumerate(zip(before, after)):
        if b.size != a.size:
            return f"array {i} has {b.size} values before the clip but {a.size} after"
        if b.dtype.kind != "f" or a.dtype.kind != "f":
            return f"array {i} is not a float array ({b.dtype} before, {a.dtype} after)"
    return None


def _same(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return True
    if math.isnan(a) or math.isnan(b):  # a NaN scale (every value NaN) is one scale
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


EPSILON = "epsilon 1e-6"  # as the command's verdict names it
FLOAT32 = "float32 rounding"
FLOAT32_OVERFLOW = "float32 overflows"  # a norm above 1.8e19 read as inf by a float32 sum of squares
SPLIT = "dense-expert-apart"


def _applied(b: list[np.ndarray], a: list[np.ndarray], rtol: float) -> implied.Applied:
    """The factor this rank's values got; NaN where every value came back NaN (a NaN scale)."""
    if any(x.size for x in a) and all(np.all(np.isnan(y)) for y in a if y.size):
        if not any(np.any(np.isnan(x)) for x in b):
            return implied.Applied(math.nan, True, 0.0, 0.0)
    return implied.applied(b, a, rtol)


def diagnose(
    before: Any,
    after: Any,
    max_norm: float,
    *,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
) -> Diagnosis:
    """What this step's clip did on every rank of ``comm`` (collective: call it on every rank).

    ``before``/``after``: this rank's gradients (a list of arrays, numpy or
    torch) before and after the clip; ``replicated``: as for
    ``gclip.clip_by_global_norm``, if some arrays are copies.
    """
    from ..drivers import communicator
    from ..engine import max_norm as checked_limit

    comm = communicator(comm)
    limit = checked_limit(max_norm)
    b, a = _arrays(before, "before"), _arrays(after, "after")
    problem = _check(b, a)
    problems = comm.allgather(problem)  # every rank raises the same error, or none does
    bad = [r for r, p in enumerate(problems) if p]
    if bad:
        raise GclipValueError(f"diagnose: rank {bad[0]}: {problems[bad[0]]}")
    rtol = max((RTOL.get(x.dtype.name, 1e-9) for x in b), default=1e-9)
    mine = _applied(b, a, rtol)
    norms = {}
    for s in (gallery.GLOBAL, *gallery.BUGS):
        if s.norm_type is None:  # inf-pow shows only with norm_type=inf: never with a 2-norm clip
            norms[s.name] = gallery.global_norm(b, comm=comm, mode=s.name, replicated=replicated)
    true_norm = norms["global"]
    would = {name: gallery.STRATEGIES[name].scale(n, limit) for name, n in norms.items()}
    # as real code computes it: max_norm / (norm + 1e-6), torch's and Megatron-LM's epsilon
    eps = {
        name: gallery.STRATEGIES[name].scale(n + gallery.TORCH_EPS, limit)
        for name, n in norms.items()
        if not gallery.STRATEGIES[name].has_epsilon
    }
    arrays = [
        (_applied([x], [y], rtol).scale, float(np.sum(np.square(x, dtype=np.float64)))) for x, y in zip(b, a)
    ]
    table = comm.allgather(
        (mine.scale, mine.uniform, rtol, would, norms["per-rank"], eps, arrays, _narrowed(b, a))
    )
    scales = [row[0] for row in table]
    uniform = [row[1] for row in table]
    tol = max(row[2] for row in table)
    told = [s for s in scales if s is not None]
    same = all(_same(s, told[0], tol) for s in told) if told else True
    expected = gallery.GLOBAL.scale(true_norm, limit)

    def matching(column: int, rtol: float) -> list[str]:
        return [
            name
            for name in table[0][column]
            if all(uniform)
            and all(_same(row[0], row[column][name], rtol) for row in table if row[0] is not None)
        ]

    # a bug that gives the correct scale on every rank cannot show in this step: not a match
    shows = {name for name in would if not all(_same(row[3][name], row[3]["global"], tol) for row in table)}
    benign: tuple[str, ...] = ()
    matches: list[str] = []
    grade = "fail"
    # the scales as computed, then as real code computes them: with torch's epsilon, in float32
    # arithmetic (a relative rounding up to NEAR_FLOAT32), or both
    loose = max(tol, implied.NEAR_FLOAT32)
    for column, rtol, extra in (
        (3, tol, ()),
        (5, tol, (EPSILON,)),
        (3, loose, (FLOAT32,)),
        (5, loose, (FLOAT32, EPSILON)),
    ):
        found = [m for m in matching(column, rtol) if m == "global" or m in shows]
        if column == 3 and "global" in found:
            matches, grade, benign = found, ("pass" if not extra else "near miss"), extra
            if extra:  # the correct clip, but for float32 rounding: the command's near miss
                matches = ["epsilon"]
            break
        if "global" in found or "epsilon" in found:  # the correct clip, with torch's epsilon
            matches, grade, benign = (
                ["epsilon", *(m for m in found if m not in ("global", "epsilon"))],
                "near miss",
                (),
            )
            break
        if found:
            matches, benign = found, extra
            if found[0] in NEAR_MISS_BUGS:  # an epsilon of its own, counted once per rank
                grade = "near miss"
            break
    if grade == "fail" and true_norm > implied.FLOAT32_NORM and told and all(t == 0.0 for t in told):
        # the norm overflows a float32 sum of squares: a float32 clip reads inf and wipes the step (as
        # the command's verdict counts such a case apart: no bug of the norm's combination)
        matches, grade, benign = [], "near miss", (FLOAT32_OVERFLOW,)
    bug: str | None = (
        None if grade == "pass" or benign == (FLOAT32_OVERFLOW,) else (matches[0] if matches else "unknown")
    )
    split = _split([row[6] for row in table], tol)
    if split is not None and bug == "unknown":
        apart = _two_norms([row[6] for row in table], split, limit, tol)
        if apart is not None:
            bug, matches, benign = SPLIT, [SPLIT], apart
    clipped = expected < 1.0 - implied.SAME or any(s is not None and s < 1.0 - tol for s in told)
    diag = Diagnosis(
        scales,
        same,
        uniform,
        [implied.implied_norm(s, limit) for s in scales],
        true_norm,
        expected,
        matches,
        bug,
        clipped,
        [row[4] for row in table],
        [],
        grade,
        benign,
        _per_rank(split, [row[6] for row in table]),
        tuple(r for r, row in enumerate(table) if row[7]),
    )
    return diag._replace(lines=_lines(diag, limit))


def _narrowed(before: list[np.ndarray], after: list[np.ndarray]) -> bool:
    """Did float64 values come back as float32 ones (each exactly a float32, where some given
    value was not)? A clip that computes in float32 does that: its scale then looks uneven by
    float32's rounding."""
    given = [x for x in before if x.dtype.itemsize == 8 and x.size]
    if not given or all(np.array_equal(x, x.astype(np.float32)) for x in given):
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        return all(
            np.array_equal(y, y.astype(np.float32), equal_nan=True)
            for x, y in zip(before, after)
            if x.dtype.itemsize == 8
        )


def _split(arrays: list[list[tuple[float | None, float]]], tol: float) -> list[float] | None:
    """The scales the arrays got, when some rank's arrays got different ones (at most two: one for
    each set of arrays clipped apart); None when every rank's arrays got one scale each."""
    found: list[float] = []
    mixed = False
    for mine in arrays:
        here: list[float] = []
        for s, _ in mine:
            if s is None:
                continue
            if not any(_same(s, t, max(tol * 10, 1e-6)) for t in here):
                here.append(s)
            if not any(_same(s, t, max(tol * 10, 1e-6)) for t in found):
                found.append(s)
        mixed = mixed or len(here) > 1
    return sorted(found, reverse=True) if mixed else None


def _which(s: float | None, scales: list[float], tol: float) -> int | None:
    if s is None:
        return None
    for k, t in enumerate(scales):
        if _same(s, t, max(tol * 10, 1e-6)):
            return k
    return None


def _two_norms(
    arrays: list[list[tuple[float | None, float]]], scales: list[float], limit: float, tol: float
) -> tuple[str, ...] | None:
    """The arrays in two sets by the scale they got, each set clipped by its own global norm (as
    two optimizers that clip apart do): the benign differences that needed, or None if not so."""
    if len(scales) != 2:
        return None
    sums = [0.0, 0.0]
    for mine in arrays:
        for s, sq in mine:
            k = _which(s, scales, tol)
            if k is not None:
                sums[k] += sq
    loose = max(tol, implied.NEAR_FLOAT32)
    for eps, rtol, benign in (
        (0.0, tol, ()),
        (gallery.TORCH_EPS, tol, (EPSILON,)),
        (0.0, loose, (FLOAT32,)),
        (gallery.TORCH_EPS, loose, (FLOAT32, EPSILON)),
    ):
        want = [gallery.GLOBAL.scale(math.sqrt(x) + eps, limit) for x in sums]
        if all(_same(w, s, rtol) for w, s in zip(want, scales)):
            return benign
    return None


def _per_rank(
    scales: list[float] | None, arrays: list[list[tuple[float | None, float]]]
) -> list[list[tuple[list[int], float]]] | None:
    if scales is None:
        return None
    out = []
    for mine in arrays:
        sets: dict[int, list[int]] = {}
        for i, (s, _) in enumerate(mine):
            k = _which(s, scales, 1e-6)
            if k is not None:
                sets.setdefault(k, []).append(i)
        out.append([(sets[k], scales[k]) for k in sorted(sets)])
    return out


def _lines(d: Diagnosis, limit: float) -> list[str]:
    size = len(d.scales)
    lines = [f"gclip.testing.diagnose: one clip step on {size} rank{'s' * (size != 1)} (max_norm {limit:g})"]
    lines.append(
        f"  global norm {d.global_norm:.6g}: the correct scale is {d.expected_scale:.6g} on every rank"
    )
    for r, (s, ok) in enumerate(zip(d.scales, d.uniform)):
        if s is not None and math.isnan(s):
            lines.append(f"  rank {r}: every value came back NaN (a NaN scale)")
            continue
        words = implied.scale_words(s, limit, implied.digits_to_tell(s or 0.0, d.expected_scale))
        norm = d.implied_norms[r]
        own = d.local_norms[r]
        if norm is not None and own > 0 and not d.same_scale and abs(norm - own) <= 1e-6 * own:
            words += ": its own norm"
        lines.append(f"  rank {r}: {words}{'' if ok else ', not one scale for all its values'}")
    for r, sets in enumerate(d.split or []):
        if len(sets) > 1:
            lines.append(implied.split_line(f"rank {r}", sets, limit))
    for r in d.narrowed:
        lines.append(
            f"  rank {r}: float64 values given, float32 values back: the clip computed in float32 "
            "(its scale looks uneven by float32's rounding; a float64 clip keeps float64's precision)"
        )
    uneven = [r for r, ok in enumerate(d.uniform) if not ok]
    if d.same_scale and uneven and set(uneven) <= set(d.narrowed):
        lines.append("  every rank applied the same scale, up to float32's rounding of the values")
    elif d.same_scale and uneven:
        lines.append("  a rank's values got different scales: a clip must apply one scale everywhere")
    elif d.same_scale:
        lines.append("  every rank applied the same scale")
    else:
        lines.append("  the ranks applied different scales: a clip must apply one scale everywhere")
    if d.grade == "near miss" and FLOAT32_OVERFLOW in d.benign:
        lines.append(
            f"verdict: near miss: the global norm is above {implied.FLOAT32_NORM:.2g}, where a sum of squares"
            " "
            "in float32 overflows: the clip read inf and wiped the step"
        )
    elif d.bug is None:
        lines.append("verdict: correct: the global-norm clip")
    elif d.grade == "near miss" and d.bug != "epsilon":
        bug = gallery.STRATEGIES[d.bug or ""]
        lines.append(f"verdict: near miss: {bug.name}: {bug.summary}")
        lines.append(f"  why it is wrong: {bug.explanation}")
    elif d.grade == "near miss":
        lines.append(
            "verdict: near miss: epsilon: the global norm, but max_norm / (norm + 1e-6) as torch does "
            "(off the exact scale by about 1e-6 / norm)"
        )
    elif d.bug == "unknown":
        lines.append("verdict: wrong, like no bug of the gallery")
    else:
        bug = gallery.STRATEGIES.get(d.bug) or gallery.LAYOUT_BUG_NAMES[d.bug]
        also = f" (with {', '.join(d.benign)})" if d.benign else ""
        lines.append(f"verdict: wrong: {bug.name}{also}: {bug.summary}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        if len(d.matches) > 1:
            lines.append(f"  (this step cannot tell it from {', '.join(d.matches[1:])})")
    if not d.clipped:
        lines.append(
            "  note: this step was not clipped (the norm is below max_norm), so most bugs look correct; "
            "diagnose a step with a larger gradient or a smaller max_norm"
        )
    wrong = [
        r
        for r, s in enumerate(d.scales)
        if s is not None and (math.isnan(s) or not math.isclose(s, d.expected_scale, rel_tol=1e-6))
    ]
    if wrong and d.bug is not None:
        lines.append(f"  ranks off the correct scale: {rank_list(wrong)}")
    return lines
