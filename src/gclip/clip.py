"""The public API: the global norm, the scale, and the clip.

``grads`` is this rank's part of the gradient: one array or a list of arrays
of any shapes (float16, float32 or float64; numpy arrays, or anything with the
buffer protocol or ``__array__``, e.g. torch CPU tensors). ``comm`` is an
mpi4py communicator; ``None`` means ``COMM_WORLD``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import engine, strategies
from .contract import validate_limit
from .errors import GclipTypeError, GclipValueError

__all__ = ["ClipResult", "apply_scale", "clip_by_global_norm", "clip_simulated", "global_norm"]

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class ClipResult(NamedTuple):
    """What :func:`clip_by_global_norm` returns (the same on every rank but ``grads``)."""

    grads: Any  # same layout as given: one array, or a list of arrays
    total_norm: float  # the global norm, as computed (inf or NaN if the gradient is)
    scale: float  # the factor applied: min(1, max_norm / total_norm), 1 if not finite
    finite: bool  # False: the norm is inf/NaN and the gradients were left untouched
    local_norm: float  # this rank's own norm (its arrays only)
    local_power: float  # this rank's sum |x|**p (its max |x| for the inf-norm)

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


def _as_arrays(grads: Any, inplace: bool) -> tuple[list[np.ndarray], bool]:
    """(arrays, single): views of what was given, never copies."""
    single = not isinstance(grads, (list, tuple))
    items = [grads] if single else list(grads)
    arrays = []
    for i, g in enumerate(items):
        if type(g) is np.ndarray and g.dtype in _FLOATS and (g.flags.writeable or not inplace):
            arrays.append(g)  # the common case, checked in one line
            continue
        where = "grads" if single else f"grads[{i}]"
        if inplace and isinstance(g, (list, tuple, numbers.Number)):
            raise GclipTypeError(f"{where}: inplace=True needs arrays, got {type(g).__name__}")
        try:
            a = np.asarray(g)
        except Exception as exc:  # noqa: BLE001 - any failure here is a type error of the input
            raise GclipTypeError(f"{where}: cannot be read as an array ({exc})") from None
        if a.dtype not in _FLOATS:
            raise GclipTypeError(
                f"{where} has dtype {a.dtype}; gclip clips float16, float32 or float64 arrays"
            )
        if inplace and not a.flags.writeable:
            raise GclipValueError(f"{where} is read-only; inplace=True needs writable arrays")
        arrays.append(a)
    return arrays, single


def _norm_type(norm_type: Any) -> float:
    if isinstance(norm_type, str) and norm_type.strip().lower() in ("inf", "infinity"):
        return math.inf
    if not isinstance(norm_type, numbers.Real) or isinstance(norm_type, bool):
        raise GclipTypeError(f"norm_type must be a number or 'inf', got {type(norm_type).__name__}")
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise GclipValueError(f"norm_type must be > 0 or inf, got {p!r}")
    return p


class _Call(NamedTuple):
    """One rank's checked arguments (or the error to agree on)."""

    arrays: list[np.ndarray]
    single: bool
    spec: engine.Spec
    max_norm: float
    error_if_nonfinite: bool
    inplace: bool
    replicated: Sequence[bool] | None
    error: BaseException | None


_NO_LIMIT = object()  # global_norm: no max_norm to check
_FALLBACK_SPEC = engine.Spec(strategies.GLOBAL, 2.0, False)  # what a refusing rank reports


def _prepare(
    grads: Any,
    max_norm: Any,
    *,
    norm_type: Any,
    mode: Any,
    inplace: bool = False,
    reproducible: bool = False,
    error_if_nonfinite: bool = False,
    replicated: Sequence[bool] | None = None,
) -> _Call:
    """Check every argument; an error is kept, to be agreed on by all ranks.

    The fingerprint that ranks compare holds the checked values (1 and 1.0 are
    the same limit) and the size of the replicated arrays (which must match).
    """
    arrays: list[np.ndarray] = []
    single = True
    spec, limit = _FALLBACK_SPEC, math.nan  # replaced below, unless an argument is refused
    error: BaseException | None = None
    try:
        spec, limit = _settings(mode, norm_type, max_norm, bool(reproducible), bool(error_if_nonfinite))
        arrays, single = _as_arrays(grads, inplace)
        if replicated is not None:
            flags = [bool(f) for f in replicated]
            if len(flags) != len(arrays):
                raise GclipValueError(f"replicated has {len(flags)} flags for {len(arrays)} arrays")
            replicated = flags
            shared = sum(a.size for a, f in zip(arrays, flags) if f)
            spec = dataclasses.replace(spec, extra=(*spec.extra, ("replicated_elements", shared)))
    except Exception as exc:  # noqa: BLE001 - kept, then raised on every rank together
        error, arrays, replicated = exc, [], None
    return _Call(arrays, single, spec, limit, bool(error_if_nonfinite), inplace, replicated, error)


def _settings(*key: Any) -> tuple[engine.Spec, float]:
    """The checked scalar arguments as (Spec, limit). A training loop passes the
    same ones every step, so they are checked (and fingerprinted) once."""
    try:
        hash(key)
    except TypeError:  # e.g. an array as max_norm: checked (and refused) uncached
        return _check_settings(*key)
    return _cached_settings(*key)


def _check_settings(
    mode: Any, norm_type: Any, max_norm: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[engine.Spec, float]:
    strategy = strategies.get(mode)
    p = _norm_type(norm_type)
    limit = validate_limit(max_norm, "max_norm") if max_norm is not _NO_LIMIT else math.nan
    if reproducible and math.isfinite(p) and p not in (1.0, 2.0):
        raise GclipValueError(f"reproducible=True supports norm_type 1, 2 or inf, got {p!r}")
    extra = (("max_norm", limit), ("error_if_nonfinite", error_if_nonfinite))
    return engine.Spec(strategy, p, reproducible, extra), limit


# typed: True, 1 and 1.0 are equal keys, but True is refused where 1 is not
_cached_settings = functools.lru_cache(maxsize=64, typed=True)(_check_settings)


def _world(comm: Any) -> Any:
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return comm


def _program(call: _Call, rank: int, size: int) -> engine.Program:
    def check() -> None:
        if call.error is not None:
            raise call.error

    return engine.norm_program(
        call.arrays,
        call.spec,
        rank=rank,
        size=size,
        replicated=call.replicated,
        check=check,
        error_if_nonfinite=call.error_if_nonfinite,
    )


def _finish(call: _Call, info: engine.NormInfo, grads: Any) -> ClipResult:
    """The scale, applied. A non-finite norm was already raised on every rank if asked."""
    norm = info.norm
    scale = call.spec.strategy.scale(norm, call.max_norm)
    out = _scaled(call.arrays, call.single, scale, call.inplace, grads)
    return ClipResult(out, norm, scale, math.isfinite(norm), info.local_norm, info.local_power)


def global_norm(
    grads: Any,
    *,
    comm: Any = None,
    norm_type: float | str = 2.0,
    reproducible: bool = False,
    replicated: Sequence[bool] | None = None,
    mode: str = "global",
) -> float:
    """The norm of the whole gradient, whose parts live on the ranks of ``comm``.

    Each rank reduces its own arrays to a partial (in float64), one all-reduce
    combines the partials, and every rank gets the same float.

    Args:
        grads: this rank's arrays (one array or a list).
        comm: mpi4py communicator over which the gradient is sharded (None: COMM_WORLD).
        norm_type: p > 0, or ``inf`` / ``"inf"`` for the max-norm.
        reproducible: the same bits for any rank count and layout (p in 1, 2, inf).
        replicated: one flag per array; a flagged array is the same on every rank of
            ``comm`` and counts once, not once per rank.
        mode: ``"global"``, or the name of a gallery bug (see ``gclip.strategies``).
    """
    comm = _world(comm)
    call = _prepare(
        grads, _NO_LIMIT, norm_type=norm_type, mode=mode, reproducible=reproducible, replicated=replicated
    )
    return engine.run_mpi(_program(call, comm.Get_rank(), comm.Get_size()), comm).norm


def clip_by_global_norm(
    grads: Any,
    max_norm: float,
    *,
    comm: Any = None,
    norm_type: float | str = 2.0,
    mode: str = "global",
    error_if_nonfinite: bool = False,
    inplace: bool = False,
    reproducible: bool = False,
    replicated: Sequence[bool] | None = None,
) -> ClipResult:
    """Scale this rank's arrays by min(1, max_norm / global norm), the same on every rank.

    Bad input on any rank raises the same error on every rank (no rank is left
    waiting in a collective). A non-finite global norm raises
    :class:`NonFiniteNormError` with ``error_if_nonfinite=True``; otherwise the
    gradients are left untouched and ``finite`` is False, so the caller can skip
    the step.

    Args:
        grads: this rank's arrays (one array or a list).
        max_norm: the limit, finite and >= 0.
        inplace: scale the given arrays in place (skipped when the scale is 1);
            otherwise new arrays of the same dtypes are returned.
        comm, norm_type, reproducible, replicated, mode: as in :func:`global_norm`.

    Returns:
        ClipResult with ``grads`` in the layout given, ``total_norm``, ``scale``, ...
    """
    comm = _world(comm)
    call = _prepare(
        grads,
        max_norm,
        norm_type=norm_type,
        mode=mode,
        inplace=inplace,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
        replicated=replicated,
    )
    info = engine.run_mpi(_program(call, comm.Get_rank(), comm.Get_size()), comm)
    return _finish(call, info, grads)


def clip_simulated(
    ranks: Sequence[Any],
    max_norm: float,
    *,
    norm_type: float | str = 2.0,
    mode: str = "global",
    reproducible: bool = False,
    replicated: Sequence[bool] | None = None,
    error_if_nonfinite: bool = False,
) -> list[ClipResult]:
    """:func:`clip_by_global_norm` on ``len(ranks)`` simulated ranks, in one process.

    ``ranks[r]`` is what rank r would pass as ``grads``. The same engine runs
    as on real ranks; only the all-reduce is a sum over a list.
    """
    calls = [
        _prepare(
            g,
            max_norm,
            norm_type=norm_type,
            mode=mode,
            reproducible=reproducible,
            error_if_nonfinite=error_if_nonfinite,
            replicated=replicated,
        )
        for g in ranks
    ]
    infos = engine.run_simulated([_program(c, r, len(ranks)) for r, c in enumerate(calls)])
    return [_finish(c, i, g) for c, i, g in zip(calls, infos, ranks)]


def apply_scale(grads: Any, scale: float, *, inplace: bool = False) -> Any:
    """Multiply arrays by ``scale``: the second half of a clip.

    The product is computed in float64 and rounded once to each array's dtype,
    chunk by chunk (no full-size temporary). In place, a scale of exactly 1
    touches nothing. Returns the same layout as given (in place: the very
    objects given).
    """
    arrays, single = _as_arrays(grads, inplace)
    return _scaled(arrays, single, float(scale), inplace, grads)


def _scaled(arrays: list[np.ndarray], single: bool, scale: float, inplace: bool, given: Any) -> Any:
    if inplace:
        if scale != 1.0:  # exactly 1: nothing to do, not even a read
            for a in arrays:
                _multiply(a, scale, a)
        return given
    out = []
    for a in arrays:
        b = np.empty_like(a)
        if scale == 1.0:
            np.copyto(b, a)
        else:
            _multiply(a, scale, b)
        out.append(b)
    return out[0] if single else out


def _multiply(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
    """dst = src * scale in src's dtype, one pass, no full-size temporary.

    float64: the plain product. float32: the scale rounded toward zero to
    float32 (never up, so rounding the scale cannot lift the clipped norm above
    the limit), then one float32 multiply: within 1 ulp of the exact product.
    float16: computed in float64 and rounded once (an 11-bit scale would be off
    by up to 5e-4).
    """
    if src.dtype == np.float64:
        np.multiply(src, scale, out=dst)
    elif src.dtype == np.float32:
        s32 = np.float32(scale)
        if float(s32) > scale:
            s32 = np.nextafter(s32, np.float32(0.0))
        np.multiply(src, s32, out=dst)
    else:
        np.multiply(src, scale, out=dst, dtype=np.float64, casting="same_kind")
