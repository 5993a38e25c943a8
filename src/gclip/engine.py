"""The clip as one program over ranks: the header, the combine, the rescue, the agreed errors.

:func:`check` reads one rank's arguments (the settings; the arrays, by the front end's
:class:`Backend`; the layout, as a ``layout.Counting``) and keeps what it refuses.
:func:`program` is the norm, a generator that yields the collectives it needs
(:class:`Reduce`, :class:`Gather`) to a driver (``gclip.drivers``) and returns the norm
and the factor of the scale rule (``policy``); the front end applies the factor.

Every program starts with the same small SUM all-reduce, the *header* (:func:`header`):
this rank's error flag, a fingerprint of its arguments and its sum of |x|**p. In the
default L2 path it is the one collective, and whatever goes wrong on one rank is known
to every rank at once: all raise the same error (:func:`agreed_error`), none is left
waiting. The inf-norm, the reproducible mode and the overflow rescue add one collective.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from . import layout, partials, policy, reader
from .errors import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError, one_line
from .layout import EVERY_ARRAY, Counting

__all__ = [
    "EVERY_ARRAY",
    "HEADER_SIZE",
    "NO_LIMIT",
    "NUMPY",
    "Arguments",
    "Backend",
    "Counting",
    "Gather",
    "Grads",
    "NormOp",
    "Program",
    "Reduce",
    "Spec",
    "Sums",
    "agreed_error",
    "check",
    "error_report",
    "header",
    "local_norm",
    "max_norm",
    "nonfinite_error",
    "norm_type",
    "program",
    "rescued",
    "root",
    "scale",
]


class NormOp(enum.Enum):
    """How a collective combines the ranks' numbers."""

    SUM = "sum"
    MAX = "max"


# The requests a program yields, the checked arguments and the header's sums are slotted classes,
# not NamedTuples: each is built on every call, and costs one Python call where a NamedTuple costs two.


@dataclass(slots=True)
class Reduce:
    """All-reduce ``data`` (float64) with ``op``."""

    data: np.ndarray
    op: NormOp = NormOp.SUM


@dataclass(slots=True)
class Gather:
    """All-gather one small picklable item (error path only)."""

    item: Any


# a program, or a part of one: yields collectives, is sent their results
Step = Generator["Reduce | Gather", Any, Any]
Program = Generator["Reduce | Gather", Any, tuple[float, float]]  # returns (the norm, the factor)

NO_LIMIT: Any = object()  # a norm alone: no max_norm to check, nothing to scale


class Grads(Protocol):
    """The arrays as read (numpy: ``reader.Grads``; torch: ``gclip.torch._gradients.Gradients``):
    they scale themselves in the layout they were given."""

    def scaled(self, factor: float, inplace: bool) -> Any: ...


class Backend(NamedTuple):
    """A kind of arrays: how a front end reads them, and where their sums are computed."""

    # (grads, replicated, inplace) -> (the arrays as read, the distinct arrays, their entries or None)
    read: Callable[[Any, Any, bool], tuple[Grads, Sequence[Any], Sequence[Any] | None]]
    partials: Any  # the local sums where the arrays live (``partials``, ``gclip.torch._partials``)


NUMPY = Backend(reader.read, partials)  # numpy arrays (``gclip.clip``)


@dataclass(frozen=True)
class Spec:
    """Everything every rank must agree on, fingerprinted in the header."""

    norm_type: float
    reproducible: bool
    extra: tuple[tuple[str, Any], ...] = ()  # e.g. max_norm: checked here, used by the caller

    def describe(self) -> str:
        items = [("norm_type", self.norm_type), ("reproducible", self.reproducible), *self.extra]
        return ", ".join(f"{k}={v!r}" for k, v in items)

    @functools.cached_property  # computed once per Spec: the settings are cached
    def fingerprint(self) -> tuple[float, float]:
        return _fold(zlib.crc32(self.describe().encode()))


def _fold(crc: int) -> tuple[float, float]:
    return float(crc & 0xFFFF) + 1.0, float(crc >> 16) + 1.0


@functools.lru_cache(maxsize=16)
def _settings_crc(p: float, reproducible: bool) -> int:
    """The CRC of the settings a limit follows in ``Spec.describe``, continued by the limit's."""
    return zlib.crc32(f"norm_type={p!r}, reproducible={reproducible!r}, max_norm=".encode())


@dataclass(slots=True)
class Arguments:
    """One rank's arguments, checked (or the error every rank will raise)."""

    grads: Any  # the arrays as read (a :class:`Grads`; None where refused)
    arrays: Sequence[Any]  # the distinct arrays, each once
    spec: Spec
    limit: float | None  # max_norm (None: a norm alone)
    counting: Counting
    error: BaseException | None
    size: int  # the ranks the program runs on
    error_if_nonfinite: bool
    backend: Backend


_FALLBACK_SPEC = Spec(2.0, False)  # what a rank whose settings were refused reports


def check(
    grads: Any,
    max_norm: Any,
    backend: Backend = NUMPY,
    *,
    rank: int,
    size: int,
    comm: Any = None,
    replicated: Any = None,
    counting: Callable[[Any, Sequence[Any] | None, Sequence[Any]], Counting] | None = None,
    norm_type: Any = 2.0,
    reproducible: bool = False,
    error_if_nonfinite: bool = False,
    inplace: bool = False,
) -> Arguments:
    """Check every argument of one rank's call, keeping an error for the program to raise on
    every rank together. ``max_norm``: :data:`NO_LIMIT` for a norm alone. ``counting(grads,
    entries, arrays)`` replaces ``layout.counting`` where a front end reads more than
    ``replicated=`` (gclip.torch: DTensor placements). The fingerprint holds the checked
    values (1 and 1.0 are the same limit)."""
    flag = bool(error_if_nonfinite)
    spec: Spec = _FALLBACK_SPEC  # kept if a setting is refused
    limit: float | None = None
    try:
        key = (norm_type, max_norm, bool(reproducible), flag)
        # a training loop passes the same settings every step: checked (and fingerprinted) once,
        # where they hash by value (a tensor as max_norm hashes by identity: checked every time)
        plain = type(norm_type) in _PLAIN and (type(max_norm) in _PLAIN or max_norm is NO_LIMIT)
        spec, limit = _cached_settings(*key) if plain else _check_settings(*key)
        read, arrays, entries = backend.read(grads, replicated, inplace)
        if counting is not None:
            counts = counting(read, entries, arrays)
        elif entries is None:  # no replicated=: every array is this rank's
            counts = EVERY_ARRAY
        else:
            counts = layout.counting(entries, arrays, rank=rank, size=size, comm=comm)
    except Exception as exc:  # noqa: BLE001 - kept, then raised on every rank together
        return Arguments(None, (), spec, limit, EVERY_ARRAY, exc, size, flag, backend)
    return Arguments(read, arrays, spec, limit, counts, None, size, flag, backend)


def _check_settings(
    given_p: Any, given_limit: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[Spec, float | None]:
    """The checked scalar arguments as (Spec, limit); the limit is None for a norm alone."""
    p = norm_type(given_p)
    limit = max_norm(given_limit) if given_limit is not NO_LIMIT else None
    if reproducible and math.isfinite(p) and p not in (1.0, 2.0):
        raise GclipValueError(f"reproducible=True supports norm_type 1, 2 or inf, got {p!r}")
    agreed = (("max_norm", math.nan if limit is None else limit), ("error_if_nonfinite", error_if_nonfinite))
    spec = Spec(p, reproducible, agreed)
    # Spec.fingerprint's value, the CRC of the settings before the limit cached: a limit that
    # changes every step (an adaptive clip's) costs a short CRC, not the whole description
    rest = f"{agreed[0][1]!r}, error_if_nonfinite={error_if_nonfinite!r}".encode()
    spec.__dict__["fingerprint"] = _fold(zlib.crc32(rest, _settings_crc(p, reproducible)))
    return spec, limit


_PLAIN = frozenset((bool, int, float, str))  # immutable, hashed by value: safe cache keys
# typed: True, 1 and 1.0 are equal keys, but True is refused where 1 is not
_cached_settings = functools.lru_cache(maxsize=64, typed=True)(_check_settings)


# the scalar settings: each a clean value or a one-line error


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _scalar(value: Any, name: str) -> float:
    """A real number, or an array or tensor holding exactly one (numpy, torch), as a float."""
    if not _real(value) and getattr(value, "ndim", None) is not None and hasattr(value, "item"):
        count = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if count != 1:
            raise GclipTypeError(f"{name} must be a number, got a {type(value).__name__} of {count} values")
        value = value.item()  # an array or tensor of one element (as torch's clip takes): its number
    if not _real(value):
        raise GclipTypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise GclipValueError(f"{name} must be finite, got an integer beyond float") from None


def max_norm(value: Any, name: str = "max_norm") -> float:
    """A finite, non-negative real number, or a one-line error."""
    if type(value) is float and 0.0 <= value < math.inf:  # the usual case, first (NaN fails it)
        return value + 0.0
    limit = _scalar(value, name)
    if not math.isfinite(limit) or limit < 0:
        raise GclipValueError(f"{name} must be finite and >= 0, got {limit!r}")
    return limit + 0.0  # -0.0 becomes 0.0: else the scale is -0.0 and flips the sign of every value


def scale(value: Any) -> float:
    """A scale to multiply by: finite and >= 0, as a limit is (a negative scale flips the gradient)."""
    return max_norm(value, "scale")


def norm_type(value: Any) -> float:
    """p > 0, or inf (also written 'inf')."""
    if type(value) is float and value > 0.0:  # the usual case, first (NaN fails it)
        return value
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if not _real(value):
        raise GclipTypeError(f"norm_type must be a number or 'inf', got {type(value).__name__}")
    p = float(value)
    if math.isnan(p) or p <= 0:
        raise GclipValueError(f"norm_type must be > 0 or inf, got {p!r}")
    return p


def program(args: Arguments) -> Program:
    """One rank's norm and factor, from its checked arguments: (the norm, min(1, max_norm / norm)).

    All local work happens before the header, so a refused argument or whatever the local
    sums raise becomes this rank's error flag, and every rank raises it together. After the
    header only the overflow rescue reads the arrays again; a failure there is flagged in the
    rescue's own collectives and raised on every rank together too.
    """
    spec, owned, sums = args.spec, args.counting.owned, args.backend.partials
    p = spec.norm_type
    counted = args.arrays if owned is None else [a for a, own in zip(args.arrays, owned) if own]
    error, power, nan, rescue, digits, finite = args.error, 0.0, False, False, None, True
    if error is None:
        try:
            if p == math.inf:  # (p > 0: an equality, cheaper than math.isinf)
                power, nan = sums.max_abs(counted)
                finite = not nan and math.isfinite(power)
            elif spec.reproducible:
                digits = sums.binned_digits(partials.BinnedPowerSum(p), counted)
                finite = math.isfinite(root(*partials.BinnedPowerSum(p).power(digits), p))
            else:
                power, rescue = sums.power_sum(counted, p)
                finite = rescue or power < math.inf  # (>= 0; NaN fails) a rescued sum is of finite values
        except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
            error = exc
    total = yield from header(error, spec, args.counting, args.size, power, rescue, not finite)

    if p == math.inf:  # MAX of max|x|; NaN travels as a flag (MPI's MAX may drop it)
        got = yield Reduce(np.array([power, float(nan)]), NormOp.MAX)
        norm = math.nan if got[1] > 0 else float(got[0])
    elif digits is not None:  # reproducible: integer digit counts, exact in any order
        got = yield Reduce(digits)
        norm = root(*partials.BinnedPowerSum(p).power(got), p)
    elif total.rescue:  # some rank's plain sum was unusable: the scaled two-pass route
        norm = yield from rescued(counted, p, sums)
    else:  # the default path: the header's sum is the whole answer (for L2, root's own sqrt)
        norm = math.sqrt(total.power) if p == 2.0 else root(total.power, 0, p)
    if args.error_if_nonfinite and not math.isfinite(norm):
        holders = yield Gather(not finite)
        raise nonfinite_error(p, norm, holders)
    return norm, 1.0 if args.limit is None else policy.scale(norm, args.limit)


def alone(args: Arguments) -> tuple[float, float] | None:
    """:func:`program`'s (norm, factor) on a job of one rank, without its header, where the
    default L2 path is the whole answer (a non-finite sum too: its root, scaled by 1); None
    where the program must run (an error to raise, a rescue, error_if_nonfinite on a
    non-finite sum, another norm, a layout to test): it then says the rest."""
    spec, counts = args.spec, args.counting
    if args.error is not None or args.size != 1 or spec.norm_type != 2.0 or spec.reproducible:
        return None
    if counts.owned is not None or counts.ring != (0.0, 0.0):
        return None
    try:
        power, rescue = args.backend.partials.power_sum(args.arrays, 2.0)
    except Exception:  # noqa: BLE001 - the program reads again, and raises it as it does
        return None
    if rescue or (args.error_if_nonfinite and not power < math.inf):
        return None
    norm = math.sqrt(power)
    return norm, 1.0 if args.limit is None else policy.scale(norm, args.limit)


def nonfinite_error(p: float, norm: float, holders: list[bool]) -> NonFiniteNormError:
    """The error of ``error_if_nonfinite=True``: ``holders[r]``, rank r's own part is not finite."""
    ranks = [r for r, bad in enumerate(holders) if bad]
    where = "every rank's own part is finite: the norm overflows float64"
    if ranks:
        where = f"non-finite values on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    name = "inf" if math.isinf(p) else f"{p:g}"
    return NonFiniteNormError(f"the global {name}-norm is {norm!r} ({where}; error_if_nonfinite=True)")


# The header's slots, all SUM-reduced: this rank's error flag (1 where it failed); the argument
# fingerprint, two 16-bit halves and their squares (sum(h^2)*R == sum(h)^2 only when all h agree,
# exact up to 2**20 ranks); the sum |x|**p; the rescue flag (the plain sum over- or underflowed);
# the flag of a non-finite own part; the layout's two ring sums (0 over all ranks when the
# groups agree). Then the caller's ``extra`` slots.
_ERROR, _H1, _H1SQ, _H2, _H2SQ, _SUM, _RESCUE, _NONFINITE, _LAYOUT1, _LAYOUT2 = range(10)
HEADER_SIZE = 10


@dataclass(slots=True)
class Sums:
    """The header's sums over every rank, once the ranks agree."""

    power: float  # sum |x|**p
    rescue: bool  # some rank's plain sum over- or underflowed
    nonfinite: bool  # some rank's own part is inf or NaN
    extra: Sequence[float] = ()  # the sums of ``header``'s ``extra`` (per-group limits: each group's sums)


def header(
    error: BaseException | None,
    spec: Spec,
    counting: Counting,
    size: int,
    power: float,
    rescue: bool,
    nonfinite: bool,
    extra: Sequence[float] = (),
) -> Generator[Reduce | Gather, Any, Sums]:
    """The header all-reduce of one rank's part: returns the sums where every rank agrees;
    where some rank failed, or the ranks disagree on ``spec`` or on what their groups
    hold, every rank raises the same error instead. ``extra`` rides along, summed (every
    rank gives as many: their number is in ``spec``)."""
    h1, h2 = spec.fingerprint
    mine = np.array(  # floats only: numpy builds it fastest
        [
            1.0 if error is not None else 0.0,
            h1,
            h1 * h1,
            h2,
            h2 * h2,
            power,
            1.0 if rescue else 0.0,
            1.0 if nonfinite else 0.0,
            *(counting.ring if error is None else (0.0, 0.0)),
            *extra,
        ]
    )
    total = (yield Reduce(mine)).tolist()  # Python floats: cheaper to read than numpy scalars
    mismatch = total[_H1SQ] * size != total[_H1] ** 2 or total[_H2SQ] * size != total[_H2] ** 2
    if total[_ERROR] or mismatch or total[_LAYOUT1] != 0.0 or total[_LAYOUT2] != 0.0:
        yield from _agree(error, spec, counting, mismatch=mismatch and not total[_ERROR])
    return Sums(total[_SUM], total[_RESCUE] > 0, total[_NONFINITE] > 0, total[HEADER_SIZE:])


def local_norm(arrays: Sequence[Any], p: float, backend: Any = partials) -> tuple[float, bool, float]:
    """(sum |x|**p, rescue, norm) of one rank's arrays for a finite p, the norm right even
    where the plain sum over- or underflows (the two-pass rescue, on this rank alone)."""
    power, rescue = backend.power_sum(arrays, p)
    norm = _run_local(rescued(arrays, p, backend, alone=True)) if rescue else root(power, 0, p)
    return power, rescue, norm


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


def rescued(counted: Sequence[Any], p: float, backend: Any, *, alone: bool = False) -> Step:
    """Two-pass scaled norm (dnrm2's way) when a plain sum overflowed or underflowed: a MAX of
    max |x|, then a SUM of (|x| / max)**p (``alone``: this rank's own arrays, no collective).

    A rank with nothing to count brings 0 to both, the neutral value of each. Across ranks
    this runs after the header and reads the arrays again, so a failure here (out of memory,
    a device error) rides as a flag in the pass's own collective and every rank raises it
    together.
    """
    error: BaseException | None = None
    top, nan = 0.0, False
    try:
        top, nan = backend.max_abs(counted)
    except Exception as exc:  # agreed in the MAX below (alone: raised here)
        if alone:
            raise
        error = exc
    if not alone:
        got = yield Reduce(np.array([top, float(nan), 1.0 if error else 0.0]), NormOp.MAX)
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
        if alone:
            raise
        error = exc
    if not alone:
        got = yield Reduce(np.array([s, 1.0 if error else 0.0]))
        if got[1] > 0:
            yield from _agree_late(error)
        s = float(got[0])
    return top * root(s, 0, p)


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
