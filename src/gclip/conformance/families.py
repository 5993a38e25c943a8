"""Case families a user can choose: what real clipping code assumes of its input.

Real code asserts float32 gradients (Megatron-LM), stacks per-rank norms that must share a dtype
across ranks (FSDP-style code), cannot run on a rank that holds nothing, or reads a limit of 0 as
"clipping off" (Megatron-LM, DeepSpeed). Such code fails the judge's default cases for a reason
that is no bug of its norm; a family keeps only the cases it supports:

``dtype``     every array cast to this dtype (cases whose values it cannot hold are left out);
``nonempty``  only cases where every rank holds at least one value;
``positive``  only cases with max_norm > 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .spread import RankCase

__all__ = ["ALL_CASES", "DTYPES", "Family", "choose", "family_lines", "family_of"]

DTYPES = ("float16", "float32", "float64")


class Family(NamedTuple):
    dtype: str | None = None
    nonempty: bool = False
    positive: bool = False

    def __bool__(self) -> bool:
        return self.dtype is not None or self.nonempty or self.positive

    def words(self) -> str:
        """'float32 only, every rank holds values, max_norm > 0'."""
        parts = [f"{self.dtype} only"] if self.dtype else []
        parts += ["every rank holds values"] if self.nonempty else []
        parts += ["max_norm > 0"] if self.positive else []
        return ", ".join(parts)

    def flags(self) -> str:
        """The command's flags for this family."""
        out = f" --dtype {self.dtype}" if self.dtype else ""
        out += " --nonempty-ranks" if self.nonempty else ""
        return out + (" --positive-max-norm" if self.positive else "")


ALL_CASES = Family()  # the default: every case


def _cast(case: RankCase, dtype: str) -> RankCase | None:
    with np.errstate(over="ignore"):
        ranks = [[np.asarray(a).astype(dtype) for a in arrays] for arrays in case.ranks]
    if not all(np.all(np.isfinite(a)) for arrays in ranks for a in arrays):
        return None  # values beyond the dtype's range: not a case of this family
    return case._replace(ranks=ranks)


def choose(cases: Sequence[RankCase], family: Family) -> list[RankCase]:
    """The cases of ``family`` (all of them when it is the default one)."""
    out = []
    for case in cases:
        if family.positive and not case.max_norm > 0:
            continue
        if family.nonempty and any(sum(a.size for a in arrays) == 0 for arrays in case.ranks):
            continue
        if family.dtype is not None:
            cast = _cast(case, family.dtype)
            if cast is None:
                continue
            case = cast
        out.append(case)
    return out


def family_of(ranks: Sequence[Sequence[np.ndarray]]) -> str:
    """A case's family: the dtypes of its arrays (empty ones too: code that stacks per-array norms
    promotes to them), and whether a rank holds no values ('float32 and float64, a rank with
    nothing')."""
    dtypes = sorted({a.dtype.name for arrays in ranks for a in arrays})
    empty = any(sum(a.size for a in arrays) == 0 for arrays in ranks)
    return (" and ".join(dtypes) or "no arrays") + (", a rank with nothing" if empty else "")


def family_lines(verdict: Any) -> list[str]:
    """Per family of the cases (their dtypes, whether a rank holds nothing): how many passed,
    raised or did not finish, and how many were not run (a family whose cases crashed is left
    after a few, the others go on), when some case raised or did not finish; else nothing. Says
    which family a function cannot take (``--dtype`` and ``--nonempty-ranks`` keep the others)."""
    words = (" raised ", "died", "waited")
    not_run = dict(getattr(verdict, "not_run", ()) or ())
    if not not_run and not any(k in verdict.reasons.get(i, "") for i in verdict.failed for k in words):
        return []
    counts: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in not_run}
    for i, case in enumerate(verdict.cases):
        row = counts.setdefault(family_of(case.ranks), [0, 0, 0, 0])  # run, passed, raised, lost
        row[0] += 1
        run = verdict.runs[i]
        if i not in verdict.reasons:
            row[1] += 1
        elif run.lost is not None:
            row[3] += 1
        elif any(r.kind == "raised" for r in run.ranks):
            row[2] += 1
    lines = ["  by family of cases:"]
    for name, (run, passed, raised, lost) in sorted(counts.items()):
        if run and raised + lost == run and name in not_run:
            each = f"each of the {run} cases" if run > 1 else "the one case"
            parts = [f"crashed on {each} run (a rank raised or died)"]
        elif run and raised == run:
            parts = ["raised on every case"]
        else:
            parts = [f"{passed} of {run} pass"]
            parts += [f"{raised} raised"] if raised else []
            parts += [f"{lost} did not finish"] if lost else []
        if name in not_run:
            parts.append(f"the other {not_run[name]} not run (the other families went on)")
        lines.append(f"    {name:<40} {', '.join(parts)}")
    return lines
