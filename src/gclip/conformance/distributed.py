"""The distributed judge: build the cases, run them on the judge's own job, judge the outcomes.

``judge_distributed`` is what ``python -m gclip.conformance FILE.py:FUNC
--ranks R`` (with ``--torch`` or ``--layout``) runs. The expected outputs and
every gallery bug's are computed here, in the judge's process, with gclip on
simulated ranks holding the very inputs the real ranks get.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..clip import apply_scale
from ..gallery import TORCH_EPS, clip_simulated
from . import layout_cases
from .dverdict import DistCase, DistVerdict, Loose, expected_case, gallery_names, judge_runs
from .job import JobSpec, run_cases
from .spread import RankCase, make_rank_cases
from .target import Target

__all__ = ["judge_distributed", "rank_cases"]


def _try(run: Any) -> Any:
    try:
        return run()
    except Exception:  # noqa: BLE001 - a bug that cannot run on this data never matches
        return None


def rank_cases(size: int, count: int, seed: int) -> tuple[list[Any], list[DistCase], dict[str, list]]:
    """(the cases the ranks run, the verdict's view of them, each gallery bug's outputs)."""
    cases = make_rank_cases(size, count, seed)
    views = [expected_case(c.label, c.ranks, c.max_norm, clip_simulated(c.ranks, c.max_norm)) for c in cases]
    gallery: dict[str, list[Any]] = {
        name: [_try(lambda c=c, name=name: _bug_outputs(c, name)) for c in cases]
        for name in gallery_names(layout=False)
    }
    # torch's own clip_grad_norm_ on each rank's shard: per-rank, with torch's epsilon
    gallery["per-rank"] = [
        (outputs, Loose(_try(lambda c=c: _per_rank_epsilon(c))))
        for outputs, c in zip(gallery["per-rank"], cases)
    ]
    return cases, views, gallery


def _bug_outputs(case: RankCase, name: str) -> list[list[np.ndarray]]:
    return [list(r.grads) for r in clip_simulated(case.ranks, case.max_norm, mode=name)]


def _per_rank_epsilon(case: RankCase) -> list[list[np.ndarray]]:
    out = []
    for arrays in case.ranks:
        local = math.sqrt(math.fsum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays))
        out.append(list(apply_scale(arrays, min(1.0, case.max_norm / (local + TORCH_EPS)))))
    return out


def _layout_cases(shape: dict[str, int], count: int, seed: int) -> tuple[list[Any], list[DistCase], dict]:
    cases = layout_cases.make_layout_cases(shape, count, seed)
    views = []
    for c in cases:
        ranks, entries = layout_cases._simulated_inputs(c, shape, None)
        out = clip_simulated(ranks, c.max_norm, replicated=entries)
        views.append(expected_case(c.label, ranks, c.max_norm, out))
    gallery = {
        name: [_try(lambda c=c, name=name: layout_cases.simulate(c, shape, name)) for c in cases]
        for name in gallery_names(layout=True)
    }
    return cases, views, gallery


def judge_distributed(
    target: Target,
    size: int,
    *,
    count: int = 200,
    seed: int = 0,
    timeout: float = 5.0,
    torch: bool = False,
    layout: dict[str, int] | None = None,
) -> DistVerdict:
    """Run FUNC on ``size`` ranks over every case and judge what each rank did."""
    if layout is not None:
        size = math.prod(layout.values())
        cases, views, gallery = _layout_cases(layout, count, seed)
        mode = "layout"
    else:
        cases, views, gallery = rank_cases(size, count, seed)
        mode = "torch" if torch else "numpy"
    spec = JobSpec(target, size, mode, layout, timeout)
    runs = run_cases(spec, cases)
    return judge_runs(str(target), size, views, runs.runs, gallery, runs.stopped, runs.note)
