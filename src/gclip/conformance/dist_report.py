"""The distributed verdict, written: a readable report naming ranks, or a dict for ``--json``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dist_verdict import DistVerdict
from .families import family_lines
from .report import head, verdict_fields
from .spread import GROUPS

__all__ = ["as_json", "report"]

MAX_VALUES = 2000  # a failure lists its arrays' values up to this many per case (the model's are many)


def _mode_words(mode: str, layout: dict[str, int] | None) -> str:
    if layout:
        torch = " with torch.distributed (gloo)" if mode == "torch-layout" else ""
        return f" over the layout {','.join(f'{k}={v}' for k, v in layout.items())}{torch}"
    return " with torch.distributed (gloo)" if mode == "torch" else ""


def _values(arrays: Any) -> Any:
    return None if arrays is None else [np.asarray(a, dtype=np.float64).ravel().tolist() for a in arrays]


def _outcome_words(run: Any) -> str:
    if run.kind == "value":
        return "returned"
    if run.kind == "raised":
        return f"raised {run.message}"
    if run.kind == "bad":
        return f"returned no clip: {run.message}"
    return "did not finish"


def _rank_json(v: DistVerdict, i: int, r: int, with_values: bool) -> dict:
    case, run = v.cases[i], v.runs[i].ranks[r]
    out = {
        "rank": r,
        "outcome": _outcome_words(run),
        "collectives": list(run.ops),
        "shapes": [list(a.shape) for a in case.ranks[r]],
        "dtypes": [a.dtype.name for a in case.ranks[r]],
    }
    if with_values:
        out["grads"] = _values(case.ranks[r])
        out["expected"] = _values(case.expected[r])
        out["actual"] = _values(run.value)
    return out


def as_json(v: DistVerdict, *, mode: str, layout: dict | None, count: int, seed: int, timeout: float) -> dict:
    failures = []
    for i in v.failed:
        case = v.cases[i]
        small = sum(a.size for r in case.ranks for a in r) <= MAX_VALUES
        failures.append(
            {
                "check": case.label,
                "max_norm": case.max_norm,
                "reason": v.reasons[i],
                "global_norm": case.norm,
                "expected_scale": case.scale,
                "scales": v.hints.get(i, []),
                "ranks": [_rank_json(v, i, r, small) for r in range(v.size)],
            }
        )
    return {
        **verdict_fields(v, count, seed, timeout),
        "ranks": v.size,
        "mode": mode,
        "layout": layout,
        "notes": v.notes,
        "not_run": dict(v.not_run),
        "families": [line.strip() for line in family_lines(v)[1:]],
        "failures": failures,
    }


def _holding(arrays: list) -> str:
    if not arrays:
        return "no arrays"
    values = sum(a.size for a in arrays)
    dtypes = sorted({a.dtype.name for a in arrays})
    return (
        f"{len(arrays)} array{'s' * (len(arrays) != 1)}, {values} value{'s' * (values != 1)}, "
        f"{'/'.join(dtypes)}"
    )


def report(v: DistVerdict, *, mode: str, layout: dict | None, seed: int, shown: int = 5) -> list[str]:
    """The readable verdict, line by line."""
    where = f"on {v.size} ranks{_mode_words(mode, layout)}"
    groups = [("the lab's model over the layout", "layout")] if layout else list(GROUPS)
    groups = [(f"random layouts (seed {seed})" if p == "random" else t, p) for t, p in groups]
    lines = head(
        f"gclip.conformance: judging {v.target} {where} against the contract", v.notes, groups, v, shown
    )
    if v.passed:
        return lines
    # before the failures: which families of cases the function cannot take
    at = next(i for i, line in enumerate(lines) if "verdict:" in line)
    lines[at:at] = family_lines(v)
    for i in v.failed[:shown]:
        case, run = v.cases[i], v.runs[i]
        lines.append(f"  {case.label}  (max_norm {case.max_norm:g})")
        for r, rank in enumerate(run.ranks):
            ops = ", ".join(rank.ops) if rank.ops else "no collective"
            lines.append(f"    rank {r}: {_holding(case.ranks[r])}; {_outcome_words(rank)}; entered {ops}")
        lines.append(f"    reason   {v.reasons[i]}")
        lines += [f"    {line}" for line in v.hints.get(i, [])]
    return lines
