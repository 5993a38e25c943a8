"""The audit of limits other than one max_norm: per parameter group (``--max-norms``), per unit (``--agc``).

Both are graded by the judge of the limits (:mod:`gclip.conformance.limits`), on what the ranks'
rows carry, never on the clip under test:

- per group: each group's global sum of squares (each copy once, from the pieces' holders) and
  the scale its gradients got; the candidates are each group by its own limit (correct) and one
  clip over every group (``muon-global-clip``);
- per unit (a row of a matrix, an output channel; a vector is one unit, torch's out-first
  layout as timm's): each piece's weight and gradient squares and the factor it got, a piece
  keyed by (pipeline stage, the parameter's index in its optimizer, the unit's global index), so
  the pieces of a unit that a row-parallel ``Shard(1)`` splits meet; the candidates are the
  unit's whole norms (correct) and each piece's own (``agc-shard-units``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..conformance import limits
from .verdict import Row, StepReport, _rank_scales, _same, tolerance

__all__ = ["AuditError", "grade_agc", "grade_groups", "max_norms"]


class AuditError(ValueError):
    """What the command line asked does not fit the script (one line, on every rank)."""


def max_norms(text: str) -> list[float | None]:
    """``"none,1.0"``: one limit per optimizer parameter group, ``none`` where it is not clipped."""
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == "none":
            out.append(None)
            continue
        value = float(item)  # ValueError: the command line says so
        if not value >= 0:
            raise ValueError(f"a limit must be >= 0 or none, got {item}")
        out.append(value)
    return out


def _report(
    step: int,
    rows: Sequence[Row],
    verdict: limits.LimitVerdict,
    norm: float,
    source: tuple[str, str],
    lines: list[str],
) -> StepReport:
    """``source``: (the limit in words, the option it came from)."""
    scales, _ = _rank_scales(rows, tolerance(rows))
    size = len(rows)
    head = f"gclip.audit: step {step} on {size} rank{'s' * (size != 1)} ({source[0]}; {source[1]})"
    if verdict.fingerprint is not None or not verdict.clipped:
        words = str(verdict) if verdict.fingerprint is not None else "verdict: not clipped"
    else:
        words = f"verdict: correct ({len(verdict.clipped)} clipped)"
    return StepReport(
        step,
        verdict.grade,
        verdict.fingerprint,
        (),
        norm,
        None,
        source[1],
        None,
        scales,
        None,
        [None] * size,
        bool(verdict.clipped),
        verdict.matches,
        [row.stage for row in rows],
        [head, *lines, *words.splitlines()],
        [row.holds for row in rows],
    )


def grade_groups(step: int, rows: Sequence[Row], limits_given: Sequence[float | None]) -> StepReport:
    """The step's report for per-group limits: every group's scale against its own rule."""
    found = max(row.groups for row in rows)  # a group may hold no gradient this step
    if found != len(limits_given):
        raise AuditError(
            f"--max-norms gives {len(limits_given)} limit{'s' * (len(limits_given) != 1)}, the "
            f"optimizer has {found} parameter group{'s' * (found != 1)}"
        )
    tol = tolerance(rows)
    sumsq, scales = [], []
    for g in range(found):
        pieces = [(p, row.rank) for row in rows for p in row.pieces if p.group == g]
        sumsq.append(math.fsum(p.sumsq for p, r in pieces if p.holders[0] == r))
        got = [p for p, _ in pieces if p.scale is not None]
        heavy = max(got, key=lambda p: p.sumsq, default=None)
        scale = 1.0 if heavy is None else heavy.scale
        if any(not p.uniform or not _same(p.scale, scale, max(10 * tol, 1e-6)) for p in got):
            scale = math.nan  # the group's gradients got different factors: no group rule does that
        scales.append(scale)
    verdict = limits.judge_groups(sumsq, limits_given, scales, rtol=tol)
    lines = []
    for g, (s, m, a) in enumerate(zip(sumsq, limits_given, verdict.details["attenuation"])):
        rule = "none: left alone" if m is None else f"{m:g}"
        line = f"  group {g}: norm {math.sqrt(s):.6g}, limit {rule}, scale applied {scales[g]:.6g}"
        if not _same(a, 1.0, max(10 * tol, 1e-6)):
            line += (
                f" ({a:.3g}x smaller than its rule's)" if a > 1 else f" (its rule's is {1 / a:.3g}x smaller)"
            )
        lines.append(line)
    named = ", ".join("none" if m is None else f"{m:g}" for m in limits_given)
    return _report(
        step, rows, verdict, math.sqrt(math.fsum(sumsq)), (f"per-group limits {named}", "--max-norms"), lines
    )


def grade_agc(step: int, rows: Sequence[Row], clipping: float, eps: float) -> StepReport:
    """The step's report for AGC: every unit piece's factor against the unit-wise rule."""
    pieces = [limits.Piece(tuple(unit), w_sq, g_sq, f) for row in rows for unit, w_sq, g_sq, f in row.units]
    source = (f"AGC clipping {clipping:g}, eps {eps:g}", "--agc")
    if not pieces:
        verdict = limits.LimitVerdict("pass", None, ["global"], [], {"units_split": 0, "pieces": 0})
        return _report(step, rows, verdict, 0.0, source, ["  no unit holds a gradient"])
    verdict = limits.judge_agc(pieces, clipping, eps, rtol=tolerance(rows))
    units = len({p.unit for p in pieces})
    lines = [
        f"  {units} units in {len(pieces)} pieces ({verdict.details['units_split']} units split over "
        f"ranks); the unit-wise rule clips {len(verdict.clipped)} pieces"
    ]
    norm = math.sqrt(math.fsum(p.g_sq for p in pieces))
    return _report(step, rows, verdict, norm, source, lines)
