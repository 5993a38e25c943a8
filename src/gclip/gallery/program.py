"""The gallery's bugs as the lab's own programs, run by the core's drivers on its local sums.

A bug's program is the correct clip's shape, written here once for every bug: the
core's checks (``engine.check``: the settings, the arrays, the layout), this rank's
local part from the backend's sums, the core's header (``engine.header``: the agreed
errors), then the combine, the finish and the scale as the bug has them
(:class:`~gclip.gallery.bugs.Strategy`). ``"global"`` runs the same program with
nothing changed: it is the correct clip, and the core's own answer to the bit.

A program yields the core's collectives (``engine.Reduce``, ``engine.Gather``), so
the core's drivers run it: ``drivers.Mpi`` on real ranks, ``drivers.run_simulated``
on R simulated ranks in one process, ``gclip.torch``'s driver for tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Generator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import engine, partials
from ..engine import NormOp, Reduce, root
from ..errors import GclipValueError, NonFiniteNormError
from .bugs import GLOBAL, STRATEGIES, Accumulate, Scope, Share, Strategy, unknown

__all__ = ["Outcome", "Result", "program", "strategy"]


class Result(NamedTuple):
    """A gallery clip's result: gclip's ``ClipResult`` and this rank's own part of the norm."""

    grads: Any  # the layout given
    total_norm: float  # the norm the bug scales by
    scale: float  # the factor the bug applies
    finite: bool  # the norm is finite
    local_norm: float  # this rank's own norm (the arrays it counts)
    local_power: float  # this rank's sum |x|**p (its max |x| for the inf-norm)

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


class Outcome(NamedTuple):
    """What a bug's program returns on one rank."""

    norm: float
    scale: float
    local_norm: float
    local_power: float

    def result(self, args: engine.Arguments, inplace: bool) -> Result:
        """The result of a clip: the arrays scaled by their reader, in the layout given."""
        grads = args.grads.scaled(self.scale, inplace)
        return Result(
            grads, self.norm, self.scale, math.isfinite(self.norm), self.local_norm, self.local_power
        )


def strategy(mode: Any) -> tuple[Strategy, GclipValueError | None]:
    """The bug called ``mode``, or the correct clip and the error every rank will raise."""
    try:
        return STRATEGIES[mode], None
    except (KeyError, TypeError):
        return GLOBAL, GclipValueError(unknown(mode))


class _Part(NamedTuple):
    """This rank's own part of the norm, before any collective."""

    counted: Sequence[Any] = ()
    count: int = 0
    power: float = 0.0  # sum |x|**p (finite p), max |x| (inf)
    rescue: bool = False  # the plain sum overflowed or underflowed
    nan: bool = False  # inf-norm: a NaN was seen
    digits: np.ndarray | None = None  # reproducible: the binned digits
    norm: float = 0.0  # this rank's own norm


def program(
    mode: Any, args: engine.Arguments, rank: int
) -> Generator[engine.Reduce | engine.Gather, Any, Outcome]:
    """Bug ``mode``'s clip on one rank, from the core's checked arguments (``engine.check``)."""
    bug, refused = strategy(mode)
    error = args.error or refused
    spec, size, sums = args.spec, args.size, args.backend.partials
    p = spec.norm_type
    part = _Part()
    if error is None:
        try:
            part = _local(bug, args, sums)
        except Exception as exc:  # noqa: BLE001 - every error is agreed on, then re-raised
            error = exc
    enters = bug.enters(rank)
    in_header = bug.share is Share.POWER and enters
    if bug.local_epsilon and error is None:  # each rank's norm + epsilon, then their p-norm
        part = _plus_epsilon(part, bug.local_epsilon, p)
    total = yield from engine.header(
        error,
        _with_mode(spec, "unknown" if refused else bug.name),
        args.counting,
        size,
        part.power if in_header else 0.0,
        part.rescue and in_header,
        not math.isfinite(part.norm),
        extra=(float(part.count),),  # the elements counted, for the bugs that divide by them
    )
    power: tuple[float, int] | None = None
    if bug.scope is Scope.SELF:  # no other rank is asked
        norm, power = part.norm, (part.power, 0)
    elif bug.share is Share.NORM:  # local norms combined
        nan = math.isnan(part.norm)  # as a flag: MPI's MAX may drop a NaN
        mine = [0.0 if nan else part.norm, float(nan)] if enters else [0.0, 0.0]
        got = yield Reduce(np.array(mine, dtype=np.float64), bug.norm_op)
        norm = math.nan if got[1] > 0 else float(got[0])
    elif math.isinf(p):  # MAX of max|x|; NaN travels as a flag
        mine = [part.power, float(part.nan)] if enters else [0.0, 0.0]  # 0: neutral in a MAX of |x|
        got = yield Reduce(np.array(mine, dtype=np.float64), NormOp.MAX)
        norm = math.nan if got[1] > 0 else float(got[0])
    elif part.digits is not None:  # reproducible: integer digit counts
        got = yield Reduce(part.digits if enters else np.zeros_like(part.digits))
        mant, exp = partials.BinnedPowerSum(p).power(got)
        norm, power = root(mant, exp, p), (mant, exp)
    elif total.rescue:  # some rank's plain sum was unusable: the scaled two-pass route
        norm = yield from engine.rescued(part.counted if enters else (), p, sums)
    else:
        norm, power = root(total.power, 0, p), (total.power, 0)
    if bug.finishes:
        norm = bug.finish(norm, p=p, count=int(total.extra[0]), ranks=size, power=power)
    if args.error_if_nonfinite:
        # decided on what every rank knows: the global norm, or (each rank its own) the header's flag
        if total.nonfinite if bug.scope is Scope.SELF else not math.isfinite(norm):
            holders = yield engine.Gather(not math.isfinite(part.norm))
            raise _nonfinite(p, norm, holders, bug.scope is Scope.SELF)
    scale = 1.0 if args.limit is None else bug.scale(norm, args.limit)
    return Outcome(norm, scale, part.norm, part.power)


def _local(bug: Strategy, args: engine.Arguments, sums: Any) -> _Part:
    """This rank's part as the bug computes it: the arrays it counts (every copy, for a bug
    that counts replicated arrays on every rank), summed in the bug's precision."""
    p, owned = args.spec.norm_type, args.counting.owned
    if bug.count_replicated or bug.scope is Scope.SELF:
        owned = None  # every copy counted
    counted = args.arrays if owned is None else [a for a, own in zip(args.arrays, owned) if own]
    count = sums.count(counted)
    if bug.accumulate is Accumulate.FLOAT16 and not math.isinf(p):  # even when reproducible
        power = half_power_sum(counted, p, sums)
        return _Part(counted, count, power, norm=root(power, 0, p))
    if math.isinf(p):
        top, nan = sums.max_abs(counted)
        return _Part(counted, count, top, nan=nan, norm=math.nan if nan else top)
    if args.spec.reproducible and not bug.local_epsilon:
        binned = partials.BinnedPowerSum(p)
        digits = sums.binned_digits(binned, counted)
        mant, exp = binned.power(digits)
        return _Part(counted, count, _ldexp(mant, int(p) * exp), digits=digits, norm=root(mant, exp, p))
    power, rescue, norm = engine.local_norm(counted, p, sums)
    return _Part(counted, count, power, rescue, norm=norm)


def _plus_epsilon(part: _Part, epsilon: float, p: float) -> _Part:
    """This rank's part with ``epsilon`` added to its own norm: what it contributes to the
    combine is (norm + epsilon) ** p (its norm + epsilon, for the inf-norm's MAX)."""
    norm = part.norm + epsilon
    if math.isinf(p) or not math.isfinite(norm):
        return part._replace(power=part.power + epsilon if math.isinf(p) else part.power)
    with np.errstate(over="ignore"):
        power = float(np.float64(norm) ** p)
    return part._replace(power=power, rescue=not math.isfinite(power))


@functools.lru_cache(maxsize=64)
def _with_mode(spec: engine.Spec, mode: str) -> engine.Spec:
    """The settings the ranks agree on, the bug's name among them."""
    return dataclasses.replace(spec, extra=(("mode", mode), *spec.extra))


def _nonfinite(p: float, norm: float, holders: list[bool], per_rank: bool) -> NonFiniteNormError:
    if not per_rank:
        return engine.nonfinite_error(p, norm, holders)
    ranks = ", ".join(str(r) for r, bad in enumerate(holders) if bad)
    s = "s" if "," in ranks else ""
    return NonFiniteNormError(
        f"a rank's own norm is not finite (non-finite values on rank{s} {ranks}; error_if_nonfinite=True)"
    )


def half_power_sum(arrays: Sequence[Any], p: float, sums: Any) -> float:
    """sum |x|**p accumulated in float16, as a half-precision framework would (overflows at
    65504): numpy arrays here, tensors on their device (``gclip.gallery.torch``)."""
    if sums is not partials:
        return _half_power_sum_of_tensors(arrays, p)
    total = np.float16(0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            for c in partials.iter_chunks(a):
                h = np.abs(c).astype(np.float16)
                total = np.float16(total + np.sum(h**p if p != 1.0 else h, dtype=np.float16))
    return float(total)


def _half_power_sum_of_tensors(arrays: Sequence[Any], p: float) -> float:
    """:func:`half_power_sum` on torch tensors, chunk by chunk on their devices."""
    import torch  # a tensor was given: torch is imported already

    from ..torch import _partials as on_device

    sums = []
    for t in arrays:
        for c in on_device.chunks(t, on_device.chunk_size(t.device)):
            h = c.abs().to(torch.float16)
            sums.append((h if p == 1.0 else h.pow(p)).sum(dtype=torch.float16))
    total = np.float16(0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        for ps in on_device._per_device(sums).values():
            for s in torch.stack(ps).cpu().numpy():
                total = np.float16(total + s)
    return float(total)


def _ldexp(mant: float, exp: int) -> float:
    try:
        return math.ldexp(mant, exp)
    except OverflowError:
        return math.inf
