"""One audited step, graded: the true norm, the scales each rank applied, the bug they match.

Every rank sends one small row (``Row``): its rank, its pipeline stage, and per local
gradient the ranks holding identical copies of it (the first one counts it), its sum of
squares as backward left it, its size and the factor the optimizer's gradient is of it
(``capture.factor``). From the rows, the same on every rank:

- the true global norm (each copy once, every stage, every shard);
- the scale each rank applied (one per rank, or per array where a rank's arrays differ);
- the norm each candidate clip computes on each rank: the correct one, the gallery's bugs of
  how norms combine (``gclip.gallery.BUGS``: per-rank, rank 0's, the sum, mean or largest of
  the local norms, the RMS), the layout bugs a training script shows (``gclip.gallery.LAYOUT_BUGS``:
  replicas summed, stages apart) and the never-scaled step (``gclip.gallery.USAGE_BUGS``); the
  scales those norms give, as exactly (``min(1, max_norm / norm)``), with torch's epsilon
  (``norm + 1e-6``), or to float32's rounding, are compared with the applied ones, as
  ``gclip.testing.diagnose`` grades a step.

Grades as the judge's: ``pass`` (the correct scale, to the gradients' rounding), ``near miss``
(the correct norm through torch's epsilon or float32 rounding), ``fail`` (a bug's name, or
``unknown``). A step whose norm is within max_norm, left unchanged, passes and says it was
not clipped (most bugs look correct there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import gallery
from ..conformance import implied
from .capture import RTOL

__all__ = ["NEVER_SCALED", "Piece", "Row", "StepReport", "grade_step"]

EPSILON = "epsilon 1e-6"
FLOAT32 = "float32 rounding"


class Piece(NamedTuple):
    """One local gradient of one rank."""

    holders: tuple[int, ...]  # the ranks holding identical copies (this rank alone: a shard)
    copies: str  # what the copies are: "dp" (data-parallel replicas), "tp", or "" (none)
    sumsq: float  # its sum of squares as backward left it
    count: int
    scale: float | None  # the factor the optimizer's gradient is of it (None: it was zero)
    uniform: bool  # every value got that factor
    dtype: str
    placed: bool = False  # a DTensor's local piece (its placements say who holds copies)
    seen: bool = True  # a backward left this gradient (False: nothing to compare it with)
    group: int = 0  # its optimizer's parameter group (the audit's --max-norms)


class Row(NamedTuple):
    """What one rank sends for one step."""

    rank: int
    stage: int | None  # its pipeline stage, where it has one
    pieces: list[Piece]
    max_norm: float | None  # the max_norm a clip function was called with this step
    clip_norm: float | None  # the total norm passed to clip_grads_with_norm_, or returned by a clip
    holds: str = ""  # what its gradients are: "6 DTensor (Shard(dim=0),) on mesh (4,)", "4 DDP"...
    units: tuple = ()  # the audit's --agc: (unit, weight squares, gradient squares, factor) it counts
    groups: int = 1  # its optimizer's parameter groups (the audit's --max-norms)


NEVER_SCALED = "never-scaled"  # the gallery's usage bug: the norm right, no gradient scaled
# per-rank on DTensors: how code comes to it there (a DTensor's norm is a Partial norm)
SHARD_ITEM = (
    "  on DTensor gradients: each rank's norm is its local shard's, as .item() or .to_local() of a "
    "DTensor's Partial norm reads it (pytorch #144054; LlamaFactory PR #10640 clipped by it): reduce "
    "it first (.full_tensor())"
)


class StepReport(NamedTuple):
    """One audited step, the same on every rank."""

    step: int
    grade: str  # "pass", "near miss", "fail"
    fingerprint: str | None  # None: correct; a bug's name; "unknown"
    benign: tuple[str, ...]
    global_norm: float
    max_norm: float | None
    max_norm_from: str  # "--max-norm", "the clip call", "inferred", "unknown"
    expected_scale: float | None
    scales: list[float | None]  # per rank (NaN: its values came back non-finite)
    split: list[list[tuple[list[int], float]]] | None  # per rank, where its arrays got different scales
    implied_norms: list[float | None]
    clipped: bool
    matches: list[str]
    stages: list[int | None]
    lines: list[str]
    holds: list[str]  # per rank: what its gradients are (DTensors and their placements, DDP's, plain)

    def as_json(self) -> dict[str, Any]:
        """The judge's keys: grade, fingerprint, passed, and the numbers."""
        return {
            "step": self.step,
            "passed": self.grade == "pass",
            "grade": self.grade,
            "fingerprint": self.fingerprint,
            "fingerprint_benign": list(self.benign),
            "global_norm": self.global_norm,
            "max_norm": self.max_norm,
            "max_norm_from": self.max_norm_from,
            "expected_scale": self.expected_scale,
            "scales": self.scales,
            "split": self.split,
            "implied_norms": self.implied_norms,
            "clipped": self.clipped,
            "matches": self.matches,
            "ranks": len(self.scales),
            "stages": self.stages,
            "holds": self.holds,
        }

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _same(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return True
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


def _card(name: str) -> Any:
    found = gallery.STRATEGIES.get(name) or gallery.LAYOUT_BUG_NAMES.get(name)
    return found or gallery.LIMIT_BUG_NAMES.get(name) or gallery.USAGE_BUG_NAMES[name]


def candidate_norms(rows: Sequence[Row]) -> dict[str, list[float]]:
    """Per candidate clip, the norm it computes on each rank (the correct one first)."""
    size = len(rows)
    own = [math.fsum(p.sumsq for p in row.pieces if p.holders[0] == row.rank) for row in rows]
    every = [math.fsum(p.sumsq for p in row.pieces) for row in rows]
    true = math.sqrt(math.fsum(own))
    out: dict[str, list[float]] = {"global": [true] * size, "per-rank": [math.sqrt(e) for e in every]}
    stages = [row.stage for row in rows]
    if len({s for s in stages if s is not None}) > 1:
        out["pp-stages-apart"] = [
            math.sqrt(math.fsum(own[q] for q in range(size) if stages[q] == stages[r])) for r in range(size)
        ]
    # every copy counted: replicas (DDP, HSDP) or TP duplicates summed as if shards; all of
    # them, or only the plain tensors' (declared shards), the DTensors read from their placements
    for plain_only in (False, True):
        summed = [(p, row.rank) for row in rows for p in row.pieces if not (plain_only and p.placed)]
        kinds = {p.copies for p, _ in summed if len(p.holders) > 1}
        if not kinds:
            continue
        name = "dp-replicas-summed" if "dp" in kinds else "tp-duplicates-summed"
        total = math.fsum(p.sumsq for p, r in summed) + math.fsum(
            p.sumsq
            for row in rows
            for p in row.pieces
            if plain_only and p.placed and p.holders[0] == row.rank
        )
        if name not in out:
            out[name] = [math.sqrt(total)] * size
        else:
            out[f"{name} (plain tensors)"] = [math.sqrt(total)] * size
    norms = [math.sqrt(o) for o in own]
    count = sum(p.count for row in rows for p in row.pieces if p.holders[0] == row.rank)
    out["rank0-norm"] = [norms[0]] * size
    out["sum-of-norms"] = [math.fsum(norms)] * size
    out["mean-of-norms"] = [math.fsum(norms) / size] * size
    out["max-of-norms"] = [max(norms)] * size
    out["rms"] = [true / math.sqrt(count) if count else 0.0] * size
    return out


def tolerance(rows: Sequence[Row]) -> float:
    """How closely a scale is read: the rounding of the coarsest dtype among the gradients."""
    return max((RTOL.get(p.dtype, 1e-2) for row in rows for p in row.pieces), default=1e-9)


def _scale(norm: float, max_norm: float, eps: float = 0.0) -> float:
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + eps)) if norm + eps > 0 else 1.0


Sets = list[list[tuple[list[int], float]]]  # per rank: (the arrays, their scale) for each scale


def _rank_scales(rows: Sequence[Row], tol: float) -> tuple[list[float | None], Sets | None]:
    """One scale per rank, and per rank the arrays' sets where some rank's arrays got different ones."""
    scales: list[float | None] = []
    sets: list[list[tuple[list[int], float]]] = []
    mixed = False
    for row in rows:
        found: list[tuple[list[int], float]] = []
        for i, p in enumerate(row.pieces):
            if p.scale is None:
                continue
            for ids, s in found:
                if _same(s, p.scale, max(10 * tol, 1e-6)):
                    ids.append(i)
                    break
            else:
                found.append(([i], p.scale))
        mixed = mixed or len(found) > 1 or any(not p.uniform for p in row.pieces if p.scale is not None)
        sets.append(found)
        if not found:
            scales.append(None)
        else:  # the scale most of its values got
            weight = {k: sum(row.pieces[i].sumsq for i in ids) for k, (ids, _) in enumerate(found)}
            scales.append(found[max(weight, key=lambda k: weight[k])][1])
    return scales, (sets if mixed else None)


def grade_step(
    step: int,
    rows: Sequence[Row],
    max_norm: float | None,
    given: bool,
    more: dict[str, list[float]] | None = None,
    source: str | None = None,
) -> StepReport:
    """The step's report, from every rank's row; ``max_norm`` given on the command line or
    None (then the clip call's, else inferred from the scales). ``more``: candidates of the
    caller's (an adaptive clipper's bugs), per rank the norm that gives their scale at
    ``max_norm``, tried right after the correct clip; ``source``: where ``max_norm`` came from."""
    tol = tolerance(rows)
    loose = max(tol, implied.NEAR_FLOAT32)
    norms = candidate_norms(rows)
    if more:
        norms = {"global": norms.pop("global"), **more, **norms}
    true = norms["global"][0]
    scales, split = _rank_scales(rows, tol)
    told = [s for s in scales if s is not None]
    source = source or ("--max-norm" if given else "unknown")
    if max_norm is None:
        seen = {row.max_norm for row in rows if row.max_norm is not None}
        if len(seen) == 1:
            max_norm, source = seen.pop(), "the clip call"
    if max_norm is None and told and any(s < 1.0 - loose for s in told):
        max_norm, source = _infer(norms, scales, loose), "inferred"
    matches: list[str] = []
    benign: tuple[str, ...] = ()
    fingerprint: str | None = None
    unchanged = bool(told) and all(_same(s, 1.0, tol) for s in told)
    if max_norm is None:  # nothing scaled and no limit known: nothing to grade against
        expected = None
        grade = "pass"
        clipped = False
    else:
        expected = _scale(true, max_norm)
        clipped = expected < 1.0 - tol
        grade, fingerprint, matches, benign = _match(norms, scales, split, max_norm, tol, loose)
        if grade == "fail" and clipped and unchanged and split is None:
            # a bug whose norm is within max_norm leaves the step alone too: named beside it
            fingerprint, matches, benign = NEVER_SCALED, [NEVER_SCALED, *matches], ()
    implied_norms = [implied.implied_norm(s, max_norm) if max_norm is not None else None for s in scales]
    report = StepReport(
        step,
        grade,
        fingerprint,
        benign,
        true,
        max_norm,
        source,
        expected,
        scales,
        split,
        implied_norms,
        clipped,
        matches,
        [row.stage for row in rows],
        [],
        [row.holds for row in rows],
    )
    return report._replace(lines=_lines(report, rows))


def _infer(norms: dict[str, list[float]], scales: list[float | None], loose: float) -> float | None:
    """The max_norm the scales imply, read through the first candidate they fit (the correct
    clip first): each rank's scale times that candidate's norm there."""
    for values in norms.values():
        implied_max = [s * n for s, n in zip(scales, values) if s is not None and s < 1.0 - loose]
        if not implied_max or not all(_same(m, implied_max[0], 4 * loose) for m in implied_max):
            continue
        left = [n for s, n in zip(scales, values) if s is not None and s >= 1.0 - loose]
        if all(n <= implied_max[0] * (1 + 4 * loose) for n in left):  # those within the limit, unscaled
            return implied_max[0]
    return None


def _match(
    norms: dict[str, list[float]],
    scales: list[float | None],
    split: Any,
    max_norm: float,
    tol: float,
    loose: float,
) -> tuple[str, str | None, list[str], tuple[str, ...]]:
    if split is not None:
        return "fail", "unknown", [], ()
    correct = [_scale(n, max_norm) for n in norms["global"]]

    def fits(values: list[float], eps: float, rtol: float) -> bool:
        return all(_same(s, _scale(n, max_norm, eps), rtol) for s, n in zip(scales, values) if s is not None)

    shows = {
        name
        for name, values in norms.items()
        if not all(_same(_scale(n, max_norm), c, loose) for n, c in zip(values, correct))
    }
    ways = ((0.0, tol, ()), (gallery.TORCH_EPS, tol, (EPSILON,)), (0.0, loose, (FLOAT32,)))
    ways += ((gallery.TORCH_EPS, loose, (FLOAT32, EPSILON)),)
    for eps, rtol, extra in ways:
        if fits(norms["global"], eps, rtol):
            if not extra:
                return "pass", None, ["global"], ()
            return "near miss", "epsilon", ["epsilon"], tuple(e for e in extra if e != EPSILON)
        found = [name for name in norms if name in shows and fits(norms[name], eps, rtol)]
        found = list(dict.fromkeys(name.split(" (")[0] for name in found))  # a variant is its bug
        if found:
            return "fail", found[0], found, extra
    return "fail", "unknown", [], ()


def _lines(d: StepReport, rows: Sequence[Row]) -> list[str]:
    size = len(d.scales)
    limit = d.max_norm
    head = f"gclip.audit: step {d.step} on {size} rank{'s' * (size != 1)}"
    if limit is None:
        head += " (max_norm unknown: pass --max-norm)"
    else:
        head += f" (max_norm {limit:g}, {'given' if d.max_norm_from == '--max-norm' else d.max_norm_from})"
    lines = [head]
    if d.expected_scale is None:
        lines.append(f"  global norm {d.global_norm:.6g}")
    else:
        correct = f"the correct scale is {d.expected_scale:.6g} on every rank"
        lines.append(f"  global norm {d.global_norm:.6g}: {correct}")
    if d.step == 0 and d.holds:
        lines.append(f"  rank 0 holds {d.holds[0]}")
    if len({s for s in d.stages if s is not None}) > 1:
        lines.append(f"  pipeline stages by rank: {', '.join(str(s) for s in d.stages)}")
    for r, s in enumerate(d.scales):
        if s is not None and math.isnan(s):
            lines.append(f"  rank {r}: its values came back inf or NaN")
            continue
        words = implied.scale_words(s, limit if limit is not None else 1.0)
        if limit is None and s is not None and abs(s - 1.0) > implied.SAME:
            words = f"scale {s:.6g}"
        lines.append(f"  rank {r}: {words}")
    for r, sets in enumerate(d.split or []):
        if len(sets) > 1:
            lines.append(implied.split_line(f"rank {r}", sets, limit if limit is not None else 1.0))
    told = [s for s in d.scales if s is not None]
    if not told:
        lines.append("  no rank holds a non-zero gradient")
    if d.expected_scale is None:
        lines.append("verdict: not clipped (no gradient scaled; the limit is unknown, so nothing to grade)")
    elif not d.clipped and d.grade == "pass":
        lines.append(
            "verdict: not clipped: the global norm is within max_norm and the gradients were left "
            "alone, as they should (most bugs look correct on such a step)"
        )
    elif d.fingerprint is None:
        lines.append("verdict: correct: the global-norm clip")
    elif d.grade == "near miss":
        also = f" (with {', '.join(d.benign)})" if d.benign else ""
        lines.append(f"verdict: near miss: epsilon{also}: the global norm, as torch computes it")
    elif d.fingerprint == "unknown":
        lines.append("verdict: wrong, like no bug of the gallery (see the scales above)")
    else:
        bug = _card(d.fingerprint)
        also = f" (with {', '.join(d.benign)})" if d.benign else ""
        lines.append(f"verdict: wrong: {bug.name}{also}: {bug.summary}")
        if bug.incident:
            lines.append(f"  seen in: {bug.incident}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        if bug.name == "per-rank" and any(p.placed for row in rows for p in row.pieces):
            lines.append(SHARD_ITEM)
        if len(d.matches) > 1:
            lines.append(f"  (this step cannot tell it from {', '.join(d.matches[1:])})")
    return lines
