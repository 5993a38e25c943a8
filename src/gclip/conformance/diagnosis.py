"""``gclip.testing.diagnose``: what a real training step's clip did, from its gradients before and after.

Every rank passes the gradients it held before its clip and after it. From
them: the scale each rank applied (least squares, ``implied.applied``),
whether all ranks applied the same one, the norm that scale implies, and the
true global norm (``gclip.global_norm`` on the gradients before). Each
strategy of the gallery gives the scale it would have applied on each rank
(``gclip.gallery.global_norm(..., mode=NAME)``: one small all-reduce each, no copy of
the gradients); the strategies whose scales equal the observed ones on every
rank are the matches. Every rank returns the same :class:`Diagnosis`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import gallery
from ..errors import GclipValueError
from . import implied
from .hangs import rank_list

__all__ = ["Diagnosis", "diagnose"]

RTOL = {"float64": 1e-9, "float32": 2e-6, "float16": 2e-3}  # how close two scales are "the same"


class Diagnosis(NamedTuple):
    """What one clip step did, the same on every rank."""

    scales: list[float | None]  # per rank: the scale it applied (None: it held nothing non-zero)
    same_scale: bool  # every rank applied the same scale
    uniform: list[bool]  # per rank: every value got the one scale
    implied_norms: list[float | None]  # per rank: max_norm / scale, when it clipped
    global_norm: float  # the true norm of the gradients before the clip
    expected_scale: float  # min(1, max_norm / global_norm)
    matches: list[str]  # the strategies whose scales equal the observed ones on every rank
    bug: str | None  # None: the clip is correct; a gallery bug's name; or "unknown"
    clipped: bool  # the step was clipped (else most bugs cannot be told apart)
    local_norms: list[float]  # per rank: the norm of what it holds (copies counted)
    lines: list[str]  # the report, for a learner

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _arrays(value: Any, what: str) -> list[np.ndarray]:
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):
        value = [value]
    out = []
    for v in value:
        if hasattr(v, "detach"):  # torch
            v = v.detach().cpu().numpy()
        out.append(np.asarray(v))
    return out


def _check(before: list[np.ndarray], after: list[np.ndarray]) -> str | None:
    if len(before) != len(after):
        return f"{len(before)} arrays before the clip but {len(after)} after"
    for i, (b, a) in enumerate(zip(before, after)):
        if b.size != a.size:
            return f"array {i} has {b.size} values before the clip but {a.size} after"
        if b.dtype.kind != "f" or a.dtype.kind != "f":
            return f"array {i} is not a float array ({b.dtype} before, {a.dtype} after)"
    return None


def _same(a: float | None, b: float | None, rtol: float) -> bool:
    if a is None or b is None:
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


def diagnose(
    before: Any,
    after: Any,
    max_norm: float,
    *,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
) -> Diagnosis:
    """What this step's clip did on every rank of ``comm`` (collective: call it on every rank).

    ``before``/``after``: this rank's gradients (a list of arrays, numpy or
    torch) before and after the clip; ``replicated``: as for
    ``gclip.clip_by_global_norm``, if some arrays are copies.
    """
    from .._validate import communicator
    from .._validate import max_norm as checked_limit

    comm = communicator(comm)
    limit = checked_limit(max_norm)
    b, a = _arrays(before, "before"), _arrays(after, "after")
    problem = _check(b, a)
    problems = comm.allgather(problem)  # every rank raises the same error, or none does
    bad = [r for r, p in enumerate(problems) if p]
    if bad:
        raise GclipValueError(f"diagnose: rank {bad[0]}: {problems[bad[0]]}")
    rtol = max((RTOL.get(x.dtype.name, 1e-9) for x in b), default=1e-9)
    mine = implied.applied(b, a, rtol)
    norms = {}
    for s in (gallery.GLOBAL, *gallery.BUGS):
        if s.norm_type is None:  # inf-pow shows only with norm_type=inf: never with a 2-norm clip
            norms[s.name] = gallery.global_norm(b, comm=comm, mode=s.name, replicated=replicated)
    true_norm = norms["global"]
    would = {name: gallery.STRATEGIES[name].scale(n, limit) for name, n in norms.items()}
    table = comm.allgather((mine.scale, mine.uniform, rtol, would, norms["per-rank"]))
    scales = [row[0] for row in table]
    uniform = [row[1] for row in table]
    tol = max(row[2] for row in table)
    told = [s for s in scales if s is not None]
    same = all(_same(s, told[0], tol) for s in told) if told else True
    expected = gallery.GLOBAL.scale(true_norm, limit)
    matches = [
        name
        for name in would
        if all(uniform) and all(_same(row[0], row[3][name], tol) for row in table if row[0] is not None)
    ]
    # a bug that gives the correct scale on every rank cannot show in this step: not a match
    shows = {name for name in would if not all(_same(row[3][name], row[3]["global"], tol) for row in table)}
    matches = [m for m in matches if m == "global" or m in shows]
    bug: str | None = None if "global" in matches else (matches[0] if matches else "unknown")
    clipped = expected < 1.0 - implied.SAME or any(s is not None and s < 1.0 - tol for s in told)
    diag = Diagnosis(
        scales,
        same,
        uniform,
        [implied.implied_norm(s, limit) for s in scales],
        true_norm,
        expected,
        matches,
        bug,
        clipped,
        [row[4] for row in table],
        [],
    )
    return diag._replace(lines=_lines(diag, limit))


def _lines(d: Diagnosis, limit: float) -> list[str]:
    size = len(d.scales)
    lines = [f"gclip.testing.diagnose: one clip step on {size} rank{'s' * (size != 1)} (max_norm {limit:g})"]
    lines.append(
        f"  global norm {d.global_norm:.6g}: the correct scale is {d.expected_scale:.6g} on every rank"
    )
    for r, (s, ok) in enumerate(zip(d.scales, d.uniform)):
        words = implied.scale_words(s, limit, implied.digits_to_tell(s or 0.0, d.expected_scale))
        norm = d.implied_norms[r]
        own = d.local_norms[r]
        if norm is not None and own > 0 and not d.same_scale and abs(norm - own) <= 1e-6 * own:
            words += ": its own norm"
        lines.append(f"  rank {r}: {words}{'' if ok else ', not one scale for all its values'}")
    if d.same_scale:
        lines.append("  every rank applied the same scale")
    else:
        lines.append("  the ranks applied different scales: a clip must apply one scale everywhere")
    if d.bug is None:
        lines.append("verdict: correct: the global-norm clip")
    elif d.bug == "unknown":
        lines.append("verdict: wrong, like no bug of the gallery")
    else:
        bug = gallery.STRATEGIES[d.bug]
        lines.append(f"verdict: wrong: {bug.name}: {bug.summary}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        if len(d.matches) > 1:
            lines.append(f"  (this step cannot tell it from {', '.join(d.matches[1:])})")
    if not d.clipped:
        lines.append(
            "  note: this step was not clipped (the norm is below max_norm), so most bugs look correct; "
            "diagnose a step with a larger gradient or a smaller max_norm"
        )
    wrong = [
        r
        for r, s in enumerate(d.scales)
        if s is not None and not math.isclose(s, d.expected_scale, rel_tol=1e-6)
    ]
    if wrong and d.bug is not None:
        lines.append(f"  ranks off the correct scale: {rank_list(wrong)}")
    return lines
