"""The single-process verdict, written: a readable report, or a dict for ``--json``."""

from __future__ import annotations

from typing import Any

from .._lab.cli import color
from .._lab.jsonout import dumps
from ..gallery import LAYOUT_BUG_NAMES, STRATEGIES
from .verdict import Verdict

__all__ = [
    "as_json",
    "benign_words",
    "fingerprint_lines",
    "first_failures",
    "head",
    "report",
    "verdict_fields",
    "verdict_line",
]


def verdict_fields(v: Any, count: int, seed: int, timeout: float) -> dict:
    """The JSON fields of a verdict that the single-process and the distributed judge share."""
    return {
        "target": v.target,
        "passed": v.passed,
        "grade": v.grade,
        "near_miss": v.near,
        "checks": len(v.cases),
        "failed": len(v.failed),
        "fingerprint": v.fingerprint,
        "fingerprint_scores": v.scores,
        "fingerprint_benign": list(getattr(v, "benign", ())),
        "stopped": v.stopped,
        "random": count,
        "seed": seed,
        "timeout": timeout,
    }


def as_json(v: Verdict, count: int, seed: int, timeout: float) -> dict:
    return {
        **verdict_fields(v, count, seed, timeout),
        "note": v.note,
        "failures": [
            {
                "check": v.cases[i].label,
                "shards": v.cases[i].shards,
                "limit": v.cases[i].limit,
                "expected": v.expected[i],
                "actual": v.outcomes[i].value,
                "reason": v.reasons[i],
                "scales": v.hints.get(i, []),
            }
            for i in v.failed
        ],
    }


def _short(value: Any, width: int = 90) -> str:
    text = dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def verdict_line(grade: str, failed: int, checks: int, fingerprint: str | None, near: str | None) -> str:
    """'verdict: PASS (242 checks)', 'verdict: NEAR MISS ...' or 'verdict: FAIL ...'."""
    if grade == "pass":
        return color(f"verdict: PASS ({checks} checks)", "32")
    if grade == "near miss":
        what = f"{fingerprint}, " if fingerprint in STRATEGIES else ""  # a near miss is never a hang
        return color(f"verdict: NEAR MISS ({what}{failed} of {checks} checks {near})", "33")
    return color(f"verdict: FAIL ({failed} of {checks} checks failed)", "31")


def benign_words(benign: tuple[str, ...] | list[str]) -> str:
    """' (with float32 rounding and epsilon 1e-6)': the harmless differences beside a bug."""
    return f" (with {' and '.join(benign)})" if benign else ""


def fingerprint_lines(
    name: str | None, score: float | None, unknown_hint: str, benign: tuple[str, ...] = ()
) -> list[str]:
    """The gallery bug the implementation reproduces, in a learner's words."""
    bug: Any = STRATEGIES.get(name or "") or LAYOUT_BUG_NAMES.get(name or "")
    if bug is not None:
        lines = [f"fingerprint: {bug.name}{benign_words(benign)}: {bug.summary}"]
        if bug.incident:
            lines.append(f"  seen in: {bug.incident}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        if score is not None:
            lines.append(f"  its outputs match this implementation on {score:.0%} of the answered cases")
        return lines
    if name is None:
        return []
    both = [LAYOUT_BUG_NAMES.get(part) for part in name.split(" + ")]
    if len(both) == 2 and all(both):
        lines = [f"fingerprint: {name}{benign_words(benign)}: two bugs of the gallery at once"]
        for part in both:
            lines.append(f"  {part.name}: {part.summary}")
            if part.incident:
                lines.append(f"    seen in: {part.incident}")
        if score is not None:
            lines.append(f"  the two together match this implementation on {score:.0%} of the answered cases")
        return lines
    return [f"fingerprint: {name} ({unknown_hint})"]


def first_failures(shown: int, failed: int) -> str:
    return "the failure:" if failed == 1 else f"first {min(shown, failed)} failures:"


NO_BUG_HINT = "it fails like no bug of the gallery: see the scales below"
NO_BUG_REASONS = "it fails like no bug of the gallery: see the reasons below"  # no scales to show


def head(
    first: str, notes: list[str], groups: list[tuple[str, str]], v: Any, shown: int, split: str | None = None
) -> list[str]:
    """What both judges print first: the groups of cases, the verdict and the fingerprint
    (and, on a failure, the line that introduces the failures).

    The group whose prefix is ``split``, when some of its cases failed, is broken down by
    check (the label after ": ", over every N): which checks pass is then readable, though
    only the first failures are printed in full."""
    lines = [first, *(f"  note: {n}" for n in notes)]
    for title, prefix in groups:
        run = [i for i, c in enumerate(v.cases) if c.label.startswith(prefix)]
        bad = sum(i in v.reasons for i in run)
        lines.append(f"  {title:<34} {len(run):>4} run  {bad:>4} failed")
        if prefix == split and bad:
            checks: dict[str, list[int]] = {}
            for i in run:
                checks.setdefault(v.cases[i].label.split(": ", 1)[-1], []).append(i)
            for name, ids in checks.items():
                failed = sum(i in v.reasons for i in ids)
                lines.append(f"    {name:<32} {len(ids):>4} run  {failed:>4} failed")
    if v.stopped:
        lines.append(f"  stopped: {v.stopped}")
    lines.append(verdict_line(v.grade, len(v.failed), len(v.cases), v.fingerprint, v.near))
    if not v.passed:
        scales = any(v.hints.get(i) for i in v.failed[:shown])
        hint = NO_BUG_HINT if scales else NO_BUG_REASONS
        score = v.scores.get(v.fingerprint or "")
        lines += fingerprint_lines(v.fingerprint, score, hint, getattr(v, "benign", ()))
        lines.append(first_failures(shown, len(v.failed)))
    return lines


def report(v: Verdict, count: int, seed: int, shown: int = 5) -> list[str]:
    """The readable verdict, line by line."""
    groups = [
        ("the contract's checks (N = 1..5)", "contract"),
        ("edge cases", "edge"),
        (f"random layouts (seed {seed})", "random"),
    ]
    notes = [v.note] if v.note else []
    first = f"gclip.conformance: judging {v.target} against the contract"
    lines = head(first, notes, groups, v, shown, split="contract")
    if v.passed:
        return lines
    for i in v.failed[:shown]:
        case, outcome = v.cases[i], v.outcomes[i]
        lines.append(f"  {case.label}")
        lines.append(f"    shards   {_short(case.shards)}  limit {case.limit!r}")
        lines.append(f"    expected {_short(v.expected[i])}")
        if outcome.value is not None:
            lines.append(f"    actual   {_short(outcome.value)}")
        lines.append(f"    reason   {v.reasons[i]}")
        lines += [f"    {line}" for line in v.hints.get(i, [])]
    return lines
