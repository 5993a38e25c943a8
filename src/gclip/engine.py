"""The clip as a program over ranks: local -> combine -> finish.

A norm computation is written once, as a generator that yields the collectives
it needs (:class:`Reduce`, :class:`Gather`) and receives their results; a
driver (``gclip.drivers``: MPI, simulated ranks; ``gclip.torch``'s
torch.distributed) runs it, sending each collective where the ranks are.

The steps of a program (local, combine, finish, scale) are this module's own
functions, the correct clip; :class:`Steps` is the hook where a caller replaces
some of them. The core runs :data:`CORRECT`, which replaces none; the lab's
gallery installs its bugs through the hook, the very same code on every driver.
Every program starts with the same fixed-size SUM all-reduce, the
*header*: it carries this rank's error flag, a fingerprint of its arguments,
its element count and (for finite p) its whole sum of |x|**p. So in the default
L2 path the header IS the one collective, and whatever goes wrong on one rank
(bad input, different arguments) is known to every rank at the same moment:
all raise the same error (:func:`agreed_error`), none is left waiting. Only the
inf-norm, the reproducible mode, the overflow rescue and the gallery's
norm-sharing bugs (which combine local norms, not powers) need a second,
config-dependent collective, which comes after the header has agreed on the config.
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from . import partials
from .errors import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError, one_line

__all__ = [
    "CORRECT",
    "EVERY_ARRAY",
    "HEADER_SIZE",
    "Counting",
    "Gather",
    "Local",
    "NormInfo",
    "NormOp",
    "Program",
    "Reduce",
    "Spec",
    "Steps",
    "agreed_error",
    "combine",
    "counted",
    "error_report",
    "local_norm",
    "local_partials",
    "norm_program",
    "rescued",
    "root",
]


class NormOp(enum.Enum):
    """How a collective combines the ranks' numbers."""

    SUM = "sum"
    MAX = "max"


class Reduce(NamedTuple):
    """All-reduce ``data`` (float64) with ``op``."""

    data: np.ndarray
    op: NormOp = NormOp.SUM


class Gather(NamedTuple):
    """All-gather one small picklable item (error path only)."""

    item: Any


Program = Generator["Reduce | Gather", Any, "NormInfo"]
T = TypeVar("T")
# a step of a program: it yields collectives, is sent their results, returns a T
Step = Generator["Reduce | Gather", Any, Any]


class NormInfo(NamedTuple):
    """What a rank knows after the combine: the norm and how it came about."""

    norm: float  # the norm the clip scales by
    local_norm: float  # this rank's own norm (the arrays it counts)
    local_power: float  # this rank's sum |x|**p (max |x| for inf)


class Counting(NamedTuple):
    """Which of this rank's arrays it counts, and the test that the ranks agree on it.

    ``owned[i]``: this rank counts array i (a replicated array counts on one
    rank of its group). ``ring`` is this rank's share of two sums that are
    exactly 0 over all ranks when every group agrees on what it holds (see
    ``layout``); they ride in the header, so the test costs no collective.
    ``summary`` is what this rank declared, gathered only to explain a
    disagreement, and ``explain(summaries)`` says it in one line.
    """

    owned: Sequence[bool] | None = None  # None: every array is this rank's
    ring: tuple[float, float] = (0.0, 0.0)
    summary: Any = None
    explain: Callable[[list[Any]], str] | None = None


EVERY_ARRAY = Counting()


class Local(NamedTuple):
    """What a rank knows of its own arrays before any collective."""

    counted: Sequence[np.ndarray] = ()
    count: int = 0  # type: ignore[assignment]  # (a field named as tuple.count)
    power: float = 0.0  # sum |x|**p (finite p), max |x| (inf)
    rescue: bool = False  # the plain sum overflowed or underflowed
    nan: bool = False  # inf-norm: a NaN was seen
    part: np.ndarray | None = None  # reproducible mode: the binned digits
    norm: float = 0.0  # this rank's own norm
    backend: Any = partials  # computes partials of ``counted`` (the rescue needs it again)


_REFUSED = Local()  # what a rank whose arguments were refused brings to the header


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cheap key for the call's settings cache
class Steps:
    """The hook: the steps of the clip (local -> combine -> finish -> scale) that a caller replaces.

    Each field left None is the engine's own, correct step: the plain function of this
    module of the same name (:func:`local_partials`, :func:`combine`; ``scale`` is
    ``policy.scale``); a callable there runs in its place, on real and simulated ranks
    alike. The core only ever runs :data:`CORRECT`, which replaces nothing; the lab's
    gallery (``gclip.gallery``) installs its bugs this way. ``name`` is part of the
    fingerprint the ranks compare, so all must run the same steps.
    """

    name: str = "global"
    per_rank: bool = False  # True: each rank clips by its own norm (a non-finite one is this rank's own)
    # (arrays, spec, owned, backend) -> Local: this rank's partial, from all its arrays and ``owned``
    local_partials: Callable[[Sequence[Any], Spec, Sequence[bool] | None, Any], Local] | None = None
    in_header: Callable[[int], bool] | None = None  # (rank) -> does its power sum enter the header's SUM?
    # (local, spec, rank, total) -> (norm, power as (mant, exp) or None), from the header's sums
    # or a second collective
    combine: Callable[[Local, Spec, int, list[float]], Step] | None = None
    # (norm, *, p, count, ranks, power) -> the norm the clip scales by
    finish: Callable[..., float] | None = None
    scale: Callable[[float, float], float] | None = None  # (norm, max_norm) -> the factor applied


CORRECT = Steps()


@dataclass(frozen=True)
class Spec:
    """Everything every rank must agree on, fingerprinted in the header."""

    steps: Steps
    norm_type: float
    reproducible: bool
    extra: tuple[tuple[str, Any], ...] = ()  # e.g. max_norm: checked here, used by the caller

    def describe(self) -> str:
        items = [
            ("mode", self.steps.name),
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
    LAYOUT1 = 9  # the counting ring sums: 0 over all ranks when the groups agree
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
    refused: BaseException | None = None,
    error_if_nonfinite: bool = False,
    backend: Any = partials,
) -> Program:
    """One rank's part of the norm: yields collectives, returns a NormInfo.

    All local work happens before the header, so an argument the caller
    ``refused`` or whatever the local reduction raises becomes this rank's
    error flag, and every rank raises it together. After the header only the
    overflow rescue reads the arrays again; a failure there is flagged in the
    rescue's own collectives and raised on every rank together too.

    ``backend`` computes the local partials where the arrays live: the
    ``partials`` module for numpy arrays (the default), or a module with the
    same functions for other arrays (``gclip._torch_partials``, on the tensor's device).
    """
    hook = spec.steps
    error: BaseException | None = refused
    local = _REFUSED
    if error is None:
        try:
            if hook.local_partials is None:
                local = local_partials(counted(arrays, counting.owned), spec, backend)
            else:
                local = hook.local_partials(arrays, spec, counting.owned, backend)
        except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
            error = exc

    h1, h2 = spec.fingerprint
    in_header = hook.in_header is None or hook.in_header(rank)
    header = np.array(  # floats only: numpy builds it fastest
        [
            1.0 if error is not None else 0.0,
            h1,
            h1 * h1,
            h2,
            h2 * h2,
            float(local.count),
            local.power if in_header else 0.0,
            1.0 if local.rescue and in_header else 0.0,
            0.0 if math.isfinite(local.norm) else 1.0,
            *(counting.ring if error is None else (0.0, 0.0)),
        ]
    )
    total = (yield Reduce(header)).tolist()  # Python floats: cheaper to read than numpy scalars
    mismatch = total[_H1SQ] * size != total[_H1] ** 2 or total[_H2SQ] * size != total[_H2] ** 2
    disagree = total[_LAYOUT1] != 0.0 or total[_LAYOUT2] != 0.0
    if total[_ERROR] or mismatch or disagree:
        yield from _agree(error, spec, counting, mismatch=mismatch and not total[_ERROR])

    if hook.combine is None:  # the correct combine (the default L2 path: the header's sum alone)
        norm, power = yield from combine(local, spec, total, in_header)
    else:
        norm, power = yield from hook.combine(local, spec, rank, total)
    if hook.finish is not None:  # a replaced finish (the gallery's rms, mean...)
        norm = hook.finish(norm, p=spec.norm_type, count=int(total[_COUNT]), ranks=size, power=power)
    if error_if_nonfinite:
        # decided on what every rank knows: the global norm, or (each rank its own) the header's flag
        bad = total[_NONFINITE] > 0 if hook.per_rank else not math.isfinite(norm)
        if bad:
            holders = yield Gather(not math.isfinite(local.norm))
            raise _nonfinite_error(spec, norm, holders, hook.per_rank)
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


def local_partials(counted: Sequence[Any], spec: Spec, backend: Any) -> Local:
    """The correct local step: the partial of the arrays this rank counts, its sum of
    |x|**p (max |x| for inf), or its binned digits (reproducible)."""
    p = spec.norm_type
    count = backend.count(counted)
    if math.isinf(p):
        top, nan = backend.max_abs(counted)
        return Local(counted, count, top, nan=nan, norm=math.nan if nan else top, backend=backend)
    if spec.reproducible:
        binned = partials.BinnedPowerSum(p)
        part = backend.binned_digits(binned, counted)
        mant, exp = binned.power(part)
        norm = root(mant, exp, p)
        return Local(counted, count, _ldexp(mant, int(p) * exp), part=part, norm=norm, backend=backend)
    power, rescue, norm = local_norm(counted, p, backend)
    return Local(counted, count, power, rescue, False, None, norm, backend)


def local_norm(arrays: Sequence[Any], p: float, backend: Any = partials) -> tuple[float, bool, float]:
    """(sum |x|**p, rescue, norm) of one rank's arrays for a finite p, the norm right even
    where the plain sum over- or underflows (the two-pass rescue, on this rank alone)."""
    power, rescue = backend.power_sum(arrays, p)
    norm = _run_local(rescued(arrays, p, None, backend)) if rescue else root(power, 0, p)
    return power, rescue, norm


def counted(arrays: Sequence[Any], owned: Sequence[bool] | None) -> Sequence[Any]:
    """The arrays this rank counts: a replicated one on one rank of its group only."""
    if owned is None:
        return arrays
    return [a for a, own in zip(arrays, owned) if own]


def _agree(error: BaseException | None, spec: Spec, counting: Counting, mismatch: bool) -> Step:
    """Some rank failed or disagreed: every rank raises the same error."""
    # the error path's own round trip
    reports = yield Gather((error_report(error), spec.describe(), counting.summary))
    if any(err is not None for err, _, _ in reports) or mismatch:
        raise agreed_error([(err, args) for err, args, _ in reports], mismatch=mismatch)
    explain = counting.explain or (lambda _: "ranks disagree on which arrays they hold")
    raise GclipValueError(explain([summary for _, _, summary in reports]))


def error_report(error: BaseException | None) -> tuple[str, str] | None:
    """What a rank tells the others of its error, for :func:`agreed_error`: (type name, message)."""
    return None if error is None else (type(error).__name__, str(error))


def agreed_error(reports: Sequence[Any], mismatch: bool) -> GclipError:
    """The one exception every rank raises, built from what each rank reported: ``reports[r]``
    is rank r's ``(error, arguments)``, error as (type name, message) or None. The class is
    the failing rank's (a gclip class, or the gclip class that refines a builtin)."""
    size = len(reports)
    if mismatch:
        seen: dict[str, list[int]] = {}
        for rank, (_, args) in enumerate(reports):
            seen.setdefault(args, []).append(rank)
        parts = "; ".join(f"{_ranks(r)}: {args}" for args, r in seen.items())
        return GclipValueError(one_line(f"ranks disagree on the arguments ({parts})"))
    bad = [(rank, err) for rank, (err, _) in enumerate(reports) if err is not None]
    kind, message = bad[0][1]
    same = [rank for rank, err in bad if err == bad[0][1]]
    where = f"{_ranks(same)} of {size}"
    if len(same) < len(bad):
        where += f" (and {_ranks([r for r, _ in bad if r not in same])} with other errors)"
    cls = _ERROR_CLASSES.get(kind, GclipError)
    if cls is GclipError and kind != "GclipError":
        message = f"{kind}: {message}"
    return cls(one_line(f"{where}: {message}"))


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_ERROR_CLASSES: dict[str, type[GclipError]] = {
    "GclipError": GclipError,
    "GclipValueError": GclipValueError,
    "ValueError": GclipValueError,
    "GclipTypeError": GclipTypeError,
    "TypeError": GclipTypeError,
    "NonFiniteNormError": NonFiniteNormError,
}


def combine(local: Local, spec: Spec, total: list[float], shares: bool) -> Step:
    """The correct combine: (the norm, the power sum as (mant, exp) if known). The header's
    SUM is the whole answer where there are no digits, no rescue and a finite p (the default
    L2 path: no second collective); else a second collective brings it.

    ``shares``: this rank's partial enters it (else it brings the neutral value).
    """
    p = spec.norm_type
    if math.isinf(p):  # MAX of max|x|; NaN travels as a flag (MPI's MAX may drop it)
        got = yield Reduce(_part([local.power, float(local.nan)], -1.0, shares=shares), NormOp.MAX)
        return (math.nan if got[1] > 0 else float(got[0])), None
    if local.part is not None:  # reproducible: integer digit counts, exact in any order
        binned = partials.BinnedPowerSum(p)
        got = yield Reduce(local.part if shares else np.zeros_like(local.part))
        mant, exp = binned.power(got)
        return root(mant, exp, p), (mant, exp)
    if total[_RESCUE]:  # some rank's plain sum was unusable: the scaled two-pass route
        part = functools.partial(_part, shares=shares)
        norm = yield from rescued(local.counted if shares else (), p, part, local.backend)
        return norm, None
    return root(total[_SUM], 0, p), (float(total[_SUM]), 0)  # the header's sum: the default path


def _part(vec: list[float], fill: float = 0.0, *, shares: bool) -> np.ndarray:
    """This rank's part of a collective: its numbers, or ``fill`` (the neutral value) where
    its partial does not enter."""
    return np.array(vec if shares else [fill] * len(vec), dtype=np.float64)


def rescued(
    counted: Sequence[Any], p: float, contribution: Callable[..., np.ndarray] | None, backend: Any
) -> Step:
    """Two-pass scaled norm (dnrm2's way) when a plain sum overflowed or underflowed.

    ``contribution`` builds this rank's part of a collective; None: this rank alone.
    Across ranks this runs after the header and reads the arrays again, so a failure
    here (out of memory, a device error) rides as a flag in the pass's own collective
    and every rank raises it together.
    """
    error: BaseException | None = None
    top, nan = 0.0, False
    try:
        top, nan = backend.max_abs(counted)
    except Exception as exc:  # agreed in the MAX below (the raise above: alone)
        if contribution is None:
            raise
        error = exc
    if contribution is not None:
        got = yield Reduce(
            np.append(contribution([top, float(nan)], -1.0), 1.0 if error else 0.0), NormOp.MAX
        )
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
        if contribution is None:
            raise
        error = exc
    if contribution is not None:
        got = yield Reduce(np.append(contribution([s]), 1.0 if error else 0.0))
        if got[1] > 0:
            yield from _agree_late(error)
        s = float(got[0])
    return top * root(s, 0, p)


def _agree_late(error: BaseException | None) -> Step:
    """A rank failed after the header (its flag came in a later collective): every rank
    raises the same error, naming it."""
    reports = yield Gather(error_report(error))
    raise agreed_error([(err, None) for err in reports], mismatch=False)


def _run_local(program: Step) -> Any:
    """Run a generator that yields no collective (a rank working alone)."""
    try:
        next(program)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a local computation asked for a collective")  # pragma: no cover


def root(mant: float, exp: int, p: float) -> float:
    """The norm from a sum of |x|**p given as mant * 2**(p*exp): (mant * 2**(p*exp)) ** (1/p),
    without overflow in the middle."""
    mant = float(mant)
    if mant == 0.0 or not math.isfinite(mant):
        return mant
    try:
        r = math.sqrt(mant) if p == 2.0 else mant if p == 1.0 else mant ** (1.0 / p)
        return math.ldexp(r, exp)
    except OverflowError:  # the norm is beyond the largest float (tiny p can do that)
        return math.inf


def _ldexp(mant: float, exp: int) -> float:
    try:
        return math.ldexp(mant, exp)
    except OverflowError:
        return math.inf
