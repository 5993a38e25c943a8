"""Judging: each outcome against ``gclip.clip_shards``, and the fingerprint of a failure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .. import gallery
from ..contract import DIGITS, clip_shards, rounded
from ..gallery import BUGS, clip_simulated
from . import implied
from .cases import Case, make_cases
from .target import Target
from .worker import Outcome, start

__all__ = [
    "ABS_TOL",
    "MATCH_SHARE",
    "MAX_LOST",
    "NEAR_MISS",
    "NEAR_MISS_BUGS",
    "REL_TOL",
    "Verdict",
    "check",
    "fingerprint",
    "grade",
    "judge",
]

ABS_TOL = 1e-11  # the contract rounds to 12 decimals: one flip of the last digit is 1e-12
REL_TOL = 1e-12  # sums in another order differ by a few ulps, ~1e-15 relative
MATCH_SHARE = 0.95  # a bug must reproduce this share of the outputs (and of the failures)
MAX_LOST = 3  # calls that hang or crash the worker before the judge stops calling
NEAR_MISS = 1e-5  # failures all within this (relative) are a near miss, not a bug of the norm
NEAR_MISS_BUGS = ("epsilon", "epsilon-per-rank")  # gallery bugs that are near misses on all but tiny norms
SMALL_NORM = 1e-3  # an epsilon of 1e-6 is a near miss only for norms well above it


class Verdict(NamedTuple):
    target: str
    cases: list[Case]
    outcomes: list[Outcome]
    expected: list[list[list[float]]]
    failed: list[int]  # indices into cases
    reasons: dict[int, str]
    fingerprint: str | None
    scores: dict[str, float]
    stopped: str | None
    note: str | None
    grade: str  # "pass", "near miss" or "fail"
    near: str | None  # a near miss: by how much it misses
    hints: dict[int, list[str]]  # per failed case: the scale each shard applied, the norm it implies

    @property
    def passed(self) -> bool:
        return not self.failed and self.stopped is None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ABS_TOL + REL_TOL * abs(b)


def _same(actual: list, expected: list) -> bool:
    """Same layout, and every value within the tolerance."""
    return _layout(actual) == _layout(expected) and all(
        _close(a, b) for ra, rb in zip(actual, expected) for a, b in zip(ra, rb)
    )


def _layout(rows: list) -> list[int]:
    return [len(r) for r in rows]


def check(case: Case, expected: list, outcome: Outcome) -> str | None:
    """Why the outcome fails the case, or None when it passes."""
    if outcome.value is None:
        return outcome.problem
    actual = outcome.value
    if _layout(actual) != _layout(expected):
        return f"wrong layout: {len(actual)} shards of widths {_layout(actual)}, expected {_layout(expected)}"
    pairs = [
        (a, b, i, j)
        for i, (ra, rb) in enumerate(zip(actual, expected))
        for j, (a, b) in enumerate(zip(ra, rb))
    ]
    wrong = [(abs(a - b) if math.isfinite(a) else math.inf, i, j) for a, b, i, j in pairs if not _close(a, b)]
    nans = [(i, j) for a, b, i, j in pairs if math.isnan(a) and not math.isnan(b)]
    if nans:  # NaN is no distance: say where it is
        i, j = nans[0]
        nan = f"{len(nans)} NaN (first at shard {i} item {j})"
        return f"wrong values: {len(wrong)} of {len(pairs)} differ, {nan}"
    if wrong:
        gap, i, j = max(wrong)
        return f"wrong values: {len(wrong)} of {len(pairs)} differ, most at shard {i} item {j} (by {gap:.6g})"
    differ = [(abs(a - b), i, j, a, b) for a, b, i, j in pairs if a != b]
    if case.exact and differ:
        gap, i, j, a, b = max(differ)
        return (
            f"off by {gap:.2g} (shard {i} item {j} is {a!r}, expected {b!r}): "
            "the contract's checks compare exactly, so round to 12 decimals"
        )
    loose = [(a, i, j) for a, _, i, j in pairs if a != round(a, DIGITS)]
    if loose:
        a, i, j = loose[0]
        return f"not rounded to 12 decimals (shard {i} item {j} is {a!r})"
    return None


def _bug_outputs(cases: Sequence[Case]) -> dict[str, list[list | None]]:
    """Each gallery bug's rounded outputs on the cases, one simulated rank per shard; for a bug
    without an epsilon, a tuple (its outputs, the same with torch's epsilon), as real code has it."""
    out: dict[str, list[list | None]] = {}
    for bug in BUGS:
        rows: list[list | None] = []
        for case in cases:
            if not case.shards:
                rows.append([])
                continue
            try:
                ranks = [[np.asarray(s, dtype=np.float64)] for s in case.shards]
                results = clip_simulated(ranks, case.limit, mode=bug.name)
                plain = [rounded(r.grads[0]) for r in results]
                if bug.epsilon:
                    rows.append(plain)
                    continue
                scales = [r.scale if r.scale < 1.0 else 1.0 for r in results]
                eps = [
                    rounded(g[0] * (case.limit / (case.limit / s + gallery.TORCH_EPS) if 0 < s < 1 else s))
                    for g, s in zip(ranks, scales)
                ]
                rows.append((plain, eps))  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - a bug that cannot run on this data never matches
                rows.append(None)
        out[bug.name] = rows
    return out


def _same_any(actual: list, row: list | tuple | None) -> list | None:
    """The variant of a bug's row that ``actual`` equals, or None."""
    if row is None:
        return None
    for variant in row if isinstance(row, tuple) else (row,):
        if _same(actual, variant):
            return variant
    return None


def fingerprint(
    cases: Sequence[Case], expected: Sequence[list], outcomes: Sequence[Outcome], failed: Sequence[int]
) -> tuple[str | None, dict[str, float]]:
    """The gallery bug that reproduces the implementation's outputs, or "unknown".

    A bug matches when its outputs equal the implementation's on at least
    MATCH_SHARE of the cases that returned a value, and it explains at least
    MATCH_SHARE of the wrong values: on those cases the bug itself is wrong,
    in the same way. Results wrong only in their rounding are no wrong values:
    an unrounded per-rank clip is still per-rank. Bugs that need inf-norms, replicated tensors or float16
    overflow give the correct result on most contract data: they explain no
    failure and so never match by accident.
    """
    if not failed:
        return None, {}
    valid = [i for i, o in enumerate(outcomes) if o.value is not None]
    # wrong values only: a result right but for its rounding says nothing of the norm
    wrong = [i for i in failed if outcomes[i].value is not None and not _same(outcomes[i].value, expected[i])]
    if not wrong:
        return "unknown", {}
    scores: dict[str, float] = {}
    best: tuple[int, int, str] | None = None
    for name, rows in _bug_outputs(cases).items():
        matched = {i: _same_any(outcomes[i].value, rows[i]) for i in valid}
        hits = {i for i, m in matched.items() if m is not None}
        explained = sum(i in hits and not _same(matched[i], expected[i]) for i in wrong)
        scores[name] = round(len(hits) / len(valid), 4)
        if explained and explained >= MATCH_SHARE * len(wrong) and len(hits) >= MATCH_SHARE * len(valid):
            if best is None or (len(hits), explained) > best[:2]:
                best = (len(hits), explained, name)
    return (best[2] if best else "unknown"), scores


def _relative_error(actual: list, expected: list) -> float:
    """The largest difference, relative to the largest expected value of the case."""
    top = max((abs(b) for row in expected for b in row), default=0.0)
    gap = max(
        (
            abs(a - b) if math.isfinite(a) else math.inf
            for ra, rb in zip(actual, expected)
            for a, b in zip(ra, rb)
        ),
        default=0.0,
    )
    return gap / top if top > 0 else (0.0 if gap == 0 else math.inf)


def grade(
    norms: Sequence[float],
    errors: Sequence[float | None],
    failed: Sequence[int],
    fingerprint_name: str | None,
    stopped: str | None,
    unrounded: Sequence[int] = (),
    unrounded_by: float = 0.0,
) -> tuple[str, str | None]:
    """("pass" | "near miss" | "fail", how near).

    A near miss returns the right layout everywhere and is off by at most
    NEAR_MISS (relative) wherever it is off, or is a gallery bug that only
    misses by an epsilon (then tiny norms, where the epsilon dominates, may be
    far off: they are counted apart). Norms beyond float32's range (where a
    sum of squares in float32, off by a rounding elsewhere, overflows) are
    counted apart as well, when other checks are near misses. ``errors[i]`` is
    None when case i gave no value of the right layout; ``norms[i]`` is the
    case's global norm. ``unrounded``: failed cases whose values are right within the tolerance
    but not rounded to 12 decimals, off by at most ``unrounded_by`` (measured): graded as a near
    miss of that size.
    """
    if not failed and stopped is None:
        return "pass", None
    if stopped is not None or any(errors[i] is None for i in failed):
        return "fail", None
    if unrounded:
        right = f"off by at most {unrounded_by:.2g} in the last digits: not rounded to {DIGITS} decimals"
        others = [i for i in failed if i not in set(unrounded)]
        if not others:
            return "near miss", right
        level, how = grade(norms, errors, others, fingerprint_name, None)
        return level, (f"{how}; {_checks(unrounded)} {right}" if how else None)
    huge = [i for i in failed if norms[i] > implied.FLOAT32_NORM]
    rest = [i for i in failed if i not in huge] or failed
    worst = max(errors[i] or 0.0 for i in rest)
    if worst > NEAR_MISS and fingerprint_name not in NEAR_MISS_BUGS:
        return "fail", None
    sized = [errors[i] or 0.0 for i in rest if norms[i] >= SMALL_NORM]
    if not sized and fingerprint_name in NEAR_MISS_BUGS:  # off only where the epsilon dominates
        how = f"off only where the norm is below {SMALL_NORM:g}, by up to {worst:.2g}"
        sized = [0.0]
    else:
        sized = sized or [worst]
        how = f"off by at most {max(sized):.2g} relative"
    tiny = [i for i in rest if norms[i] < SMALL_NORM and (errors[i] or 0.0) > max(sized)]
    if tiny and not how.startswith("off only"):
        how += f"; on {_checks(tiny)} with a norm below {SMALL_NORM:g} by up to {worst:.2g}"
    apart = [i for i in huge if i not in rest and (errors[i] or 0.0) > max(sized)]
    if apart:
        far = max(errors[i] or 0.0 for i in apart)
        above = f"a norm above {implied.FLOAT32_NORM:.2g} (float32 overflows)"
        how += f"; on {_checks(apart)} with {above} by up to {far:.2g}"
    return "near miss", how


def _checks(cases: Sequence[int]) -> str:
    return f"{len(cases)} check{'s' * (len(cases) != 1)}"


def _hints(case: Case, actual: list, limit: float) -> list[str]:
    """The scale each shard applied and the norm it implies, against the expected ones."""
    before = [np.asarray(s, dtype=np.float64) for s in case.shards]
    after = [np.asarray(s, dtype=np.float64) for s in actual]
    units = [implied.applied([b], [a], REL_TOL, ABS_TOL) for b, a in zip(before, after)]
    tops = [u.top for u in units if u.scale is not None]
    if not tops:
        return []
    sumsq = [math.fsum(float(v) ** 2 for v in s) for s in case.shards]
    norm = math.sqrt(math.fsum(sumsq))
    expected = gallery.GLOBAL.scale(norm, limit)
    rtol = max(implied.SAME, 10 * ABS_TOL / min(tops))  # rounding to 12 decimals blurs small shards
    counts = [len(s) for s in case.shards]
    return implied.unit_lines("shard", units, sumsq, counts, limit, expected, norm, rtol)


def judge(target: Target, count: int = 200, seed: int = 0, timeout: float = 5.0) -> Verdict:
    """Run every case through the implementation and compare with ``gclip.clip_shards``."""
    cases = make_cases(count, seed)
    expected = [clip_shards(c.shards, c.limit) for c in cases]
    worker, note = start(target, timeout)
    outcomes: list[Outcome] = []
    lost = 0
    stopped = None
    try:
        for case in cases:
            outcome = worker.call(case.shards, case.limit)
            outcomes.append(outcome)
            if outcome.lost:
                lost += 1
                worker.close()
                if lost >= MAX_LOST:
                    left = len(cases) - len(outcomes)
                    stopped = f"{lost} calls hung or crashed; the other {left} cases were not run"
                    break
                worker, _ = start(target, timeout)
    finally:
        worker.close()
    cases, expected = cases[: len(outcomes)], expected[: len(outcomes)]
    reasons = {}
    for i, (case, exp, outcome) in enumerate(zip(cases, expected, outcomes)):
        why = check(case, exp, outcome)
        if why is not None:
            reasons[i] = why
    failed = sorted(reasons)
    name, scores = fingerprint(cases, expected, outcomes, failed)
    if stopped and name is None:
        name = "unknown"
    errors = [
        _relative_error(o.value, e) if o.value is not None and _layout(o.value) == _layout(e) else None
        for o, e in zip(outcomes, expected)
    ]
    norms = [math.sqrt(math.fsum(float(v) ** 2 for s in c.shards for v in s)) for c in cases]
    unrounded = [i for i in failed if outcomes[i].value is not None and _same(outcomes[i].value, expected[i])]
    unrounded_by = max(
        (
            abs(a - b)
            for i in unrounded
            for ra, rb in zip(outcomes[i].value, expected[i])
            for a, b in zip(ra, rb)
        ),
        default=0.0,
    )
    level, near = grade(norms, errors, failed, name, stopped, unrounded, unrounded_by)
    hints = {
        i: _hints(cases[i], outcomes[i].value, cases[i].limit)
        for i in failed
        if errors[i] is not None and errors[i] > 0
    }
    return Verdict(
        str(target),
        cases,
        outcomes,
        expected,
        failed,
        reasons,
        name,
        scores,
        stopped,
        note,
        level,
        near,
        hints,
    )
