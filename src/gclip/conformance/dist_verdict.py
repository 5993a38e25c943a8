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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import gallery
from ..clip import apply_scale
from . import implied
from .hangs import rank_list
from .outcome import CaseRun
from .verdict import MATCH_SHARE, NEAR_MISS_BUGS, grade

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

LAYOUT_NAMES = frozenset(b.name for b in gallery.LAYOUT_BUGS)
RTOL = {"float64": 1e-11, "float32": 2e-6, "float16": 2e-3}  # relative to the array's largest value
SKIP = "skip-collective"
APART = "dense-expert-apart"  # read off the outputs: the arrays in two sets, each clipped by its own norm
SPLITS_TRIED = 10  # a run that scaled nothing is split every way only up to this many non-zero arrays


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
        odd = ~np.isfinite(g)  # inf and NaN where ``want`` has the same, and numbers elsewhere
        if g.shape != w.shape or not np.array_equal(g[odd], w[odd], equal_nan=True):
            return math.inf
        if np.any(~np.isfinite(w[~odd])):
            return math.inf
        g, w = g[~odd], w[~odd]
        if not g.size:
            return 0.0
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
    lines = implied.unit_lines(
        "rank", units, sumsq, counts, case.max_norm, case.scale, case.norm, rtol, precision=sharp, parts=parts
    )
    return lines + _split_lines(case, run)


def _skip_signature(cases: Sequence[DistCase], runs: Sequence[CaseRun]) -> bool:
    """Every hang is ranks returning before a collective the others entered: ranks with nothing
    to clip that return early, or a collective called on some ranks only (``if rank == 0``)."""
    hung = [run for run in runs[: len(cases)] if run.lost is not None]
    return bool(hung) and all(run.lost_kind == "skipped" and run.culprits for run in hung)


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
    pairs: Callable[[], dict[str, list[Any]]] | None = None,
) -> tuple[str | None, dict[str, float], tuple[str, ...]]:
    """As ``fingerprint``, with the benign differences (float32 rounding, torch's epsilon) the
    named bug needed to match: a real clip has both, and they do not hide its bug.

    ``pairs``: where no single bug matches (nor two clips over sets of the arrays), the outputs
    of two layout bugs at once, by 'first + second' (computed only then): the pair matched is named."""
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
    # the failures that no benign difference explains (the correct clip in float32, or with the
    # epsilon, reproduces the others): a bug that explains these is named before one that explains
    # only the benign ones (a NaN on one case beside float32 rounding on many is that NaN's bug)
    near = {
        i
        for i in wrong
        if _near_correct(cases[i], runs[i], [o[i] for n, o in gallery.items() if n in NEAR_MISS_BUGS])
    }
    real = [i for i in wrong if i not in near]
    found = _best(cases, runs, valid, wrong, real, gallery, scores)
    if found is not None:
        return found[0], scores, found[1]
    # no bug of the gallery: two clips, each over a set of the arrays?
    split = {i: _two_clips(cases[i], runs[i]) for i in valid}
    hits = {i for i, alt in split.items() if alt is not None}
    explained = sum(
        i in hits and not _matches(cases[i], cases[i].expected, _as_run(split[i][0])) for i in wrong
    )
    scores[APART] = round(len(hits) / len(valid), 4)
    if explained and explained >= MATCH_SHARE * len(wrong) and len(hits) >= MATCH_SHARE * len(valid):
        seen = {b for i in hits for b in split[i][1]}
        return APART, scores, tuple(b for b in (FLOAT32, EPSILON) if b in seen)
    if pairs is not None:  # two layout bugs at once: only the matched pair's score is kept
        pair_scores: dict[str, float] = {}
        found = _best(cases, runs, valid, wrong, real, pairs(), pair_scores)
        if found is not None:
            scores[found[0]] = pair_scores[found[0]]
            return found[0], scores, found[1]
    return "unknown", scores, ()


def _best(
    cases: Sequence[DistCase],
    runs: Sequence[CaseRun],
    valid: list[int],
    wrong: list[int],
    real: list[int],
    gallery: dict[str, list[Any]],
    scores: dict[str, float],
) -> tuple[str, tuple[str, ...]] | None:
    """(the bug of ``gallery`` that explains the failures best, the benign differences it needed),
    or None; each bug's share of matched cases into ``scores``."""
    best: tuple[bool, int, int, bool, str] | None = None
    needed: dict[str, tuple[str, ...]] = {}
    for name, outputs in gallery.items():
        # which of the bug's variants (if it has several) each case's outputs equal
        matched = {i: _matching(cases[i], outputs[i], runs[i]) for i in valid}
        hits = {i for i, alt in matched.items() if alt is not None}
        new = {i for i in hits if not _matches(cases[i], cases[i].expected, _as_run(matched[i][0]))}
        explained = sum(i in new for i in wrong)
        explains_real = bool(real) and sum(i in new for i in real) >= MATCH_SHARE * len(real)
        scores[name] = round(len(hits) / len(valid), 4)
        enough = explained >= MATCH_SHARE * len(wrong) or explains_real
        if explained and enough and len(hits) >= MATCH_SHARE * len(valid):
            # on a tie a layout bug is named before an engine bug: on a mesh where both give the
            # same outputs (tp-rank0-only and rank0-norm when pp = 1) the layout's is the more
            # specific reading, and the only one a layout form can tell apart from the contract
            key = (explains_real, len(hits), explained, name in LAYOUT_NAMES)
            if best is None or key > best[:4]:
                best = (*key, name)
                seen = {b for i in hits for b in matched[i][1]}
                needed[name] = tuple(b for b in (FLOAT32, EPSILON, FLOAT16_TOTAL) if b in seen)
    if best is not None:
        return best[4], needed[best[4]]
    return None


def _near_correct(case: DistCase, run: CaseRun, benign_bugs: Sequence[Any]) -> bool:
    """The run is the correct clip but for float32 rounding or torch's epsilon (``benign_bugs``:
    this case's outputs of the gallery's near-miss bugs)."""
    if _matches(case, case.expected, run, LOOSE):
        return True
    return any(_matching(case, outputs, run) is not None for outputs in benign_bugs)


def _array_scales(case: DistCase, run: CaseRun) -> dict[tuple[int, int], float | None]:
    """(rank, array) -> the factor that array was multiplied by (None: it holds no non-zero value)."""
    out: dict[tuple[int, int], float | None] = {}
    for r, (given, rank) in enumerate(zip(case.ranks, run.ranks)):
        for i, (x, y) in enumerate(zip(given, rank.value or [])):
            out[(r, i)] = implied.applied([x], [y], rtol_of(x.dtype)).scale
    return out


def _scale_sets(scales: dict[tuple[int, int], float | None], rtol: float) -> list[list[tuple[int, int]]]:
    """The arrays grouped by the factor they got (within ``rtol``), the largest factor first."""
    sets: list[tuple[float, list[tuple[int, int]]]] = []
    for key, s in scales.items():
        if s is None:
            continue
        for value, members in sets:
            if implied.same_scale(s, value, rtol):
                members.append(key)
                break
        else:
            sets.append((s, [key]))
    return [members for _, members in sorted(sets, key=lambda vm: -vm[0])]


def _two_clips(case: DistCase, run: CaseRun) -> tuple[list[list[np.ndarray]], tuple[str, ...]] | None:
    """The run read as two clips (say the dense arrays and the experts', each clipped by the
    global norm of its own set, as two optimizers that clip apart do): the outputs of the first
    split of the arrays in two sets that reproduces it, and its benign differences; None when
    none does. The split is read off the factors each array got; a run that left everything
    unchanged is tried against every split (up to SPLITS_TRIED non-zero arrays)."""
    if run.lost is not None or any(r.kind != "value" or r.value is None for r in run.ranks):
        return None
    if any(len(r.value or []) != len(g) for r, g in zip(run.ranks, case.ranks)):
        return None
    scales = _array_scales(case, run)
    sets = _scale_sets(scales, 1e-4)
    if len(sets) > 2:
        return None
    live = [k for k, s in scales.items() if s is not None]
    candidates: list[set[tuple[int, int]]] = [set(live)]  # one set: the global clip
    if len(sets) == 2:
        candidates.append(set(sets[0]))
    elif len(live) <= SPLITS_TRIED:
        rest = live[1:]
        for mask in range(1, 2 ** len(rest)):
            candidates.append({live[0], *(k for j, k in enumerate(rest) if mask >> j & 1)})
    for first in candidates:
        for eps, floor, benign in (
            (0.0, 0.0, ()),
            (gallery.TORCH_EPS, 0.0, (EPSILON,)),
            (0.0, LOOSE, (FLOAT32,)),
            (gallery.TORCH_EPS, LOOSE, (FLOAT32, EPSILON)),
        ):
            values = _clipped_apart(case, first, eps)
            if _matches(case, values, run, floor):
                return values, benign
    return None


def _clipped_apart(case: DistCase, first: set[tuple[int, int]], eps: float) -> list[list[np.ndarray]]:
    """Every array clipped by the global norm of its set (``first``, or the others), + ``eps``."""
    sq = {
        (r, i): float(np.sum(np.square(x, dtype=np.float64)))
        for r, given in enumerate(case.ranks)
        for i, x in enumerate(given)
    }
    norms = [
        math.sqrt(math.fsum(v for k, v in sq.items() if (k in first) == inside)) for inside in (True, False)
    ]
    scales = [gallery.GLOBAL.scale(n + eps if n > 0 else n, case.max_norm) for n in norms]
    return [
        [apply_scale(x, scales[0] if (r, i) in first else scales[1]) for i, x in enumerate(given)]
        for r, given in enumerate(case.ranks)
    ]


def _split_lines(case: DistCase, run: CaseRun) -> list[str]:
    """For each rank whose arrays got different factors: which arrays got which factor."""
    if any(rank.kind != "value" or rank.value is None for rank in run.ranks):
        return []
    scales = _array_scales(case, run)
    lines = []
    for r, given in enumerate(case.ranks):
        mine = {k: s for k, s in scales.items() if k[0] == r}
        rtol = max((rtol_of(x.dtype) for x in given), default=RTOL["float64"]) * 10
        sets = _scale_sets(mine, max(rtol, implied.SAME))
        if len(sets) < 2:
            continue
        parts = [([i for _, i in sorted(members)], scales[members[0]]) for members in sets]
        lines.append(implied.split_line(f"rank {r}", parts, case.max_norm))
    return lines


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
    pairs: Callable[[], dict[str, list[Any]]] | None = None,
) -> DistVerdict:
    """The verdict on the cases that ran (``runs`` may be shorter than ``cases``); ``pairs``: two
    layout bugs at once, tried where no single one matches."""
    cases = list(cases[: len(runs)])
    reasons = {}
    for i, (case, run) in enumerate(zip(cases, runs)):
        why = _why(case, run)
        if why is not None:
            reasons[i] = why
    failed = sorted(reasons)
    cut = len(runs)
    both = None if pairs is None else (lambda: {k: v[:cut] for k, v in pairs().items()})
    name, scores, benign = fingerprint_with_benign(
        cases, runs, failed, {k: v[:cut] for k, v in gallery.items()}, both
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
