"""Read a folder of the judge's --json verdicts, and summarize the class."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._lab.cli import ArgParser, UsageError, entry, internal_error
from .._lab.jsonout import dumps
from ..gallery import LAYOUT_BUG_NAMES, STRATEGIES

__all__ = ["PROG", "Student", "main", "read_class", "render", "summarize"]

PROG = "gclip.classroom"
COMMON = 5  # the common mistakes listed: the checks most students failed


class Student(NamedTuple):
    """One student's verdict: the file's name, and what the judge said (or why it is no verdict)."""

    name: str
    verdict: dict | None  # the judge's JSON object
    problem: str | None = None  # why the file is not a verdict


def _problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return "not a JSON object"
    if "target" not in data or "passed" not in data:
        return "not a verdict of the judge (no target, no passed)"
    return None


def read_class(folder: str) -> list[Student]:
    """Every ``*.json`` file of ``folder``, sorted by name, as a Student."""
    if not os.path.isdir(folder):
        raise UsageError(f"no such folder: {folder}")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    if not names:
        raise UsageError(
            f"no .json file in {folder}: save each student's verdict there, e.g. "
            "python -m gclip.conformance lab/my_clip.py:clip_shards --json > alice.json"
        )
    out = []
    for name in names:
        student = name[: -len(".json")]
        text = None
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                text = f.read()
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = (
                "empty: the judge printed no verdict (it refused the command: its error says why)"
                if text is not None and not text.strip()
                else f"cannot be read as JSON ({type(exc).__name__})"
            )
            out.append(Student(student, None, why))
            continue
        problem = _problem(data)
        out.append(Student(student, None if problem else data, problem))
    return out


def _grade(v: dict) -> str:
    if "error" in v:
        return "did not load"
    if v["passed"]:
        return "pass"
    return v.get("grade") or "fail"


def _rank_mistakes(v: dict) -> set[str]:
    """What the ranks did wrong in a distributed verdict, in words (once per student)."""
    found = set()
    for failure in v.get("failures") or []:
        for rank in failure.get("ranks") or []:
            if rank.get("outcome") == "did not finish":
                found.add("a rank did not finish (it waited in a collective others skipped)")
            elif str(rank.get("outcome", "")).startswith("raised"):
                found.add("a rank raised an exception")
            if rank.get("outcome") == "returned" and not rank.get("collectives"):
                found.add("a rank entered no collective (it clipped by its own numbers)")
    if v.get("stopped"):
        found.add(f"the judge stopped early: {v['stopped']}")
    return found


def _checks_failed(v: dict) -> set[str]:
    """The named checks a verdict failed ("contract N=3: norm spans two shards" -> "norm spans two
    shards"), once per student; the random cases apart, which differ from run to run."""
    labels = {str(f.get("check", "")) for f in v.get("failures") or []}
    return {label.split(": ", 1)[-1] for label in labels if label and not label.startswith("random")}


def _about(bug: str) -> str:
    """The gallery's one line on a bug (empty for "unknown")."""
    known = STRATEGIES.get(bug) or LAYOUT_BUG_NAMES.get(bug)
    return known.summary if known is not None and bug != "global" else ""


def summarize(students: Sequence[Student]) -> dict:
    """The class at a glance (pure; JSON-ready)."""
    rows = []
    bugs: dict[str, list[str]] = {}
    checks: Counter[str] = Counter()
    on_ranks: Counter[str] = Counter()
    for s in students:
        if s.verdict is None:
            rows.append({"student": s.name, "grade": "no verdict", "problem": s.problem})
            continue
        v = s.verdict
        grade = _grade(v)
        row = {
            "student": s.name,
            "grade": grade,
            "target": v["target"],
            "fingerprint": v.get("fingerprint"),
            "failed": v.get("failed"),
            "checks": v.get("checks"),
        }
        if grade == "did not load":
            row["problem"] = v["error"]
        rows.append(row)
        if grade in ("fail", "near miss"):
            bugs.setdefault(v.get("fingerprint") or "unknown", []).append(s.name)
            checks.update(_checks_failed(v))
            on_ranks.update(_rank_mistakes(v))
    grades = Counter(r["grade"] for r in rows)
    return {
        "students": len(rows),
        "passed": [r["student"] for r in rows if r["grade"] == "pass"],
        "grades": dict(grades),
        "rows": rows,
        "bugs_found": [
            {"bug": bug, "about": _about(bug), "students": names}
            for bug, names in sorted(bugs.items(), key=lambda item: (-len(item[1]), item[0]))
        ],
        "common_mistakes": [{"check": c, "students": n} for c, n in checks.most_common(COMMON)],
        "on_ranks": [{"what": w, "students": n} for w, n in on_ranks.most_common()],
    }


def _who(names: Sequence[str], width: int = 6) -> str:
    shown = ", ".join(names[:width])
    return shown + (f" and {len(names) - width} more" if len(names) > width else "")


def render(summary: dict) -> str:
    """The teacher's page: the class at a glance, each student, the bugs found, the common mistakes."""
    g = summary["grades"]
    counts = ", ".join(f"{n} {grade}" for grade, n in sorted(g.items(), key=lambda kv: -kv[1]))
    lines = [f"gclip classroom: {summary['students']} students: {counts}", ""]
    width = max([len(r["student"]) for r in summary["rows"]] + [7])
    lines.append(
        f"  {'student':<{width}}  {'verdict':<12} {'bug the judge found':<22} {'checks failed':<14} target"
    )
    for r in summary["rows"]:
        if r["grade"] == "no verdict":
            lines.append(f"  {r['student']:<{width}}  {'no verdict':<12} {r['problem']}")
            continue
        if r["grade"] == "did not load":
            lines.append(f"  {r['student']:<{width}}  {'did not load':<12} {r['problem']}")
            continue
        bug = r["fingerprint"] if r["grade"] != "pass" else "-"
        failed = f"{r['failed']} of {r['checks']}" if r["checks"] is not None else "?"
        grade = r["grade"].upper()
        lines.append(
            f"  {r['student']:<{width}}  {grade:<12} {bug or 'unknown':<22} {failed:<14} {r['target']}"
        )
    passed = summary["passed"]
    lines += ["", f"Passed ({len(passed)}): {_who(passed, 40) if passed else 'nobody yet'}"]
    lines += ["", "Bugs found (the gallery bug each failing function behaves like):"]
    if not summary["bugs_found"]:
        lines.append("  none")
    for b in summary["bugs_found"]:
        about = f": {b['about']}" if b["about"] else ": fails like no bug of the gallery (read its reasons)"
        lines.append(f"  {b['bug']} ({len(b['students'])}){about}")
        lines.append(f"    {_who(b['students'])}")
    lines += ["", "Common mistakes (the checks most failing students failed):"]
    if not summary["common_mistakes"]:
        lines.append("  none")
    for m in summary["common_mistakes"]:
        lines.append(f"  {m['check']}: {m['students']} student{'s' * (m['students'] != 1)}")
    if summary["on_ranks"]:
        lines += ["", "On real ranks:"]
        for m in summary["on_ranks"]:
            lines.append(f"  {m['what']}: {m['students']} student{'s' * (m['students'] != 1)}")
    return "\n".join(lines)


def _parser() -> ArgParser:
    p = ArgParser(
        prog="python -m gclip.classroom",
        description="The teacher's summary of a class: reads a folder of the judge's --json verdicts "
        "(one file per student, named after them) and prints who passed, the bugs found and the "
        "common mistakes.",
    )
    p.add_argument("folder", metavar="DIR", help="the folder of verdicts (*.json)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text")
    return p


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    summary = summarize(read_class(args.folder))
    print(dumps(summary, separators=(",", ":")) if args.json else render(summary), flush=True)
    return 0


main = entry(PROG, _main, on_fault=internal_error)
