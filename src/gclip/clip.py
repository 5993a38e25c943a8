"""The public API: the global norm, the scale, and the clip.

``grads`` is this rank's part of the gradient: one array, or a list, tuple or
any iterable of arrays of any shapes (float16, float32 or float64, either byte
order; numpy arrays, or anything numpy can view without a copy). The same
array given twice (tied weights) counts once and is scaled once.

``comm`` is an mpi4py communicator; ``None`` means ``COMM_WORLD``, and is
refused when MPI sees one rank but the process was started as one of several
(torchrun, a launcher without MPI support): clipping alone there is the very
bug gclip exists to prevent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from . import drivers, engine, layout, policy, reader
from .drivers import Comm
from .errors import GclipValueError

__all__ = [
    "ClipResult",
    "apply_scale",
    "clip_by_global_norm",
    "clip_scale",
    "clip_simulated",
    "clip_with_norm",
    "global_norm",
]


class ClipResult(NamedTuple):
    """What :func:`clip_by_global_norm` returns (the same on every rank but ``grads``)."""

    grads: Any  # the layout given: one array, a list or a tuple
    total_norm: float  # the global norm, as computed (inf or NaN if the gradient is)
    scale: float  # the factor applied: min(1, max_norm / total_norm), 1 if not finite
    finite: bool  # False: the norm is inf/NaN and the gradients were left untouched

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


def _clipped(args: engine.Arguments, norm: float, scale: float, inplace: bool) -> ClipResult:
    """One rank's result: its arrays scaled (by their reader, in the layout given)."""
    return ClipResult(args.grads.scaled(scale, inplace), norm, scale, norm < math.inf)  # NaN: False


def global_norm(
    grads: Any,
    *,
    comm: Comm | None = None,
    norm_type: float | str = 2.0,
    reproducible: bool = False,
    replicated: Sequence[Any] | None = None,
    error_if_nonfinite: bool = False,
) -> float:
    """The norm of the whole gradient, whose parts live on the ranks of ``comm``.

    Each rank reduces the arrays it counts to a partial (in float64), one
    all-reduce combines the partials, and every rank gets the same float.

    Args:
        grads: this rank's arrays (one array, or a list, tuple or iterable).
        comm: mpi4py communicator over which the gradient lives (None: COMM_WORLD).
        norm_type: p > 0, or ``inf`` / ``"inf"`` for the max-norm.
        reproducible: the same bits for any rank count and layout (p in 1, 2, inf).
        replicated: one entry per array: False (a shard), True (the same on
            every rank of ``comm``) or the communicator of the ranks that hold
            identical copies; a copy counts once (see ``gclip.layout``).
        error_if_nonfinite: raise NonFiniteNormError on every rank if the norm is inf or NaN.
    """
    mpi = drivers.Mpi(drivers.communicator(comm))
    args = engine.check(
        grads,
        engine.NO_LIMIT,
        rank=mpi.rank,
        size=mpi.size,
        comm=mpi.comm,
        replicated=replicated,
        norm_type=norm_type,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
    )
    return mpi.run(engine.program(args))[0]


def clip_by_global_norm(
    grads: Any,
    max_norm: float,
    *,
    comm: Comm | None = None,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    inplace: bool = False,
    reproducible: bool = False,
    replicated: Sequence[Any] | None = None,
) -> ClipResult:
    """Scale this rank's arrays by min(1, max_norm / global norm), the same on every rank.

    Bad input on any rank raises the same error on every rank (no rank is left
    waiting in a collective). A non-finite global norm raises
    :class:`NonFiniteNormError` with ``error_if_nonfinite=True``; otherwise the
    gradients are left untouched and ``finite`` is False, so the caller can skip
    the step.

    Args:
        grads: this rank's arrays (one array, or a list, tuple or iterable).
        max_norm: the limit, finite and >= 0.
        inplace: scale the given arrays in place (skipped when the scale is 1);
            otherwise new arrays of the same dtypes are returned.
        comm, norm_type, reproducible, replicated: as in :func:`global_norm`.

    Returns:
        ClipResult with ``grads`` in the layout given, ``total_norm``, ``scale``, ...
    """
    mpi = drivers.Mpi(drivers.communicator(comm))
    args = engine.check(
        grads,
        max_norm,
        rank=mpi.rank,
        size=mpi.size,
        comm=mpi.comm,
        replicated=replicated,
        norm_type=norm_type,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
        inplace=inplace,
    )
    norm, scale = mpi.run(engine.program(args))
    return ClipResult(args.grads.scaled(scale, inplace), norm, scale, norm < math.inf)  # as _clipped


def clip_simulated(
    ranks: Sequence[Any],
    max_norm: float,
    *,
    norm_type: float | str = 2.0,
    reproducible: bool = False,
    replicated: Sequence[Any] | None = None,
    error_if_nonfinite: bool = False,
    inplace: bool = False,
) -> list[ClipResult]:
    """:func:`clip_by_global_norm` on ``len(ranks)`` simulated ranks, in one process.

    ``ranks[r]`` is what rank r would pass as ``grads``. ``replicated`` is one
    list for every rank (flags), or one list per rank (``replicated[r]``, with
    :class:`gclip.layout.Group` entries for groups). The same engine runs as on
    real ranks; only the all-reduce is a sum over a list.
    """
    size = len(ranks)
    calls = [
        engine.check(
            g,
            max_norm,
            rank=r,
            size=size,
            replicated=entries,
            norm_type=norm_type,
            reproducible=reproducible,
            error_if_nonfinite=error_if_nonfinite,
            inplace=inplace,
        )
        for r, (g, entries) in enumerate(zip(ranks, layout.for_ranks(replicated, size)))
    ]
    outcomes = drivers.run_simulated([engine.program(args) for args in calls])
    return [_clipped(args, norm, scale, inplace) for args, (norm, scale) in zip(calls, outcomes)]


def clip_scale(total_norm: float, max_norm: float) -> float:
    """The scale a clip applies: min(1, max_norm / total_norm); 1 for a zero norm;
    1 for an inf or NaN norm (the gradient is left untouched: skip the step)."""
    limit = engine.max_norm(max_norm)
    norm = engine._scalar(total_norm, "total_norm")
    if norm < 0:
        raise GclipValueError(f"total_norm must be >= 0, got {norm!r}")
    return policy.scale(norm, limit)


# what comes back is laid out as given: an array for an array, a list for a list, a tuple for a tuple
@overload
def clip_with_norm(
    grads: np.ndarray, max_norm: float, total_norm: float, *, inplace: bool = ...
) -> np.ndarray: ...
@overload
def clip_with_norm(
    grads: list[np.ndarray], max_norm: float, total_norm: float, *, inplace: bool = ...
) -> list[np.ndarray]: ...
@overload
def clip_with_norm(
    grads: tuple[np.ndarray, ...], max_norm: float, total_norm: float, *, inplace: bool = ...
) -> tuple[np.ndarray, ...]: ...
@overload
def clip_with_norm(grads: Any, max_norm: float, total_norm: float, *, inplace: bool = ...) -> Any: ...
def clip_with_norm(grads: Any, max_norm: float, total_norm: float, *, inplace: bool = False) -> Any:
    """The second half of a clip, for a norm already known (e.g. from :func:`global_norm`):
    ``apply_scale(grads, clip_scale(total_norm, max_norm))``. Local: no communication."""
    return apply_scale(grads, clip_scale(total_norm, max_norm), inplace=inplace)


@overload
def apply_scale(grads: np.ndarray, scale: float, *, inplace: bool = ...) -> np.ndarray: ...
@overload
def apply_scale(grads: list[np.ndarray], scale: float, *, inplace: bool = ...) -> list[np.ndarray]: ...
@overload
def apply_scale(
    grads: tuple[np.ndarray, ...], scale: float, *, inplace: bool = ...
) -> tuple[np.ndarray, ...]: ...
@overload
def apply_scale(grads: Any, scale: float, *, inplace: bool = ...) -> Any: ...
def apply_scale(grads: Any, scale: float, *, inplace: bool = False) -> Any:
    """Multiply arrays by ``scale`` (finite, >= 0), each in its own dtype.

    float64 is multiplied as it is; float32 by the scale rounded toward zero
    (so rounding cannot lift a clipped norm above its limit); float16, and float32
    by a scale outside float32's normal range, in float64, rounded once. In place, a
    scale of exactly 1 touches nothing and the very objects given come back; an array
    given twice is scaled once.
    Returns the layout given (a tuple stays a tuple).
    """
    return reader.grads(grads, inplace).scaled(engine.scale(scale), inplace)
