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
reproducible mode, the overflow rescue and the gallery's norm-sharing bugs (which
combine local norms, not powers) need a second, config-dependent collective,
which comes after the header has agreed on the config.
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import partials
from .comm import Comm
from .errors import AgreedError, GclipError, GclipValueError, NonFiniteNormError
from .strategies import Accumulate, NormOp, Scope, Share, Strategy
from .strategies import exact_norm as _exact_norm

__all__ = [
    "EVERY_ARRAY",
    "HEADER_SIZE",
    "Counting",
    "Gather",
    "NormInfo",
    "Program",
    "Reduce",
    "Spec",
    "local_norm",
    "norm_program",
    "run_mpi",
    "run_simulated",
]


class Reduce(NamedTuple):
    """All-reduce ``data`` (float64) with ``op``."""

    data: np.ndarray
    op: NormOp = NormOp.SUM


class Gather(NamedTuple):
    """All-gather one small picklable item (error path only)."""

    item: Any


Program = Generator["Reduce | Gather", Any, "NormInfo"]
# a step of a program: it yields collectives, is sent their results, returns a T
Step = Generator["Reduce | Gather", Any, Any]


class NormInfo(NamedTuple):
    """What a rank knows after the combine: the norm and how it came about."""

    norm: float  # the norm the strategy clips by
    local_norm: float  # this rank's own norm (the arrays it counts)
    local_power: float  # this rank's sum |x|**p (max |x| for inf)


class Counting(NamedTuple):
    """Which of this rank's arrays it counts, and the check that the ranks agree on it.

    ``owned[i]``: this rank counts array i (a replicated array counts on one
    rank of its group). ``check`` is this rank's share of two sums that are
    exactly 0 over all ranks when every group agrees on what it holds (see
    ``layout``); they ride in the header, so the check costs no collective.
    ``summary`` is what this rank declared, gathered only to explain a
    disagreement, and ``explain(summaries)`` says it in one line.
    """

    owned: Sequence[bool] | None = None  # None: every array is this rank's
    check: tuple[float, float] = (0.0, 0.0)
    summary: Any = None
    explain: Callable[[list[Any]], str] | None = None


EVERY_ARRAY = Counting()


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

    @functools.cached_property  # computed once per Spec: the clip caches its Specs
    def fingerprint(self) -> tuple[float, float]:
        crc = zlib.crc32(self.describe().encode())
        return float(crc & 0xFFFF) + 1.0, float(crc >> 16) + 1.0


class _Slot(enum.IntEnum):
    """The header's slots, all SUM-reduced.

    Squares let every rank see a mismatch: sum(h^2)*R == sum(h)^2 only when all
    h agree. 16-bit fingerprints keep the sums exact up to 2**20 ranks.
    """

    ERROR = 0  # 1 on a rank that failed
    H1 = 1  # the argument fingerprint, two halves, and their squares
    H1SQ = 2
    H2 = 3
    H2SQ = 4
    COUNT = 5  # elements counted
    SUM = 6  # sum |x|**p (ranks whose partial enters the combine)
    RESCUE = 7  # 1 where the plain sum over- or underflowed
    NONFINITE = 8  # 1 where this rank's own norm is inf or NaN
    LAYOUT1 = 9  # the counting check: 0 over all ranks when the groups agree
    LAYOUT2 = 10


HEADER_SIZE = len(_Slot)
# the slots as plain ints: the default clip reads them on every call, and an IntEnum
# member costs an attribute lookup and an __index__ each time
_ERROR, _H1, _H1SQ, _H2, _H2SQ, _COUNT, _SUM, _RESCUE, _NONFINITE, _LAYOUT1, _LAYOUT2 = map(int, _Slot)


def norm_program(
    arrays: Sequence[np.ndarray],
    spec: Spec,
    *,
    rank: int,
    size: int,
    counting: Counting = EVERY_ARRAY,
    check: Callable[[], None] | None = None,
    error_if_nonfinite: bool = False,
    backend: Any = partials,
) -> Program:
    """One rank's part of the norm: yields collectives, returns a NormInfo.

    All local work happens before the header, so whatever ``check`` or the
    local reduction raises becomes this rank's error flag, and every rank
    raises it together. After the header only the overflow rescue reads the
    arrays again; a failure there is flagged in the rescue's own collectives
    and raised on every rank together too.

    ``backend`` computes the local partials where the arrays live: the
    ``partials`` module for numpy arrays (the default), or a module with the
    same functions for other arrays (``gclip.torch``'s, on the tensor's device).
    """
    strategy = spec.strategy
    error: BaseException | None = None
    local = _NOTHING
    try:
        if check is not None:
            check()
        local = _local(arrays, spec, counting.owned, backend)
    except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
        error = exc

    h1, h2 = spec.fingerprint
    mine = _shares(strategy, rank) and strategy.share is Share.POWER
    header = np.array(  # floats only: numpy builds it fastest
        [
            1.0 if error is not None else 0.0,
            h1,
            h1 * h1,
            h2,
            h2 * h2,
            float(local.count),
            local.power if mine else 0.0,
            1.0 if local.rescue and mine else 0.0,
            0.0 if math.isfinite(local.norm) else 1.0,
            *(counting.check if error is None else (0.0, 0.0)),
        ]
    )
    total = (yield Reduce(header)).tolist()  # Python floats: cheaper to read than numpy scalars
    mismatch = total[_H1SQ] * size != total[_H1] ** 2 or total[_H2SQ] * size != total[_H2] ** 2
    disagree = total[_LAYOUT1] != 0.0 or total[_LAYOUT2] != 0.0
    if total[_ERROR] or mismatch or disagree:
        yield from _agree(error, spec, counting, mismatch=mismatch and not total[_ERROR])

    if _header_suffices(spec, local, total):  # the default L2 path: the header was the one collective
        norm, power = partials.root(total[_SUM], 0, spec.norm_type), (total[_SUM], 0)
    else:
        norm, power = yield from _combine(local, spec, rank, total)
    if strategy.finish_norm is not _exact_norm:  # a bug that finishes otherwise (rms, mean...)
        norm = strategy.finish(norm=norm, p=spec.norm_type, count=int(total[_COUNT]), ranks=size, power=power)
    if error_if_nonfinite:
        # decided on what every rank knows: the global norm, or (scope self) the header's flag
        per_rank = strategy.scope is Scope.SELF
        bad = total[_NONFINITE] > 0 if per_rank else not math.isfinite(norm)
        if bad:
            holders = yield Gather(not math.isfinite(local.norm))
            raise _nonfinite_error(spec, norm, holders, per_rank)
    return NormInfo(norm, local.norm, local.power)


def _nonfinite_error(spec: Spec, norm: float, holders: list[bool], per_rank: bool) -> NonFiniteNormError:
    p = "inf" if math.isinf(spec.norm_type) else f"{spec.norm_type:g}"
    ranks = [r for r, bad in enumerate(holders) if bad]
    where = (
        f"non-finite values on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        if ranks
        else "every rank's own part is finite: the norm overflows float64"
    )
    what = "a rank's own norm is not finite" if per_rank else f"the global {p}-norm is {norm!r}"
    return NonFiniteNormError(f"{what} ({where}; error_if_nonfinite=True)")


class _Local(NamedTuple):
    """What a rank knows of its own arrays before any collective."""

    counted: Sequence[np.ndarray] = ()
    count: int = 0  # type: ignore[assignment]  # (a field named as tuple.count)
    power: float = 0.0  # sum |x|**p (finite p), max |x| (inf)
    rescue: bool = False  # the plain sum overflowed or underflowed
    nan: bool = False  # inf-norm: a NaN was seen
    part: np.ndarray | None = None  # reproducible mode: the binned digits
    norm: float = 0.0  # this rank's own norm
    backend: Any = partials  # computes partials of ``counted`` (the rescue needs it again)


_NOTHING = _Local()


def _header_suffices(spec: Spec, local: _Local, total: list[float]) -> bool:
    """The power sums of all ranks are in the header and no rank needs a rescue."""
    strategy = spec.strategy
    return (
        strategy.scope is Scope.ALL
        and strategy.share is Share.POWER
        and local.part is None
        and not total[_RESCUE]
        and not math.isinf(spec.norm_type)
    )


def _local(arrays: Sequence[Any], spec: Spec, owned: Sequence[bool] | None, backend: Any) -> _Local:
    strategy, p = spec.strategy, spec.norm_type
    counted = _counted(arrays, owned, strategy)
    count = backend.count(counted)
    if math.isinf(p):
        top, nan = backend.max_abs(counted)
        return _Local(counted, count, top, nan=nan, norm=math.nan if nan else top, backend=backend)
    if strategy.accumulate is Accumulate.FLOAT16:  # the fp16 bug, even when reproducible
        power = backend.half_power_sum(counted, p)
        return _Local(counted, count, power, norm=partials.root(power, 0, p), backend=backend)
    if spec.reproducible:
        binned = partials.BinnedPowerSum(p)
        part = backend.binned_digits(binned, counted)
        norm, (mant, exp) = binned.summary(part)
        return _Local(counted, count, _ldexp(mant, int(p) * exp), part=part, norm=norm, backend=backend)
    power, rescue, norm = local_norm(counted, p, backend)
    return _Local(counted, count, power, rescue, False, None, norm, backend)


def local_norm(arrays: Sequence[Any], p: float, backend: Any = partials) -> tuple[float, bool, float]:
    """(sum |x|**p, rescue, norm) of one rank's arrays for a finite p, the norm right even
    where the plain sum over- or underflows (the two-pass rescue, on this rank alone)."""
    power, rescue = backend.power_sum(arrays, p)
    norm = _run_local(_rescued(arrays, p, None, backend)) if rescue else partials.root(power, 0, p)
    return power, rescue, norm


def _shares(strategy: Strategy, rank: int) -> bool:
    """Does this rank's partial enter the combine? (scope root: rank 0's only)."""
    return strategy.scope is Scope.ALL or (strategy.scope is Scope.ROOT and rank == 0)


def _counted(
    arrays: Sequence[np.ndarray], owned: Sequence[bool] | None, strategy: Strategy
) -> Sequence[np.ndarray]:
    """The arrays this rank counts: a replicated one on one rank of its group only.

    The per-rank bug (scope self) and the double-count bug count every copy.
    """
    if owned is None or strategy.count_replicated or strategy.scope is Scope.SELF:
        return arrays
    return [a for a, mine in zip(arrays, owned) if mine]


def _agree(error: BaseException | None, spec: Spec, counting: Counting, mismatch: bool) -> Step:
    """Some rank failed or disagreed: every rank raises the same error."""
    mine = (type(error).__name__, str(error)) if error is not None else None
    reports = yield Gather((mine, spec.describe(), counting.summary))  # the error path's own round trip
    if any(err is not None for err, _, _ in reports) or mismatch:
        raise AgreedError.from_reports([(err, args) for err, args, _ in reports], mismatch=mismatch)
    explain = counting.explain or (lambda _: "ranks disagree on which arrays they hold")
    raise GclipValueError(explain([summary for _, _, summary in reports]))


def _combine(local: _Local, spec: Spec, rank: int, total: list[float]) -> Step:
    """The strategy's combine: (the norm it clips by, the power sum as (mant, exp) if known)."""
    strategy, p = spec.strategy, spec.norm_type
    if strategy.scope is Scope.SELF:  # no other rank is asked
        return local.norm, (local.power, 0)
    shares = _shares(strategy, rank)

    def mine(vec: list[float], fill: float = 0.0) -> np.ndarray:
        return np.array(vec if shares else [fill] * len(vec), dtype=np.float64)

    if strategy.share is Share.NORM:  # the norm-sharing bugs: local norms combined
        nan = math.isnan(local.norm)  # as a flag: MPI's MAX may drop a NaN
        got = yield Reduce(mine([0.0 if nan else local.norm, float(nan)]), strategy.norm_op)
        return (math.nan if got[1] > 0 else float(got[0])), None
    if math.isinf(p):  # MAX of max|x|; NaN travels as a flag (MPI's MAX may drop it)
        got = yield Reduce(mine([local.power, float(local.nan)], -1.0), NormOp.MAX)
        return (math.nan if got[1] > 0 else float(got[0])), None
    if local.part is not None:  # reproducible: integer digit counts, exact in any order
        binned = partials.BinnedPowerSum(p)
        got = yield Reduce(local.part if shares else np.zeros_like(local.part))
        return binned.summary(got)
    if total[_RESCUE]:  # some rank's plain sum was unusable: the scaled two-pass route
        norm = yield from _rescued(local.counted if shares else (), p, mine, local.backend)
        return norm, None
    return partials.root(total[_SUM], 0, p), (float(total[_SUM]), 0)  # rank 0's sum (scope root)


def _rescued(counted: Sequence[Any], p: float, mine: Callable[..., np.ndarray] | None, backend: Any) -> Step:
    """Two-pass scaled norm (dnrm2's way) when a plain sum overflowed or underflowed.

    ``mine`` builds this rank's contribution to a collective; None: this rank alone.
    Across ranks this runs after the header and reads the arrays again, so a failure
    here (out of memory, a device error) rides as a flag in the pass's own collective
    and every rank raises it together.
    """
    error: BaseException | None = None
    top, nan = 0.0, False
    try:
        top, nan = backend.max_abs(counted)
    except Exception as exc:  # agreed in the MAX below (the raise above: alone)
        if mine is None:
            raise
        error = exc
    if mine is not None:
        got = yield Reduce(np.append(mine([top, float(nan)], -1.0), 1.0 if error else 0.0), NormOp.MAX)
        if got[2] > 0:
            yield from _agree_late(error)
        top, nan = float(got[0]), bool(got[1] > 0)
    if nan:
        return math.nan
    if top == 0.0 or math.isinf(top):
        return top
    s = 0.0
    try:
        s = backend.scaled_power_sum(counted, p, top) if counted else 0.0
    except Exception as exc:  # agreed in the SUM below
        if mine is None:
            raise
        error = exc
    if mine is not None:
        got = yield Reduce(np.append(mine([s]), 1.0 if error else 0.0))
        if got[1] > 0:
            yield from _agree_late(error)
        s = float(got[0])
    return top * partials.root(s, 0, p)


def _agree_late(error: BaseException | None) -> Step:
    """A rank failed after the header (its flag came in a later collective): every rank
    raises the same error, naming it."""
    mine = (type(error).__name__, str(error)) if error is not None else None
    reports = yield Gather(mine)
    raise AgreedError.from_reports([(err, None) for err in reports], mismatch=False)


def _run_local(program: Step) -> Any:
    """Run a generator that yields no collective (a rank working alone)."""
    try:
        next(program)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a local computation asked for a collective")  # pragma: no cover


def _ldexp(mant: float, exp: int) -> float:
    try:
        return math.ldexp(mant, exp)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------
# drivers


def run_mpi(program: Program, comm: Comm) -> NormInfo:
    """Run a program on this rank of ``comm`` (mpi4py)."""
    MPI = _mpi()
    try:
        request = next(program)
        while True:
            if type(request) is Reduce:
                out = np.empty(request.data.size)
                comm.Allreduce(request.data, out, op=MPI.MAX if request.op is NormOp.MAX else MPI.SUM)
                request = program.send(out)
            else:
                request = program.send(comm.allgather(request.item))  # type: ignore[union-attr]
    except StopIteration as done:
        info: NormInfo = done.value
        return info


@functools.lru_cache(maxsize=1)
def _mpi() -> Any:
    """mpi4py.MPI, imported on first use: simulated runs (the judge) never start MPI."""
    from mpi4py import MPI

    return MPI


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
            reply: Any = stack.max(axis=0) if first.op is NormOp.MAX else stack.sum(axis=0)
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
