"""The judge of the limits: a recorded run of an adaptive, unit-wise or per-group clip, graded.

What was applied is compared with what each candidate would have applied, every candidate
computed here from the recorded sums of squares (``math.fsum``, the rules of
``gclip.limits.rules`` on Python floats), never from the clip under test:

- :func:`judge_adaptive`: per step and rank, the sum of squares the rank counts once and the
  sum of every value it holds (replicas too), and the scale it applied. Candidates: the rule
  fed the global norm (correct), each rank's local norm (``adaptive-local-norm``), the world
  sum of every copy (``zclip-world-sum``). :class:`AdaptiveCandidates` steps them one step at a
  time (the audit's ``--adaptive`` uses it too).
- :func:`judge_agc`: per unit piece, its weight and gradient squares and the factor applied.
  Candidates: the unit's whole sums (correct), each piece's own (``agc-shard-units``).
- :func:`judge_groups`: per group, its global sum of squares, its limit and the scale applied.
  Candidates: each group by its own rule (correct), one clip over all (``muon-global-clip``),
  with the attenuation it causes per group.

Grades as the judge's: ``pass``, ``near miss`` (torch's ``norm + 1e-6``), ``fail`` with the
bug's name, or ``unknown``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..gallery import TORCH_EPS
from ..gallery.limit_bugs import ADAPTIVE_LOCAL, AGC_SHARDS, LIMIT_BUG_NAMES, MUON_GLOBAL, ZCLIP_WORLD
from ..limits.rules import FloatOps, ZClipRule, check_number
from ..limits.units import unit_factor

__all__ = [
    "AdaptiveCandidates",
    "LimitVerdict",
    "Piece",
    "StepRecord",
    "judge_adaptive",
    "judge_agc",
    "judge_groups",
    "threshold",
]

RTOL = 1e-9  # float64 arithmetic of the same rule in another order


class LimitVerdict(NamedTuple):
    grade: str  # "pass", "near miss", "fail"
    fingerprint: str | None  # None: correct; a bug's name; "unknown"
    matches: list[str]  # every candidate that fits (the first is the fingerprint)
    clipped: list[int]  # the steps (or groups, units) the correct clip scales down
    details: dict[str, Any]  # what the verdict measured (attenuations, limits)

    @property
    def passed(self) -> bool:
        return self.grade == "pass"

    def __str__(self) -> str:
        if self.fingerprint is None:
            return f"verdict: correct ({len(self.clipped)} clipped)"
        if self.fingerprint in LIMIT_BUG_NAMES:
            bug = LIMIT_BUG_NAMES[self.fingerprint]
            return f"verdict: wrong: {bug.name}: {bug.summary}\n  seen in: {bug.incident}"
        return f"verdict: {self.grade}: {self.fingerprint}"


# -- the adaptive limits


class _ZClipThreshold:
    def __init__(self, **options: Any) -> None:
        self.rule = ZClipRule(**options)

    def __call__(self, norm: float) -> float:
        limit, _, seen = self.rule.limit(norm, FloatOps)
        self.rule.update(seen, math.isfinite(norm), FloatOps)
        return float(limit)


class _AutoClipThreshold:
    def __init__(self, percentile: float = 10.0, window: int | None = None) -> None:
        self.percentile = check_number("percentile", percentile, zero=True, high=100.0 + 1e-9)
        self.window, self.history = window, []

    def __call__(self, norm: float) -> float:
        if math.isfinite(norm):
            self.history.append(norm)
            if self.window is not None:
                del self.history[: -self.window]
        return float(np.percentile(self.history, self.percentile)) if self.history else math.inf


THRESHOLDS: dict[str, Callable[..., Callable[[float], float]]] = {
    "zclip": _ZClipThreshold,
    "autoclip": _AutoClipThreshold,
}


def threshold(spec: str) -> Callable[[], Callable[[float], float]]:
    """A maker of fresh thresholds from ``"zclip"`` or ``"autoclip:percentile=25,window=100"``:
    each is called with a step's norm and returns that step's limit (inf: none)."""
    name, _, rest = spec.partition(":")
    if name not in THRESHOLDS:
        raise ValueError(f"unknown adaptive clipper {name!r}; choose from {', '.join(THRESHOLDS)}")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{spec!r}: options are key=value, got {item!r}")
        options[key.strip()] = _value(value.strip())
    THRESHOLDS[name](**options)  # a bad option fails here, once
    return lambda: THRESHOLDS[name](**options)


def _value(text: str) -> Any:
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class StepRecord(NamedTuple):
    """One step of an adaptive clip, every rank's numbers."""

    owned: Sequence[float]  # per rank: the sum of squares it counts (each value once in the world)
    every: Sequence[float]  # per rank: the sum of squares of every value it holds (copies too)
    scales: Sequence[float | None]  # per rank: the scale it applied (None: nothing to scale)


class AdaptiveCandidates:
    """Each candidate's threshold state, stepped on the same recorded steps."""

    def __init__(self, make: Callable[[], Callable[[float], float]], ranks: int) -> None:
        self.ranks = ranks
        self.correct = make()
        self.local = [make() for _ in range(ranks)]
        self.world = make()

    def step(
        self, owned: Sequence[float], every: Sequence[float]
    ) -> dict[str, tuple[list[float], list[float]]]:
        """Per candidate, (the limits, the norms) each rank would use this step."""
        size = self.ranks
        true = math.sqrt(math.fsum(owned))
        local = [math.sqrt(e) for e in every]
        world = math.sqrt(math.fsum(every))
        return {
            "global": ([self.correct(true)] * size, [true] * size),
            ADAPTIVE_LOCAL: ([t(n) for t, n in zip(self.local, local)], local),
            ZCLIP_WORLD: ([self.world(world)] * size, [world] * size),
        }


def _scale(norm: float, limit: float, eps: float = 0.0) -> float:
    if not math.isfinite(norm) or math.isinf(limit) or norm + eps <= 0:
        return 1.0
    return min(1.0, limit / (norm + eps))


def _same(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


def _grade(
    fits: dict[str, tuple[bool, bool]], shows: set[str], clipped: list[int], details: dict
) -> LimitVerdict:
    """``fits``: per candidate, (fits exactly, fits through torch's epsilon), the correct one first."""
    exact, eps = fits.pop("global")
    if exact:
        return LimitVerdict("pass", None, ["global"], clipped, details)
    found = [n for n, (e, _) in fits.items() if e and n in shows]
    if found:
        return LimitVerdict("fail", found[0], found, clipped, details)
    if eps:
        return LimitVerdict("near miss", "epsilon", ["epsilon"], clipped, details)
    found = [n for n, (_, e) in fits.items() if e and n in shows]
    if found:
        return LimitVerdict("fail", found[0], found, clipped, details)
    return LimitVerdict("fail", "unknown", [], clipped, details)


def judge_adaptive(
    steps: Sequence[StepRecord], clipper: str = "zclip", *, rtol: float = RTOL
) -> LimitVerdict:
    """Grade an adaptive clip's run: the scales every rank applied, step by step, against the
    rule (``clipper``: as :func:`threshold` takes it) fed each candidate's norm."""
    if not steps:
        raise ValueError("judge_adaptive needs at least one step")
    ranks = len(steps[0].scales)
    track = AdaptiveCandidates(threshold(clipper), ranks)
    fits: dict[str, list[bool]] = {}
    shows: set[str] = set()
    clipped: list[int] = []
    limits: list[float] = []
    for k, step in enumerate(steps):
        want = track.step(step.owned, step.every)
        correct = [_scale(n, m) for m, n in zip(*want["global"])]
        limits.append(want["global"][0][0])
        if any(s < 1.0 for s in correct):
            clipped.append(k)
        for name, (lims, norms) in want.items():
            for eps, key in ((0.0, name), (TORCH_EPS, name + "+eps")):
                ok = all(
                    s is None or _same(s, _scale(n, m, eps), rtol)
                    for s, m, n in zip(step.scales, lims, norms)
                )
                fits[key] = [*fits.get(key, []), ok]
            if any(not _same(_scale(n, m), c, 1e-6) for m, n, c in zip(lims, norms, correct)):
                shows.add(name)
    every = {
        name: (all(fits[name]), all(fits[name + "+eps"])) for name in ("global", ADAPTIVE_LOCAL, ZCLIP_WORLD)
    }
    return _grade(every, shows, clipped, {"limits": limits})


# -- AGC


class Piece(NamedTuple):
    """One rank's piece of one AGC unit."""

    unit: Any  # the unit it is a piece of (pieces of one unit share it)
    w_sq: float  # the piece's sum of squares of the weight
    g_sq: float  # ... and of the gradient
    factor: float | None  # the factor applied to the piece (None: a zero piece, any factor fits)


def judge_agc(
    pieces: Sequence[Piece], clipping: float = 0.01, eps: float = 1e-3, *, rtol: float = RTOL
) -> LimitVerdict:
    """Grade AGC's factors on unit pieces: the unit's whole norms (correct) or each piece's own."""
    whole: dict[Any, list[list[float]]] = {}
    for p in pieces:
        whole.setdefault(p.unit, [[], []])
        whole[p.unit][0].append(p.w_sq)
        whole[p.unit][1].append(p.g_sq)

    def factor(w_sq: float, g_sq: float) -> float:
        return float(unit_factor(np.float64(w_sq), np.float64(g_sq), clipping, eps, np))

    correct = [factor(*(math.fsum(s) for s in whole[p.unit])) for p in pieces]
    own = [factor(p.w_sq, p.g_sq) for p in pieces]
    clipped = sorted({i for i, c in enumerate(correct) if c < 1.0})
    split = [p.unit for p in pieces]
    shows = {AGC_SHARDS} if any(not _same(a, b, 1e-6) for a, b in zip(own, correct)) else set()
    fits = {
        name: (all(p.factor is None or _same(p.factor, w, rtol) for p, w in zip(pieces, want)), False)
        for name, want in (("global", correct), (AGC_SHARDS, own))
    }
    split_units = sum(1 for u in set(split) if split.count(u) > 1)
    return _grade(fits, shows, clipped, {"units_split": split_units, "pieces": len(pieces)})


# -- per-group limits


def judge_groups(
    sumsq: Sequence[float],
    limits: Sequence[float | None],
    scales: Sequence[float],
    *,
    rtol: float = RTOL,
) -> LimitVerdict:
    """Grade the scales each group's gradient got: by its own limit and norm (None: not clipped),
    or one clip over every group at the (one) limit given. ``details["attenuation"]``: per
    group, the correct scale over the applied one (1: as it should be)."""
    norms = [math.sqrt(s) for s in sumsq]
    total = math.sqrt(math.fsum(sumsq))
    correct = [1.0 if m is None else _scale(n, m) for n, m in zip(norms, limits)]
    candidates: dict[str, list[float]] = {"global": correct}
    for limit in sorted({m for m in limits if m is not None}):
        candidates[MUON_GLOBAL if MUON_GLOBAL not in candidates else f"{MUON_GLOBAL} ({limit:g})"] = [
            _scale(total, limit)
        ] * len(norms)
    fits = {
        n: (all(_same(s, w, rtol) for s, w in zip(scales, want)), False) for n, want in candidates.items()
    }
    shows = {n for n, want in candidates.items() if any(not _same(w, c, 1e-6) for w, c in zip(want, correct))}
    attenuation = [c / s if s > 0 else math.inf for c, s in zip(correct, scales)]
    clipped = [g for g, c in enumerate(correct) if c < 1.0]
    verdict = _grade(fits, shows, clipped, {"attenuation": attenuation, "group_norms": norms})
    if verdict.fingerprint and verdict.fingerprint.startswith(MUON_GLOBAL):
        return verdict._replace(fingerprint=MUON_GLOBAL)
    return verdict
