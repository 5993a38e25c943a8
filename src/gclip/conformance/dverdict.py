"""The distributed verdict: every rank's outcome against gclip on the same ranks, and the fingerprint.

The expected arrays come from ``gclip.clip_simulated`` on the very same
per-rank inputs (the engine that runs on real ranks), and so do the gallery's:
each bug of the engine (``gclip.gallery``'s ``mode=``) and, under ``--layout``, each layout bug.
A case fails when a rank raised, returned something that is no clip, hung,
died, or returned values off by more than its dtype's tolerance. A hang whose
culprits are exactly the ranks that had nothing to clip is the fingerprint of
``skip-collective``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import gallery
from . import implied
from .hangs import rank_list
from .outcome import CaseRun
from .verdict import MATCH_SHARE, grade

__all__ = [
    "LOOSE",
    "RTOL",
    "DistCase",
    "DistVerdict",
    "Loose",
    "Variant",
    "expected_case",
    "gallery_names",
    "judge_runs",
    "rtol_of",
]

RTOL = {"float64": 1e-11, "float32": 2e-6, "float16": 2e-3}  # relative to the array's largest value
SKIP = "skip-collective"


class DistCase(NamedTuple):
    """A case as the verdict sees it: the per-rank inputs, the limit, the expected outputs."""

    label: str
    ranks: list[list[np.ndarray]]
    max_norm: float
    expected: list[list[np.ndarray]]
    norm: float  # the global norm (gclip's)
    scale: float  # the scale gclip applied


class DistVerdict(NamedTuple):
    target: str
    size: int
    cases: list[DistCase]
    runs: list[CaseRun]
    failed: list[int]
    reasons: dict[int, str]
    fingerprint: str | None
    scores: dict[str, float]
    stopped: str | None
    notes: list[str]
    grade: str
    near: str | None
    hints: dict[int, list[str]]
    benign: tuple[str, ...] = ()  # beside the fingerprint: float32 rounding, torch's epsilon
    not_run: tuple[tuple[str, int], ...] = ()  # per family whose cases crashed: how many were left

    @property
    def passed(self) -> bool:
        return not self.failed and self.stopped is None


def rtol_of(dtype: np.dtype) -> float:
    return RTOL.get(np.dtype(dtype).name, 1e-11)


def _error(got: np.ndarray, want: np.ndarray, given: np.ndarray) -> float:
    """|got - want| at its largest, relative to the array's largest expected (or given) value."""
    if want.size == 0:
        return 0.0
    g = np.asarray(got, dtype=np.float64).ravel()
    w = np.asarray(want, dtype=np.float64).ravel()
    if not np.all(np.isfinite(g)):
        return math.inf
    gap = float(np.max(np.abs(g - w)))
    top = float(np.max(np.abs(w))) or float(np.max(np.abs(np.asarray(given, dtype=np.float64))))
    return gap / top if top > 0 else (0.0 if gap == 0 else math.inf)


def _case_error(case: DistCase, run: CaseRun) -> float | None:
    """The case's largest relative error over every rank's arrays; None when a rank gave none."""
    worst = 0.0
    for given, want, rank in zip(case.ranks, case.expected, run.ranks):
        if rank.kind != "value" or rank.value is None:
            return None
        for g, w, x in zip(rank.value, want, given):
            worst = max(worst, _error(g, w, x))
    return worst


class Loose(NamedTuple):
    """A bug's outputs matched within LOOSE: a framework's own arithmetic (torch computes a
    float32 tensor's norm in float32), for a bug far coarser than that."""

    values: list[list[np.ndarray]] | None


LOOSE = 1e-5
FLOAT32 = "float32 rounding"
EPSILON = "epsilon 1e-6"
FLOAT16_TOTAL = "the all-reduce in float16"  # fp16-sumsq's total overflowing too


class Variant(NamedTuple):
    """A bug's outputs as real code computes them: with torch's epsilon (``max_norm / (norm +
    1e-6)``), in float32 (matched within LOOSE), or both. ``benign`` names those differences,
    which the verdict lists beside the bug's name."""

    values: list[list[np.ndarray]] | None
    benign: tuple[str, ...]

    @property
    def floor(self) -> float:
        return LOOSE if FLOAT32 in self.benign else 0.0


def _matches(
    case: DistCase, values: Sequence[Sequence[np.ndarray]] | None, run: CaseRun, floor: float = 0.0
) -> bool:
    """Every rank's values equal ``values`` within each array's dtype tolerance (or ``floor``)."""
    if values is None or run.lost is not None:
        return False
    for given, want, rank in zip(case.ranks, values, run.ranks):
        if rank.kind != "value" or rank.value is None or len(rank.value) != len(want):
            return False
        for g, w, x in zip(rank.value, want, given):
            if _error(g, w, x) > max(rtol_of(x.dtype), floor):
                return False
    return True


def _why(case: DistCase, run: CaseRun) -> str | None:
    """Why a case fails, naming ranks; None when it passes."""
    if run.lost is not None:
        return run.lost
    for kind in ("raised", "bad"):
        who = [r for r, rank in enumerate(run.ranks) if rank.kind == kind]
        if who:
            message = run.ranks[who[0]].message
            verb = "raised" if kind == "raised" else "returned no clip:"
            if kind == "raised" and message:
                return f"{'rank' if len(who) == 1 else 'ranks'} {rank_list(who)} raised {message}"
            return f"{'rank' if len(who) == 1 else 'ranks'} {rank_list(who)} {verb} {message}"
    wrong: list[tuple[float, int, int]] = []
    nans: list[tuple[int, int, int]] = []
    for r, (given, want, rank) in enumerate(zip(case.ranks, case.expected, run.ranks)):
        for i, (g, w, x) in enumerate(zip(rank.value or [], want, given)):
            err = _error(g, w, x)
            if err > rtol_of(x.dtype):
                wrong.append((err, r, i))
            bad = int(np.count_nonzero(np.isnan(np.asarray(g, dtype=np.float64)) & ~np.isnan(w)))
            if bad:
                nans.append((r, i, bad))
    if not wrong:
        return None
    if nans:  # NaN is no distance: say where it is
        who = sorted({r for r, _, _ in nans})
        r, i, bad = nans[0]
        return (
            f"NaN on {'rank' if len(who) == 1 else 'ranks'} {rank_list(who)}: rank {r} array {i} "
            f"has {bad} NaN value{'s' * (bad != 1)} where a number was expected"
        )
    err, r, i = max(wrong)
    who = sorted({w[1] for w in wrong})
    return (
        f"wrong values on {'rank' if len(who) == 1 else 'ranks'} {rank_list(who)}: most at rank {r} "
        f"array {i} (off by {err:.3g} of its largest value)"
    )


def _hints(case: DistCase, run: CaseRun) -> list[str]:
    """The scale each rank applied and the norm it implies (only when every rank gave values)."""
    if any(rank.kind != "value" for rank in run.ranks):
        return []
    units, tols, sharp = [], [], []
    for given, rank in zip(case.ranks, run.ranks):
        rtol = max((rtol_of(x.dtype) for x in given), default=RTOL["float64"])
        unit = implied.applied(given, rank.value or [], rtol)
        # the scale from the rank's most precise arrays alone (float64 where it has some)
        best = min((rtol_of(x.dtype) for x in given if np.any(x)), default=rtol)
        pairs = [(x, y) for x, y in zip(given, rank.value or []) if rtol_of(x.dtype) == best]
        precise = implied.applied([x for x, _ in pairs], [y for _, y in pairs], best)
        if precise.scale is not None:
            unit = unit._replace(scale=precise.scale)
        units.append(unit)
        tols.append(rtol)
        sharp.append(best)
    parts = [[float(np.sum(np.square(x, dtype=np.float64))) for x in r] for r in case.ranks]
    sumsq = [math.fsum(p) for p in parts]
    counts = [sum(x.size for x in r) for r in case.ranks]
    rtol = max(max(tols), implied.SAME)
    return implied.unit_lines(
        "rank", units, sumsq, counts, case.max_norm, case.scale, case.norm, rtol, precision=sharp, parts=parts
    )


def _nothing_to_clip(ranks: Sequence[np.ndarray]) -> bool:
    return sum(a.size for a in ranks) == 0


def _skip_signature(cases: Sequence[DistCase], runs: Sequence[CaseRun]) -> bool:
    """Every hang is ranks that had nothing to clip returning before the others' collective."""
    hung = [i for i, run in enumerate(runs) if run.lost is not None]
    if not hung:
        return False
    for i in hung:
        run = runs[i]
        empty = tuple(r for r, arrays in enumerate(cases[i].ranks) if _nothing_to_clip(arrays))
        if run.lost_kind != "skipped" or not empty or run.culprits != empty:
            return False
    return True


def fingerprint(
    cases: Sequence[DistCase],
    runs: Sequence[CaseRun],
    failed: Sequence[int],
    gallery: dict[str, list[Any]],
) -> tuple[str | None, dict[str, float]]:
    """The gallery bug whose outputs the function reproduces (as the single-process judge does)."""
    if not failed:
        return None, {}
    if _skip_signature(cases, runs):
        return SKIP, {}
    valid = [
        i for i, run in enumerate(runs) if run.lost is None and all(r.kind == "value" for r in run.ranks)
    ]
    wrong = [i for i in failed if i in set(valid)]
    if not wrong or not valid:
        return "unknown", {}
    name, scores, _ = fingerprint_with_benign(cases, runs, failed, gallery)
    return name, scores


def fingerprint_with_benign(
    cases: Sequence[DistCase],
    runs: Sequence[CaseRun],
    failed: Sequence[int],
    gallery: dict[str, list[Any]],
) -> tuple[str | None, dict[str, float], tuple[str, ...]]:
    """As ``fingerprint``, with the benign differences (float32 rounding, torch's epsilon) the
    named bug needed to match: a real clip has both, and they do not hide its bug."""
    if not failed:
        return None, {}, ()
    if _skip_signature(cases, runs):
        return SKIP, {}, ()
    valid = [
        i for i, run in enumerate(runs) if run.lost is None and all(r.kind == "value" for r in run.ranks)
    ]
    wrong = [i for i in failed if i in set(valid)]
    if not wrong or not valid:
        return "unknown", {}, ()
    scores: dict[str, float] = {}
    best: tuple[int, int, str] | None = None
    needed: dict[str, tuple[str, ...]] = {}
    for name, outputs in gallery.items():
        # which of the bug's variants (if it has several) each case's outputs equal
        matched = {i: _matching(cases[i], outputs[i], runs[i]) for i in valid}
        hits = {i for i, alt in matched.items() if alt is not None}
        explained = sum(
            i in hits and not _matches(cases[i], cases[i].expected, _as_run(matched[i][0])) for i in wrong
        )
        scores[name] = round(len(hits) / len(valid), 4)
        if explained and explained >= MATCH_SHARE * len(wrong) and len(hits) >= MATCH_SHARE * len(valid):
            if best is None or (len(hits), explained) > best[:2]:
                best = (len(hits), explained, name)
                seen = {b for i in hits for b in matched[i][1]}
                needed[name] = tuple(b for b in (FLOAT32, EPSILON, FLOAT16_TOTAL) if b in seen)
    if best is None:
        return "unknown", scores, ()
    return best[2], scores, needed[best[2]]


def _matching(case: DistCase, outputs: Any, run: CaseRun) -> tuple[Any, tuple[str, ...]] | None:
    """(the variant of a bug's outputs that the run equals, its benign differences), or None.
    A bug's outputs are one per-rank list, or a tuple of variants (readings of the same
    mistake, strictest first)."""
    for variant in outputs if isinstance(outputs, tuple) else [outputs]:
        if isinstance(variant, Variant):
            if _matches(case, variant.values, run, variant.floor):
                return variant.values, variant.benign
        elif isinstance(variant, Loose):
            if _matches(case, variant.values, run, LOOSE):
                return variant.values, ()
        elif _matches(case, variant, run):
            return variant, ()
    return None


def _as_run(values: list[list[np.ndarray]] | None) -> CaseRun:
    from .outcome import RankRun

    if values is None:
        return CaseRun([], "none")
    return CaseRun([RankRun("value", list(v)) for v in values])


def _dtype_notes(cases: Sequence[DistCase], runs: Sequence[CaseRun]) -> list[str]:
    for case, run in zip(cases, runs):
        for r, (given, rank) in enumerate(zip(case.ranks, run.ranks)):
            for i, (x, g) in enumerate(zip(given, rank.value or [])):
                if g.dtype != x.dtype:
                    return [
                        f"rank {r} returned {g.dtype} for a {x.dtype} array ({case.label}, array {i}): "
                        "a clip should keep each array's dtype (e.g. multiply by a Python float)"
                    ]
    return []


def judge_runs(
    target: str,
    size: int,
    cases: Sequence[DistCase],
    runs: Sequence[CaseRun],
    gallery: dict[str, list[Any]],
    stopped: str | None,
    note: str | None = None,
    not_run: dict[str, int] | None = None,
) -> DistVerdict:
    """The verdict on the cases that ran (``runs`` may be shorter than ``cases``)."""
    cases = list(cases[: len(runs)])
    reasons = {}
    for i, (case, run) in enumerate(zip(cases, runs)):
        why = _why(case, run)
        if why is not None:
            reasons[i] = why
    failed = sorted(reasons)
    name, scores, benign = fingerprint_with_benign(
        cases, runs, failed, {k: v[: len(runs)] for k, v in gallery.items()}
    )
    if stopped and name is None:
        name = "unknown"
    errors = [_case_error(c, r) if r.lost is None else None for c, r in zip(cases, runs)]
    level, near = grade([c.norm for c in cases], errors, failed, name, stopped)
    hints = {i: _hints(cases[i], runs[i]) for i in failed if errors[i]}
    notes = ([note] if note else []) + _dtype_notes(cases, runs)
    return DistVerdict(
        target,
        size,
        cases,
        list(runs),
        failed,
        reasons,
        name,
        scores,
        stopped,
        notes,
        level,
        near,
        hints,
        benign,
        tuple(sorted((not_run or {}).items())),
    )


def expected_case(label: str, ranks: list[list[np.ndarray]], max_norm: float, out: list) -> DistCase:
    """A DistCase from gclip's results on the ranks (``out``: ClipResults, one per rank)."""
    return DistCase(label, ranks, max_norm, [list(r.grads) for r in out], out[0].total_norm, out[0].scale)


def gallery_names(layout: bool) -> list[str]:
    names = [b.name for b in gallery.BUGS]
    if layout:
        names += [b.name for b in gallery.LAYOUT_BUGS if not b.skips_collective]
    return names
