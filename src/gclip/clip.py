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

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from . import _kernels, _validate, engine, layout, partials, strategies
from .comm import Comm
from .errors import GclipTypeError, GclipValueError

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
    local_norm: float  # this rank's own norm (the arrays it counts)
    local_power: float  # this rank's sum |x|**p (its max |x| for the inf-norm)

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


# ---------------------------------------------------------------------------
# one rank's checked call


class _Call(NamedTuple):
    """One rank's checked arguments (or the error to agree on)."""

    grads: _validate.Grads
    spec: engine.Spec
    max_norm: float
    error_if_nonfinite: bool
    inplace: bool
    counting: engine.Counting
    error: BaseException | None


_NO_LIMIT = object()  # global_norm: no max_norm to check
_FALLBACK_SPEC = engine.Spec(strategies.GLOBAL, 2.0, False)  # what a refusing rank reports
_NOTHING = _validate.Grads([], None, list)


def _prepare(
    grads: Any,
    max_norm: Any,
    *,
    rank: int,
    size: int,
    comm: Any = None,
    norm_type: Any = 2.0,
    mode: Any = "global",
    inplace: bool = False,
    reproducible: bool = False,
    error_if_nonfinite: bool = False,
    replicated: Sequence[Any] | None = None,
) -> _Call:
    """Check every argument; an error is kept, to be agreed on by all ranks.

    The fingerprint that ranks compare holds the checked scalar values (1 and
    1.0 are the same limit); what each group of ranks holds in common is
    checked by the layout's ring sums (see ``layout``).
    """
    given, spec, limit = _NOTHING, _FALLBACK_SPEC, math.nan  # kept if an argument is refused
    counting = engine.EVERY_ARRAY
    error: BaseException | None = None
    try:
        spec, limit = _settings(mode, norm_type, max_norm, bool(reproducible), bool(error_if_nonfinite))
        given = _validate.grads(grads, inplace)
        if replicated is not None:
            if isinstance(replicated, (str, bytes)) or not hasattr(replicated, "__len__"):
                raise GclipTypeError(
                    f"replicated must be a list with one entry per array, got {type(replicated).__name__}"
                )
            entries = given.per_array(replicated, "replicated")
            counting = layout.counting(entries, given.arrays, rank=rank, size=size, comm=comm)
    except Exception as exc:  # noqa: BLE001 - kept, then raised on every rank together
        error, given, counting = exc, _NOTHING, engine.EVERY_ARRAY
    return _Call(given, spec, limit, bool(error_if_nonfinite), inplace, counting, error)


def _settings(
    mode: Any, norm_type: Any, max_norm: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[engine.Spec, float]:
    """The checked scalar arguments as (Spec, limit). A training loop passes the
    same ones every step, so they are checked (and fingerprinted) once."""
    key = (mode, norm_type, max_norm, reproducible, error_if_nonfinite)
    if (
        type(mode) in _PLAIN
        and type(norm_type) in _PLAIN
        and (type(max_norm) in _PLAIN or max_norm is _NO_LIMIT)
    ):
        return _cached_settings(*key)  # the two flags come as bools
    return _check_settings(*key)  # e.g. a tensor as max_norm: it hashes by identity, not value


def _check_settings(
    mode: Any, norm_type: Any, max_norm: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[engine.Spec, float]:
    strategy = strategies.get(mode)
    p = _validate.norm_type(norm_type)
    limit = _validate.max_norm(max_norm) if max_norm is not _NO_LIMIT else math.nan
    if reproducible and math.isfinite(p) and p not in (1.0, 2.0):
        raise GclipValueError(f"reproducible=True supports norm_type 1, 2 or inf, got {p!r}")
    extra = (("max_norm", limit), ("error_if_nonfinite", error_if_nonfinite))
    return engine.Spec(strategy, p, reproducible, extra), limit


_PLAIN = frozenset((bool, int, float, str))  # immutable, hashed by value: safe cache keys
# typed: True, 1 and 1.0 are equal keys, but True is refused where 1 is not
_cached_settings = functools.lru_cache(maxsize=64, typed=True)(_check_settings)


def _program(call: _Call, rank: int, size: int) -> engine.Program:
    def check() -> None:
        if call.error is not None:
            raise call.error

    return engine.norm_program(
        call.grads.arrays,
        call.spec,
        rank=rank,
        size=size,
        counting=call.counting,
        check=check,
        error_if_nonfinite=call.error_if_nonfinite,
    )


def _finish(call: _Call, info: engine.NormInfo) -> ClipResult:
    """The scale, applied. A non-finite norm was already raised on every rank if asked."""
    norm = info.norm
    scale = call.spec.strategy.scale(norm, call.max_norm)
    out = _scaled(call.grads, scale, call.inplace)
    return ClipResult(out, norm, scale, math.isfinite(norm), info.local_norm, info.local_power)


# ---------------------------------------------------------------------------
# the API


def global_norm(
    grads: Any,
    *,
    comm: Comm | None = None,
    norm_type: float | str = 2.0,
    reproducible: bool = False,
    replicated: Sequence[Any] | None = None,
    error_if_nonfinite: bool = False,
    mode: str = "global",
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
        mode: ``"global"``, or the name of a gallery bug (see ``gclip.strategies``).
    """
    comm = _validate.communicator(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    call = _prepare(
        grads,
        _NO_LIMIT,
        rank=rank,
        size=size,
        comm=comm,
        norm_type=norm_type,
        mode=mode,
        reproducible=reproducible,
        replicated=replicated,
        error_if_nonfinite=error_if_nonfinite,
    )
    return engine.run_mpi(_program(call, rank, size), comm).norm


def clip_by_global_norm(
    grads: Any,
    max_norm: float,
    *,
    comm: Comm | None = None,
    norm_type: float | str = 2.0,
    mode: str = "global",
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
        comm, norm_type, reproducible, replicated, mode: as in :func:`global_norm`.

    Returns:
        ClipResult with ``grads`` in the layout given, ``total_norm``, ``scale``, ...
    """
    comm = _validate.communicator(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    call = _prepare(
        grads,
        max_norm,
        rank=rank,
        size=size,
        comm=comm,
        norm_type=norm_type,
        mode=mode,
        inplace=inplace,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
        replicated=replicated,
    )
    info = engine.run_mpi(_program(call, rank, size), comm)
    return _finish(call, info)


def clip_simulated(
    ranks: Sequence[Any],
    max_norm: float,
    *,
    norm_type: float | str = 2.0,
    mode: str = "global",
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
    per_rank = (
        isinstance(replicated, (list, tuple))
        and len(replicated) > 0
        and all(isinstance(r, (list, tuple)) for r in replicated)
    )
    if per_rank and len(replicated) != size:  # type: ignore[arg-type]
        raise GclipValueError(f"replicated has {len(replicated)} lists for {size} ranks")  # type: ignore[arg-type]
    calls = [
        _prepare(
            g,
            max_norm,
            rank=r,
            size=size,
            norm_type=norm_type,
            mode=mode,
            inplace=inplace,
            reproducible=reproducible,
            error_if_nonfinite=error_if_nonfinite,
            replicated=replicated[r] if per_rank else replicated,  # type: ignore[index]
        )
        for r, g in enumerate(ranks)
    ]
    infos = engine.run_simulated([_program(c, r, size) for r, c in enumerate(calls)])
    return [_finish(c, i) for c, i in zip(calls, infos)]


def clip_scale(total_norm: float, max_norm: float) -> float:
    """The scale a clip applies: min(1, max_norm / total_norm); 1 for a zero norm;
    1 for an inf or NaN norm (the gradient is left untouched: skip the step)."""
    limit = _validate.max_norm(max_norm)
    norm = _validate._scalar(total_norm, "total_norm")
    if norm < 0:
        raise GclipValueError(f"total_norm must be >= 0, got {norm!r}")
    return strategies.GLOBAL.scale(norm, limit)


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
    (so rounding cannot lift a clipped norm above its limit); float16 in
    float64, rounded once. In place, a scale of exactly 1 touches nothing and
    the very objects given come back; an array given twice is scaled once.
    Returns the layout given (a tuple stays a tuple).
    """
    s = _validate.scale(scale)
    return _scaled(_validate.grads(grads, inplace), s, inplace)


def _scaled(given: _validate.Grads, scale: float, inplace: bool) -> Any:
    if inplace:
        if scale != 1.0:  # exactly 1: nothing to do, not even a read
            rest: Sequence[np.ndarray] = given.arrays
            if len(rest) >= _kernels.MANY:
                rest = _multiply_many(given.arrays, scale)
            for a in rest:
                _multiply(a, scale, a)
        return given.as_given()
    out = []
    for a in given.arrays:
        b = np.empty_like(a)
        if scale == 1.0:
            np.copyto(b, a)
        else:
            _multiply(a, scale, b)
        out.append(b)
    return given.rebuild(out)


def _multiply(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
    """dst = src * scale in src's dtype, one pass, no full-size temporary.

    float64: the plain product. float32: the scale rounded toward zero to
    float32, then one float32 multiply: the scale's rounding never lifts a
    value, so each result is at most half an ulp above the exact product (the
    product's own rounding) and less than 2**-23 + 2**-24 below it, relative;
    the clipped norm is at most limit * (1 + 2**-24). float16: computed in
    float64 and rounded once (an 11-bit scale would be off by up to 5e-4).
    """
    if src.dtype.itemsize == 8:
        np.multiply(src, scale, out=dst)
    elif src.dtype.itemsize == 4:
        np.multiply(src, _toward_zero32(scale), out=dst)
    else:
        np.multiply(src, scale, out=dst, dtype=np.float64, casting="same_kind")


def _toward_zero32(scale: float) -> np.float32:
    """The scale rounded to float32 toward zero (never up)."""
    s32: np.float32 = np.float32(scale)
    if float(s32) > scale:
        s32 = np.float32(np.nextafter(s32, np.float32(0.0)))
    return s32


def _multiply_many(arrays: list[np.ndarray], scale: float) -> Sequence[np.ndarray]:
    """Scales in place, in one compiled call, the arrays the kernels take (as
    :func:`_multiply` would); returns the others."""
    kernels = _kernels.get()
    table = kernels.table_for(arrays, writable=True) if kernels is not None else None
    if kernels is None or table is None or not table.compiled:
        return arrays
    kernels.scale(table, scale, _toward_zero32(scale))
    return partials.left_to_numpy(arrays, table)
