"""The verdict, written: a readable report, or a dict for ``--json``."""

from __future__ import annotations

from typing import Any

from .._lab.cli import color
from .._lab.jsonout import dumps
from ..strategies import STRATEGIES
from .verdict import Verdict

__all__ = ["as_json", "report"]


def as_json(v: Verdict, count: int, seed: int, timeout: float) -> dict:
    return {
        "target": v.target,
        "passed": v.passed,
        "checks": len(v.cases),
        "failed": len(v.failed),
        "fingerprint": v.fingerprint,
        "fingerprint_scores": v.scores,
        "stopped": v.stopped,
        "note": v.note,
        "random": count,
        "seed": seed,
        "timeout": timeout,
        "failures": [
            {
                "check": v.cases[i].label,
                "shards": v.cases[i].shards,
                "limit": v.cases[i].limit,
                "expected": v.expected[i],
                "actual": v.outcomes[i].value,
                "reason": v.reasons[i],
            }
            for i in v.failed
        ],
    }


def _short(value: Any, width: int = 90) -> str:
    text = dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def report(v: Verdict, count: int, seed: int, shown: int = 5) -> list[str]:
    """The readable verdict, line by line."""
    groups = [
        ("seed checks (N = 1..5)", "seed"),
        ("edge cases", "edge"),
        (f"random layouts (seed {seed})", "random"),
    ]
    lines = [f"gclip.conformance: judging {v.target} against the seed contract"]
    if v.note:
        lines.append(f"  note: {v.note}")
    for title, prefix in groups:
        run = [i for i, c in enumerate(v.cases) if c.label.startswith(prefix)]
        bad = sum(i in v.reasons for i in run)
        lines.append(f"  {title:<26} {len(run):>4} run  {bad:>4} failed")
    if v.stopped:
        lines.append(f"  stopped: {v.stopped}")
    if v.passed:
        lines.append(color(f"verdict: PASS ({len(v.cases)} checks)", "32"))
        return lines
    lines.append(color(f"verdict: FAIL ({len(v.failed)} of {len(v.cases)} checks failed)", "31"))
    if v.fingerprint in STRATEGIES:
        bug = STRATEGIES[v.fingerprint]
        lines.append(f"fingerprint: {bug.name}: {bug.summary}")
        lines.append(f"  seen in: {bug.incident}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        lines.append(
            f"  its outputs match this implementation on {v.scores[bug.name]:.0%} of the answered cases"
        )
    else:
        lines.append("fingerprint: unknown (it fails like no bug of the gallery)")
    lines.append(f"first {min(shown, len(v.failed))} failures:")
    for i in v.failed[:shown]:
        case, outcome = v.cases[i], v.outcomes[i]
        lines.append(f"  {case.label}")
        lines.append(f"    shards   {_short(case.shards)}  limit {case.limit!r}")
        lines.append(f"    expected {_short(v.expected[i])}")
        if outcome.value is not None:
            lines.append(f"    actual   {_short(outcome.value)}")
        lines.append(f"    reason   {v.reasons[i]}")
    return lines
