"""The clip as a program over ranks: local -> combine -> finish.

A norm computation is written once, as a generator that yields the collectives
it needs (:class:`Reduce`, :class:`Gather`) and receives their results. Two
drivers run it:

- :func:`run_mpi` on real ranks, one buffer-based ``Allreduce`` per ``Reduce``;
- :func:`run_simulated` for R simulated ranks in one process (the judge, the
  seed contract and the unit tests), combining the R yields in lockstep.

So the correct strategy and every bug of the gallery run the very same code on
both. Every program starts with the same fixed-size SUM all-reduce, the
*header*: it carries this rank's error flag, a fingerprint of its arguments,
its element count and (for finite p) its whole sum of |x|**p. So in the default
L2 path the header IS the one collective, and whatever goes wrong on one rank
(bad input, different arguments) is known to every rank at the same moment:
all raise the same error, none is left waiting. Only the inf-norm, the
reproducible mode and the overflow rescue need a second, config-dependent
collective, which comes after the header has agreed on the config.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import partials
from .errors import AgreedError, GclipError
from .strategies import Strategy

__all__ = ["Gather", "NormInfo", "Reduce", "norm_program", "run_mpi", "run_simulated"]


class Reduce(NamedTuple):
    """All-reduce ``data`` (float64) with ``op`` ("sum" or "max")."""

    data: np.ndarray
    op: str = "sum"


class Gather(NamedTuple):
    """All-gather one small picklable item (error path only)."""

    item: Any


Program = Generator["Reduce | Gather", Any, "NormInfo"]


class NormInfo(NamedTuple):
    """What a rank knows after the combine: the norm and how it came about."""

    norm: float  # the norm the strategy clips by
    local_norm: float  # this rank's own norm (its arrays only)
    local_power: float  # this rank's sum |x|**p (max |x| for inf)
    count: int  # elements over all ranks
    ranks: int


@dataclass(frozen=True)
class Spec:
    """Everything every rank must agree on, fingerprinted in the header."""

    strategy: Strategy
    norm_type: float
    reproducible: bool
    extra: tuple[tuple[str, Any], ...] = ()  # e.g. max_norm: checked here, used by the caller

    def describe(self) -> str:
        items = [
            ("mode", self.strategy.name),
            ("norm_type", self.norm_type),
            ("reproducible", self.reproducible),
            *self.extra,
        ]
        return ", ".join(f"{k}={v!r}" for k, v in items)

    def fingerprint(self) -> tuple[float, float]:
        crc = zlib.crc32(self.describe().encode())
        return float(crc & 0xFFFF) + 1.0, float(crc >> 16) + 1.0


# header slots: all SUM. Squares let every rank see a mismatch: sum(h^2)*R == sum(h)^2
# only when all h agree. 16-bit fingerprints keep the sums exact up to 2**20 ranks.
_ERR, _H1, _H1SQ, _H2, _H2SQ, _COUNT, _SUM, _RESCUE = range(8)
HEADER_SIZE = 8


def norm_program(
    arrays: Sequence[np.ndarray],
    spec: Spec,
    *,
    rank: int,
    size: int,
    replicated: Sequence[bool] | None = None,
    check: Callable[[], None] | None = None,
) -> Program:
    """One rank's part of the norm: yields collectives, returns a NormInfo.

    ``check`` runs first; whatever it (or the local reduction) raises becomes
    this rank's error flag in the header, and every rank raises it together.
    """
    strategy, p = spec.strategy, spec.norm_type
    error: BaseException | None = None
    counted: Sequence[np.ndarray] = arrays
    local_power, rescue, count = 0.0, False, 0
    binned = partials.BinnedPowerSum(p) if spec.reproducible and math.isfinite(p) else None
    try:
        if check is not None:
            check()
        counted = _counted(arrays, replicated, rank, strategy)
        count = sum(a.size for a in counted)
        if math.isfinite(p) and binned is None:
            if strategy.accumulate == "float16":  # the fp16 bug: a half-precision sum
                local_power = partials.half_power_sum(counted, p)
            else:
                local_power, rescue = partials.power_sum(counted, p)
    except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
        error = exc

    h1, h2 = spec.fingerprint()
    header = np.zeros(HEADER_SIZE)
    header[[_ERR, _H1, _H1SQ, _H2, _H2SQ, _COUNT]] = [error is not None, h1, h1 * h1, h2, h2 * h2, count]
    shared = strategy.scope == "all" or (strategy.scope == "root" and rank == 0)
    if shared and strategy.share == "power":
        header[_SUM] = local_power
        header[_RESCUE] = rescue
    total = yield Reduce(header)
    yield from _agree(total, error, spec, size)

    info = yield from _combine(counted, spec, binned, rank, size, local_power, rescue, total)
    return info._replace(count=int(total[_COUNT]), ranks=size)


def _counted(
    arrays: Sequence[np.ndarray], replicated: Sequence[bool] | None, rank: int, strategy: Strategy
) -> Sequence[np.ndarray]:
    """The arrays this rank counts: replicated ones count on rank 0 only."""
    if replicated is None:
        return arrays
    if len(replicated) != len(arrays):
        raise ValueError(f"replicated has {len(replicated)} flags for {len(arrays)} arrays")
    if rank == 0 or strategy.count_replicated or strategy.scope == "self":
        return arrays
    return [a for a, rep in zip(arrays, replicated) if not rep]


def _agree(total: np.ndarray, error: BaseException | None, spec: Spec, size: int) -> Generator:
    """Raise the same error on every rank if any rank failed or disagreed."""
    mismatch = (total[_H1SQ] * size != total[_H1] ** 2) or (total[_H2SQ] * size != total[_H2] ** 2)
    if not total[_ERR] and not mismatch:
        return
    mine = (type(error).__name__, str(error)) if error is not None else None
    reports = yield Gather((mine, spec.describe()))  # the error path's own round trip
    raise AgreedError.from_reports(reports, mismatch=bool(mismatch) and not total[_ERR])


def _combine(
    counted, spec: Spec, binned, rank: int, size: int, local_power: float, rescue: bool, total: np.ndarray
) -> Generator:
    """The strategy's combine and finish, after the header."""
    strategy, p = spec.strategy, spec.norm_type
    together = strategy.scope != "self"  # scope "self" never talks to other ranks
    root_only = strategy.scope == "root"

    def mask(vec: np.ndarray, fill: float = 0.0) -> np.ndarray:
        if root_only and rank != 0:
            vec = np.full_like(vec, fill)
        return vec

    if not math.isfinite(p):  # inf-norm: MAX of max|x|, NaN as a flag
        local_max, nan = partials.max_abs(counted)
        local_norm = math.nan if nan else local_max
        if strategy.share == "norm" or not together:
            combined = local_norm
        else:
            got = yield Reduce(mask(np.array([local_max, float(nan)]), -1.0), "max")
            combined = math.nan if got[1] > 0 else float(got[0])
        if strategy.share == "norm" and together:
            got = yield Reduce(mask(np.array([local_norm])), strategy.norm_op)
            combined = float(got[0])
        return _finish(strategy, p, combined, local_norm, local_norm, total, size)

    if binned is not None:  # reproducible: exact integer digits, one SUM
        part = binned.local(counted)
        local_norm = binned.norm(part)
        local_power = _as_float(binned.exact(part))
        if strategy.share == "power" and together:
            part = yield Reduce(mask(part))
            return _finish(
                strategy, p, binned.norm(part), local_norm, local_power, total, size, power=binned.power(part)
            )
        combined_power = binned.power(part)
    else:
        if rescue and not together:  # local rescue, no collective
            local_norm = yield from _rescued(counted, p, None)
        else:
            local_norm = partials.root(local_power, 0, p)
        if strategy.share == "power" and together:
            if total[_RESCUE]:
                norm = yield from _rescued(counted, p, mask)
                return _finish(strategy, p, norm, local_norm, local_power, total, size)
            return _finish(
                strategy,
                p,
                partials.root(total[_SUM], 0, p),
                local_norm,
                local_power,
                total,
                size,
                power=(total[_SUM], 0),
            )
        combined_power = (local_power, 0)

    if strategy.share == "norm" and together:  # the norm-sharing bugs: one more collective
        got = yield Reduce(mask(np.array([local_norm])), strategy.norm_op)
        return _finish(strategy, p, float(got[0]), local_norm, local_power, total, size)
    # scope "self": this rank's own norm is all it knows
    return _finish(strategy, p, local_norm, local_norm, local_power, total, size, power=combined_power)


def _rescued(counted, p: float, mask) -> Generator:
    """Two-pass scaled norm when the plain sum overflowed or underflowed."""
    local_max, nan = partials.max_abs(counted)
    if mask is None:
        gmax, gnan = local_max, nan
    else:
        got = yield Reduce(mask(np.array([local_max, float(nan)]), -1.0), "max")
        gmax, gnan = float(got[0]), bool(got[1] > 0)
    if gnan:
        return math.nan
    if gmax == 0.0 or math.isinf(gmax):
        return gmax
    exponent = math.frexp(gmax)[1]
    local = partials.scaled_power_sum(counted, p, exponent)
    if mask is None:
        s = local
    else:
        got = yield Reduce(mask(np.array([local])))
        s = float(got[0])
    return partials.root(s, exponent, p)


def _as_float(x) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _finish(
    strategy: Strategy,
    p: float,
    norm: float,
    local_norm: float,
    local_power: float,
    total: np.ndarray,
    size: int,
    power: tuple[float, int] | None = None,
) -> NormInfo:
    norm = strategy.finish(norm=norm, p=p, count=int(total[_COUNT]), ranks=size, power=power)
    return NormInfo(norm, local_norm, local_power, int(total[_COUNT]), size)


# ---------------------------------------------------------------------------
# drivers


def run_mpi(program: Program, comm) -> NormInfo:
    """Run a program on this rank of ``comm`` (mpi4py)."""
    from mpi4py import MPI

    ops = {"sum": MPI.SUM, "max": MPI.MAX}
    try:
        request = next(program)
        while True:
            if isinstance(request, Reduce):
                out = np.empty_like(request.data)
                comm.Allreduce(request.data, out, op=ops[request.op])
                request = program.send(out)
            else:
                request = program.send(comm.allgather(request.item))
    except StopIteration as done:
        return done.value


def run_simulated(programs: Sequence[Program]) -> list[NormInfo]:
    """Run R programs in lockstep, as R ranks would, in one process."""
    results: list[Any] = [None] * len(programs)
    requests: list[Any] = []
    for i, prog in enumerate(programs):
        try:
            requests.append(next(prog))
        except StopIteration as done:  # pragma: no cover - every program yields the header
            results[i] = done.value
    while any(r is not None for r in requests):
        first = requests[0]
        if any(type(r) is not type(first) for r in requests):
            raise RuntimeError("simulated ranks diverged")  # pragma: no cover - a gclip bug
        if isinstance(first, Reduce):
            stack = np.stack([r.data for r in requests])
            reply: Any = stack.max(axis=0) if first.op == "max" else stack.sum(axis=0)
        else:
            reply = [r.item for r in requests]
        errors: list[BaseException] = []
        for i, prog in enumerate(programs):
            try:
                requests[i] = prog.send(reply.copy() if isinstance(reply, np.ndarray) else reply)
            except StopIteration as done:
                requests[i], results[i] = None, done.value
            except GclipError as exc:
                requests[i] = None
                errors.append(exc)
        if errors:
            raise errors[0]
    return results
