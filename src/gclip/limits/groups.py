"""Per-group limits: every group's norm from the one header all-reduce, each group scaled
by its own limit.

An optimizer's parameter groups may need limits of their own: Muon's orthogonalised
matrices must not share AdamW's clip (DeepSpeed #8439: the default clip divides every
Muon update by its own norm; Megatron-LM #5394: one global clip over Muon groups stalls
training; xtuner PR #2001 clips the AdamW groups alone). Here each group's sum of |x|**p
rides the header as a vector of a fixed size (so that ranks passing different numbers of
groups disagree in the header's fingerprint, not in the collective's length): G groups
cost the one all-reduce that one group does. The inf-norm and the reproducible mode bring
every group's second pass in one collective too; only the overflow rescue (rare) runs per
group that needs it. A group whose limit is None is not clipped: its norm is reported. A
group's limit may be an adaptive clipper (ZClip, AutoClip: anything with ``decide(norm)``):
its group's global norm, from the same collective, is what it decides the limit from, so a
ZClip per group, or ZClip on AdamW's groups and none on Muon's, costs the one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import drivers, engine, partials, policy
from ..engine import root
from ..errors import GclipValueError
from ..layout import Counting

__all__ = [
    "MAX_GROUPS",
    "GroupsResult",
    "adaptive_name",
    "clip_groups",
    "engine_limit",
    "per_group",
    "program",
    "program_limits",
]

MAX_GROUPS = 64  # the header carries 2 slots per group, always all of them (see above)


class GroupsResult(NamedTuple):
    """What :func:`clip_groups` returns (the same on every rank but ``grads``)."""

    grads: list[Any]  # each group's arrays, scaled, in the layout given
    norms: list[float]  # each group's global norm
    scales: list[float]  # each group's factor: min(1, limit / norm); 1 where None or not finite


def adaptive_name(limit: Any) -> str | None:
    """A clipper given as a group's limit: its class's name (what the ranks agree on), else None."""
    return type(limit).__name__ if callable(getattr(limit, "decide", None)) else None


def engine_limit(agreed: float | str | None) -> Any:
    """The max_norm a group's call checks: none for a norm alone or a clipper's (decided later)."""
    return engine.NO_LIMIT if agreed is None or isinstance(agreed, str) else agreed


def program_limits(calls: Sequence[engine.Arguments], agreed: Sequence[Any]) -> list[float | str | None]:
    """What :func:`program` takes: each group's checked limit, None, or its clipper's name."""
    return [m if m is None or isinstance(m, str) else c.limit for c, m in zip(calls, agreed)]


def _combined_spec(calls: Sequence[engine.Arguments], limits: Sequence[float | str | None]) -> engine.Spec:
    first = calls[0].spec
    agreed = (("groups", len(calls)), ("max_norms", tuple(limits)), *first.extra[1:])
    return engine.Spec(first.norm_type, first.reproducible, agreed)


def _combined_counting(calls: Sequence[engine.Arguments]) -> Counting:
    """One ring for every group's layout (each group's is 0 over the ranks when it agrees)."""
    rings = [c.counting.ring for c in calls]

    def explain(summaries: list[Any]) -> str:
        said = [
            f"group {g}: {c.counting.explain([s[g] for s in summaries])}"
            for g, c in enumerate(calls)
            if c.counting.explain is not None
        ]
        return "; ".join(said) or "ranks disagree on which arrays a group holds"

    return Counting(
        None,
        (math.fsum(r[0] for r in rings), math.fsum(r[1] for r in rings)),
        [c.counting.summary for c in calls],
        explain,
    )


def program(
    calls: Sequence[engine.Arguments], limits: Sequence[float | str | None]
) -> Generator[engine.Reduce | engine.Gather, Any, list[tuple[float, float]]]:
    """One rank's (norm, factor) per group, from each group's checked arguments
    (``engine.check``, one call per group, all with the same settings but ``max_norm``). A
    limit that is a clipper's name gets factor 1 here: its clipper decides from the norm."""
    spec = _combined_spec(calls, limits)
    p, size = spec.norm_type, calls[0].size
    error = next((c.error for c in calls if c.error is not None), None)
    if error is None and len(calls) > MAX_GROUPS:
        error = GclipValueError(f"at most {MAX_GROUPS} groups per call, got {len(calls)}")
    counted = [
        c.arrays if c.counting.owned is None else [a for a, o in zip(c.arrays, c.counting.owned) if o]
        for c in calls
    ]
    extra, digits, tops, finite = [0.0] * (2 * MAX_GROUPS), [], [], True
    if error is None:
        try:
            for g, (c, arrays) in enumerate(zip(calls, counted)):
                sums = c.backend.partials
                if p == math.inf:
                    top, nan = sums.max_abs(arrays)
                    tops += [top, float(nan)]
                    finite = finite and not nan and math.isfinite(top)
                elif spec.reproducible:
                    digits.append(sums.binned_digits(partials.BinnedPowerSum(p), arrays))
                    finite = finite and math.isfinite(root(*partials.BinnedPowerSum(p).power(digits[-1]), p))
                else:
                    power, rescue = sums.power_sum(arrays, p)
                    extra[2 * g], extra[2 * g + 1] = power, float(rescue)
                    finite = finite and (rescue or math.isfinite(power))
        except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
            error = exc
    total = yield from engine.header(
        error, spec, _combined_counting(calls), size, 0.0, False, not finite, extra
    )

    groups = range(len(calls))
    if p == math.inf:  # MAX of every group's max|x|, NaN as a flag
        got = yield engine.Reduce(np.array(tops, dtype=np.float64), engine.NormOp.MAX)
        norms = [math.nan if got[2 * g + 1] > 0 else float(got[2 * g]) for g in groups]
    elif spec.reproducible:  # every group's digits in one SUM
        got = yield engine.Reduce(np.concatenate(digits))
        width = len(digits[0])
        binned = partials.BinnedPowerSum(p)
        norms = [root(*binned.power(got[g * width : (g + 1) * width]), p) for g in groups]
    else:
        norms = []
        for g in groups:
            if total.extra[2 * g + 1] > 0:  # this group's plain sum was unusable somewhere
                norms.append((yield from engine.rescued(counted[g], p, calls[g].backend.partials)))
            else:
                norms.append(root(total.extra[2 * g], 0, p))
    if calls[0].error_if_nonfinite and not all(math.isfinite(n) for n in norms):
        holders = yield engine.Gather(not finite)
        bad = next(n for n in norms if not math.isfinite(n))
        raise engine.nonfinite_error(p, bad, holders)
    return [
        (n, policy.scale(n, limit) if isinstance(limit, (int, float)) else 1.0)
        for n, limit in zip(norms, limits)
    ]


def per_group(replicated: Any, groups: int) -> list[Any]:
    """``replicated=`` as one entry per group: a list or tuple is one per group; anything
    else (None, True, a communicator, a mesh dimension's name) holds for every group."""
    return list(replicated) if isinstance(replicated, (list, tuple)) else [replicated] * groups


def clip_groups(
    groups: Sequence[Any],
    max_norms: Sequence[Any],
    *,
    comm: Any = None,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    inplace: bool = False,
    reproducible: bool = False,
    replicated: Sequence[Any] | None = None,
) -> GroupsResult:
    """Clip each group of this rank's arrays by its own limit and its own GLOBAL norm.

    Args:
        groups: one entry per group: an array, or a list of this rank's arrays.
        max_norms: one limit per group, finite and >= 0, None (not clipped; norm reported), or
            an adaptive clipper (``gclip.ZClip``, ``gclip.AutoClip``: it decides the group's
            limit from the group's global norm, its state advanced; the limit it decided is
            its ``decide``'s return, the factor in ``scales``).
        replicated: one ``replicated=`` entry per group (see ``clip_by_global_norm``), or one
            that is not a list or tuple (True, a communicator...) for every group.
        comm, norm_type, error_if_nonfinite, inplace, reproducible: as in ``clip_by_global_norm``.

    Every group's norm comes from the one header all-reduce. Bad input on any rank (a group
    refused, the ranks passing different numbers of groups or limits) raises the same
    error on every rank.
    """
    mpi = drivers.Mpi(drivers.communicator(comm))
    groups, limits = list(groups), list(max_norms)
    entries = per_group(replicated, len(groups))
    agreed = [adaptive_name(m) or m for m in limits]
    if len(limits) != len(groups) or len(entries) != len(groups):
        raise GclipValueError(f"max_norms and replicated need one entry per group ({len(groups)} groups)")
    calls = [
        engine.check(
            g,
            engine_limit(limit),
            rank=mpi.rank,
            size=mpi.size,
            comm=mpi.comm,
            replicated=entries[i],
            norm_type=norm_type,
            reproducible=reproducible,
            error_if_nonfinite=error_if_nonfinite,
            inplace=inplace,
        )
        for i, (g, limit) in enumerate(zip(groups, agreed))
    ]
    done = mpi.run(program(calls, program_limits(calls, agreed)))
    factors = [
        policy.scale(n, limits[g].decide(n)) if isinstance(agreed[g], str) else f  # the group's clipper
        for g, (n, f) in enumerate(done)
    ]
    return GroupsResult(
        [c.grads.scaled(factor, inplace) for c, factor in zip(calls, factors)], [n for n, _ in done], factors
    )
