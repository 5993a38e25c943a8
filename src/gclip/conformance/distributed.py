"""The distributed judge: build the cases, run them on the judge's own job, judge the outcomes.

``judge_distributed`` is what ``python -m gclip.conformance FILE.py:FUNC
--ranks R`` (with ``--torch`` or ``--layout``) runs. The expected outputs and
every gallery bug's are computed here, in the judge's process, with gclip on
simulated ranks holding the very inputs the real ranks get.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..clip import apply_scale
from ..gallery import STRATEGIES, TORCH_EPS, clip_simulated
from . import implied, layout_cases
from .dist_verdict import (
    EPSILON,
    FLOAT16_TOTAL,
    FLOAT32,
    DistCase,
    DistVerdict,
    Variant,
    expected_case,
    gallery_names,
    judge_runs,
)
from .families import ALL_CASES, Family, choose, family_of
from .job import JobSpec, run_cases
from .spread import RankCase, make_rank_cases
from .target import Target

__all__ = ["judge_distributed", "rank_cases"]


def _try(run: Any) -> Any:
    try:
        return run()
    except Exception:  # noqa: BLE001 - a bug that cannot run on this data never matches
        return None


def rank_cases(
    size: int, count: int, seed: int, family: Family = ALL_CASES
) -> tuple[list[Any], list[DistCase], dict[str, list]]:
    """(the cases the ranks run, the verdict's view of them, each gallery bug's outputs)."""
    cases = choose(make_rank_cases(size, count, seed), family)
    views = [expected_case(c.label, c.ranks, c.max_norm, clip_simulated(c.ranks, c.max_norm)) for c in cases]
    gallery: dict[str, list[Any]] = {
        name: [_try(lambda c=c, name=name: _bug_outputs(c, name)) for c in cases]
        for name in gallery_names(layout=False)
    }
    # each bug as real code writes it too: with torch's epsilon, in float32, or both
    # (torch's own clip_grad_norm_ on each rank's shard is per-rank with both)
    for name in gallery:
        has_epsilon = STRATEGIES[name].has_epsilon if name in STRATEGIES else True
        gallery[name] = [_variants(c, out, has_epsilon) for c, out in zip(cases, gallery[name])]
    # fp16-sumsq with the all-reduce in float16 too (a float16 norm all-reduced as it is):
    # the total overflows where each rank's share does not
    gallery["fp16-sumsq"] = [
        _wiped_if_total_overflows(c, v, out) for c, v, out in zip(cases, views, gallery["fp16-sumsq"])
    ]
    return cases, views, gallery


def _wiped_if_total_overflows(case: RankCase, view: DistCase, outputs: Any) -> Any:
    if outputs is None or not view.norm**2 > float(np.finfo(np.float16).max):
        return outputs
    wiped = [[np.zeros_like(a) for a in arrays] for arrays in case.ranks]
    return (*outputs, Variant(wiped, (FLOAT16_TOTAL,)))


def _variants(case: RankCase | DistCase, outputs: Any, has_epsilon: bool) -> Any:
    """A bug's outputs, then the same with torch's epsilon, in float32, and both."""
    if outputs is None:
        return None
    eps = None if has_epsilon else _try(lambda: _with_epsilon(case, outputs))
    found: list[Any] = [outputs]
    if eps is not None:
        found.append(Variant(eps, (EPSILON,)))
    found.append(Variant(outputs, (FLOAT32,)))
    if eps is not None:
        found.append(Variant(eps, (FLOAT32, EPSILON)))
    return tuple(found)


def _bug_outputs(case: RankCase, name: str) -> list[list[np.ndarray]]:
    return [list(r.grads) for r in clip_simulated(case.ranks, case.max_norm, mode=name)]


def _with_epsilon(
    case: RankCase | DistCase, outputs: Sequence[Sequence[np.ndarray]]
) -> list[list[np.ndarray]]:
    """A bug's outputs had it divided by its norm + 1e-6, as torch and Megatron-LM do: each rank
    that scaled by max_norm / n scales by max_norm / (n + 1e-6) instead (read off the outputs)."""
    out = []
    for given, got in zip(case.ranks, outputs):
        # the scale from the rank's float64 arrays where it has some: float32 blurs it
        wide = [(x, y) for x, y in zip(given, got) if x.dtype == np.float64 and np.any(x)]
        pairs = wide or list(zip(given, got))
        scale = implied.applied([x for x, _ in pairs], [y for _, y in pairs], implied.SAME).scale
        if scale is None or not 0.0 < scale < 1.0:
            out.append(list(got))  # unchanged, nothing to scale, or wiped out: the epsilon is no matter
            continue
        norm = case.max_norm / scale
        out.append(list(apply_scale(given, min(1.0, case.max_norm / (norm + TORCH_EPS)))))
    return out


def _layout_family(cases: Sequence[Any], family: Family) -> list[Any]:
    """The layout cases of ``family``: in its dtype, with max_norm > 0, no frozen stage."""
    out, labels = [], set()
    for c in cases:
        if (family.positive and not c.max_norm > 0) or (family.nonempty and c.frozen):
            continue
        if family.dtype is not None and c.dtype != family.dtype:
            c = c._replace(dtype=family.dtype, label=c.label.replace(c.dtype, family.dtype))
        if c.label not in labels:  # the fixed cases of the other dtype become this dtype's
            labels.add(c.label)
            out.append(c)
    return out


def _layout_cases(
    shape: dict[str, int], count: int, seed: int, family: Family = ALL_CASES
) -> tuple[list[Any], list[DistCase], dict]:
    cases = _layout_family(layout_cases.make_layout_cases(shape, count, seed), family)
    views = []
    for c in cases:
        ranks, entries = layout_cases._simulated_inputs(c, shape, None)
        out = clip_simulated(ranks, c.max_norm, replicated=entries)
        views.append(expected_case(c.label, ranks, c.max_norm, out))
    gallery = {
        name: [_try(lambda c=c, name=name: layout_cases.simulate(c, shape, name)) for c in cases]
        for name in gallery_names(layout=True)
    }
    # as in the rank form: each bug also with torch's epsilon, in float32, or both
    for name, outputs in gallery.items():
        has_epsilon = STRATEGIES[name].has_epsilon if name in STRATEGIES else False
        gallery[name] = [_layout_variants(v, out, has_epsilon) for v, out in zip(views, outputs)]
    return cases, views, gallery


def _layout_variants(view: DistCase, outputs: Any, has_epsilon: bool) -> Any:
    """A layout bug's outputs (one per-rank list, or a tuple of readings) with their variants."""
    if isinstance(outputs, tuple):
        return tuple(v for reading in outputs for v in (_variants(view, reading, has_epsilon) or ()))
    return _variants(view, outputs, has_epsilon)


def _layout_pairs(shape: dict[str, int], cases: list[Any]) -> dict[str, list[Any]]:
    """Each pair of layout bugs' outputs on the cases (asked for only when no single bug matches)."""
    return {
        bug.name: [_try(lambda c=c, bug=bug: layout_cases.simulate(c, shape, bug)) for c in cases]
        for bug in layout_cases.layout_pairs(shape)
    }


def judge_distributed(
    target: Target,
    size: int,
    *,
    count: int = 200,
    seed: int = 0,
    timeout: float = 5.0,
    torch: bool = False,
    layout: dict[str, int] | None = None,
    family: Family = ALL_CASES,
) -> DistVerdict:
    """Run FUNC on ``size`` ranks over every case of ``family`` and judge what each rank did."""
    if layout is not None:
        size = math.prod(layout.values())
        cases, views, gallery = _layout_cases(layout, count, seed, family)
        mode = "torch-layout" if torch else "layout"
    else:
        cases, views, gallery = rank_cases(size, count, seed, family)
        mode = "torch" if torch else "numpy"
    spec = JobSpec(target, size, mode, layout, timeout)
    runs = run_cases(spec, cases, [family_of(v.ranks) for v in views])
    note = runs.note
    if family:
        note = f"cases of one family: {family.words()}" + (f"; {note}" if note else "")
    ran = runs.ran
    if ran is not None:  # the cases of a family that crashed were left out: judge those that ran
        views = [views[i] for i in ran]
        gallery = {name: [outputs[i] for i in ran] for name, outputs in gallery.items()}
    pairs = None
    if layout is not None:
        shape, judged = layout, cases

        def pairs() -> dict[str, list[Any]]:
            found = _layout_pairs(shape, judged)
            return {k: v if ran is None else [v[i] for i in ran] for k, v in found.items()}

    return judge_runs(
        str(target),
        size,
        views,
        runs.runs,
        gallery,
        runs.stopped,
        note,
        not_run=runs.not_run or {},
        pairs=pairs,
    )
