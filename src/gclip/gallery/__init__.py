"""The lab's gallery of clipping bugs, and the entry that runs them.

The bugs (``BUGS``: how the norm is combined; ``LAYOUT_BUGS``: a correct clip
told the wrong layout; ``USAGE_BUGS``: a correct clip called at the wrong
moment), each with where it was seen, live in :mod:`gclip.gallery.bugs`; the bugs of
adaptive, unit-wise and per-group limits (``LIMIT_BUGS``) in :mod:`gclip.gallery.limit_bugs`.

The functions here are gclip's, plus ``mode=``: ``"global"`` (the correct
clip) or a bug's name. Each runs the bug as the lab's own program
(:mod:`gclip.gallery.program`) over the core's checks, drivers and local sums;
the production functions have no such argument. The demo, the trainer, the
judge and the bench call these; ``gclip.gallery.torch`` does the same for
``gclip.torch.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import drivers, engine, layout
from . import bugs
from .bugs import *  # noqa: F403 - the gallery's names, as bugs.__all__ lists them
from .limit_bugs import LIMIT_BUG_NAMES, LIMIT_BUGS, LimitBug
from .program import Result, program

__all__ = [
    *bugs.__all__,
    "LIMIT_BUGS",
    "LIMIT_BUG_NAMES",
    "LimitBug",
    "Result",
    "clip_by_global_norm",
    "clip_simulated",
    "global_norm",
]


def global_norm(grads: Any, *, mode: str = "global", comm: Any = None, **settings: Any) -> float:
    """:func:`gclip.global_norm` as bug ``mode`` computes it (``"global"``: the correct one)."""
    mpi = drivers.Mpi(drivers.communicator(comm))
    args = engine.check(grads, engine.NO_LIMIT, rank=mpi.rank, size=mpi.size, comm=mpi.comm, **settings)
    return mpi.run(program(mode, args, mpi.rank)).norm


def clip_by_global_norm(
    grads: Any,
    max_norm: float,
    *,
    mode: str = "global",
    comm: Any = None,
    inplace: bool = False,
    **settings: Any,
) -> Result:
    """:func:`gclip.clip_by_global_norm` as bug ``mode`` clips."""
    mpi = drivers.Mpi(drivers.communicator(comm))
    args = engine.check(
        grads, max_norm, rank=mpi.rank, size=mpi.size, comm=mpi.comm, inplace=inplace, **settings
    )
    return mpi.run(program(mode, args, mpi.rank)).result(args, inplace)


def clip_simulated(
    ranks: Sequence[Any],
    max_norm: float,
    *,
    mode: str = "global",
    replicated: Any = None,
    inplace: bool = False,
    **settings: Any,
) -> list[Result]:
    """:func:`gclip.clip_simulated` as bug ``mode`` clips."""
    size = len(ranks)
    calls = [
        engine.check(g, max_norm, rank=r, size=size, replicated=entries, inplace=inplace, **settings)
        for r, (g, entries) in enumerate(zip(ranks, layout.for_ranks(replicated, size)))
    ]
    outcomes = drivers.run_simulated([program(mode, args, r) for r, args in enumerate(calls)])
    return [out.result(args, inplace) for args, out in zip(calls, outcomes)]
