"""One rank's checked call: the layer every front end goes through.

A front end (``clip`` for numpy arrays, ``torch`` for tensors; DTensor next,
through ``torch``'s gradients) reads its own kind of arrays and what
``replicated=`` says of each, and hands them to :func:`prepare` as a
``collect`` function. Here the scalar arguments are checked (once per
setting: a training loop passes the same ones every step), the layout is
turned into the engine's :class:`~gclip.engine.Counting`, and whatever is
refused is kept, to be raised on every rank together. :func:`program` is
then the engine's program for the call, on the front end's backend, run by
whichever driver the front end has (MPI, torch.distributed, simulated ranks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import _validate, engine, layout, partials
from .errors import GclipTypeError, GclipValueError

__all__ = ["NO_LIMIT", "Call", "entries_of", "prepare", "program", "settings"]

NO_LIMIT: Any = object()  # a norm alone: no max_norm to check


class Call(NamedTuple):
    """One rank's checked arguments (or the error to agree on)."""

    given: Any  # what the front end gives the result back in (None where refused)
    arrays: Sequence[Any]  # the distinct arrays, each once
    spec: engine.Spec
    limit: float
    error_if_nonfinite: bool
    inplace: bool
    counting: engine.Counting
    error: BaseException | None


_FALLBACK_SPEC = engine.Spec(engine.CORRECT, 2.0, False)  # what a refusing rank reports

# what a front end's ``collect`` returns: (given, the distinct arrays, their replicated= entries or None)
Collected = tuple[Any, Sequence[Any], Sequence[Any] | None]


def prepare(
    collect: Callable[[], Collected],
    max_norm: Any,
    *,
    rank: int,
    size: int,
    comm: Any = None,
    norm_type: Any = 2.0,
    steps: engine.Steps = engine.CORRECT,
    inplace: bool = False,
    reproducible: bool = False,
    error_if_nonfinite: bool = False,
    counting: Callable[[Sequence[Any] | None, Sequence[Any]], engine.Counting] | None = None,
) -> Call:
    """Check every argument; an error is kept, to be agreed on by all ranks.

    The fingerprint that ranks compare holds the checked scalar values (1 and
    1.0 are the same limit); what each group of ranks holds in common is
    checked by the layout's ring sums (see ``layout``). ``counting(entries, arrays)``
    replaces ``layout.counting`` where a front end reads more than ``replicated=``
    (gclip.torch: DTensor placements).
    """
    spec, limit = _FALLBACK_SPEC, math.nan  # kept if an argument is refused
    try:
        spec, limit = settings(steps, norm_type, max_norm, bool(reproducible), bool(error_if_nonfinite))
        given, arrays, entries = collect()
        counted = (
            layout.counting(entries, arrays, rank=rank, size=size, comm=comm)
            if counting is None
            else counting(entries, arrays)
        )
    except Exception as exc:  # noqa: BLE001 - kept, then raised on every rank together
        return Call(None, (), spec, limit, bool(error_if_nonfinite), inplace, engine.EVERY_ARRAY, exc)
    return Call(given, arrays, spec, limit, bool(error_if_nonfinite), inplace, counted, None)


def entries_of(replicated: Any, what: str) -> Sequence[Any]:
    """``replicated=`` as a sequence, or a one-line error."""
    if isinstance(replicated, (str, bytes)) or not hasattr(replicated, "__len__"):
        raise GclipTypeError(
            f"replicated must be a list with one entry per {what}, got {type(replicated).__name__}"
        )
    entries: Sequence[Any] = replicated
    return entries


def program(call: Call, rank: int, size: int, backend: Any = partials) -> engine.Program:
    """The engine's program for this call, on ``backend`` (where the arrays live)."""
    return engine.norm_program(
        call.arrays,
        call.spec,
        rank=rank,
        size=size,
        counting=call.counting,
        refused=call.error,
        error_if_nonfinite=call.error_if_nonfinite,
        backend=backend,
    )


def settings(
    steps: engine.Steps, norm_type: Any, max_norm: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[engine.Spec, float]:
    """The checked scalar arguments as (Spec, limit). A training loop passes the
    same ones every step, so they are checked (and fingerprinted) once."""
    key = (steps, norm_type, max_norm, reproducible, error_if_nonfinite)
    if type(norm_type) in _PLAIN and (type(max_norm) in _PLAIN or max_norm is NO_LIMIT):
        return _cached_settings(*key)  # the two flags come as bools; steps hash by identity
    return _check_settings(*key)  # e.g. a tensor as max_norm: it hashes by identity, not value


def _check_settings(
    steps: engine.Steps, norm_type: Any, max_norm: Any, reproducible: bool, error_if_nonfinite: bool
) -> tuple[engine.Spec, float]:
    p = _validate.norm_type(norm_type)
    limit = _validate.max_norm(max_norm) if max_norm is not NO_LIMIT else math.nan
    if reproducible and math.isfinite(p) and p not in (1.0, 2.0):
        raise GclipValueError(f"reproducible=True supports norm_type 1, 2 or inf, got {p!r}")
    extra = (("max_norm", limit), ("error_if_nonfinite", error_if_nonfinite))
    return engine.Spec(steps, p, reproducible, extra), limit


_PLAIN = frozenset((bool, int, float, str))  # immutable, hashed by value: safe cache keys
# typed: True, 1 and 1.0 are equal keys, but True is refused where 1 is not
_cached_settings = functools.lru_cache(maxsize=64, typed=True)(_check_settings)
