"""One rank's call, as a pipeline: the layer every front end goes through.

A front end (``clip`` for numpy arrays, ``torch`` for tensors; DTensor next,
through ``torch``'s gradients) names its :class:`Backend` (how its arguments are
read, where the partials are computed) and its :class:`Driver` (MPI,
torch.distributed), and calls :func:`run`; simulated ranks run R :func:`program`
together (``drivers.run_simulated``). The program flows top-down, from the
arguments to the result, without handing anything back to the front end:

1. the checks: the scalar settings (once per setting: a training loop passes the
   same ones every step), the arrays (the backend's ``read``) and the layout, as
   the engine's :class:`~gclip.engine.Counting`. Whatever is refused is kept, to be
   raised on every rank together;
2. the norm: the engine's program (``engine.norm_program``) on the backend;
3. the scale: the scale rule (``policy``, unless the engine's hook replaces it),
   applied by the backend to the arrays it read, the result in the layout given.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, Protocol

from . import _validate, engine, layout, partials, policy
from .errors import GclipValueError

__all__ = [
    "NO_LIMIT",
    "NUMPY",
    "Backend",
    "Call",
    "Done",
    "Driver",
    "Given",
    "prepare",
    "program",
    "run",
    "settings",
]

NO_LIMIT: Any = object()  # a norm alone: no max_norm to check, nothing to scale


class Given(Protocol):
    """What a backend's ``read`` gives back: the arrays as given, to be scaled in their layout."""

    def scaled(self, factor: float, inplace: bool) -> Any: ...


# what a backend's ``read`` returns: (given, the distinct arrays, their replicated= entries or None)
Collected = tuple[Given, Sequence[Any], Sequence[Any] | None]


class Backend(NamedTuple):
    """A kind of arrays, as the call layer works with them."""

    read: Callable[[Any, Any, bool], Collected]  # (grads, replicated, inplace) -> Collected
    partials: Any  # the engine's local partials where the arrays live (``partials``, ``_torch_partials``)


NUMPY = Backend(_validate.read, partials)  # numpy arrays (``gclip.clip``)


class Call(NamedTuple):
    """One rank's checked arguments (or the error to agree on)."""

    given: Any  # what the backend read, to scale in its layout (None where refused)
    arrays: Sequence[Any]  # the distinct arrays, each once
    spec: engine.Spec
    limit: float
    error_if_nonfinite: bool
    inplace: bool
    counting: engine.Counting
    error: BaseException | None


class Done(NamedTuple):
    """One rank's call, done (the same on every rank but ``grads``)."""

    grads: Any  # the scaled arrays in the layout given (None: a norm alone)
    arrays: Sequence[Any]  # the distinct arrays read, each once
    info: engine.NormInfo  # the norm and this rank's part of it
    scale: float  # the factor applied (1.0 for a norm alone)


Program = Generator["engine.Reduce | engine.Gather", Any, Done]


class Driver(Protocol):
    """What runs a program on one rank: ``drivers.Mpi``, ``gclip.torch``'s torch.distributed groups."""

    rank: int
    size: int

    def run(self, program: Program) -> Done: ...


def run(grads: Any, max_norm: Any, driver: Driver, backend: Backend = NUMPY, **options: Any) -> Done:
    """One rank's call (:func:`program`, with ``options``) run by ``driver`` on its rank."""
    return driver.run(program(grads, max_norm, backend, rank=driver.rank, size=driver.size, **options))


def program(
    grads: Any,
    max_norm: Any,
    backend: Backend = NUMPY,
    *,
    rank: int,
    size: int,
    comm: Any = None,
    replicated: Any = None,
    counting: Callable[[Any, Sequence[Any] | None, Sequence[Any]], engine.Counting] | None = None,
    **options: Any,
) -> Program:
    """One rank's call on ``backend``'s arrays, from its arguments to its result, as a
    program that a driver runs (``drivers.run_mpi``, ``drivers.run_simulated``,
    ``gclip.torch``'s torch.distributed).

    ``options``: ``norm_type``, ``steps`` (the engine's hook), ``inplace``,
    ``reproducible``, ``error_if_nonfinite``. ``max_norm`` is :data:`NO_LIMIT` for a
    norm alone. ``counting(given, entries, arrays)`` replaces ``layout.counting`` where
    a front end reads more than ``replicated=`` (gclip.torch: DTensor placements).
    """
    checked = prepare(
        grads, max_norm, backend, replicated, rank=rank, size=size, comm=comm, counting=counting, **options
    )
    info = yield from engine.norm_program(
        checked.arrays,
        checked.spec,
        rank=rank,
        size=size,
        counting=checked.counting,
        refused=checked.error,
        error_if_nonfinite=checked.error_if_nonfinite,
        backend=backend.partials,
    )
    if max_norm is NO_LIMIT:
        return Done(None, checked.arrays, info, 1.0)
    hook = checked.spec.steps
    factor = (
        policy.scale(info.norm, checked.limit) if hook.scale is None else hook.scale(info.norm, checked.limit)
    )
    return Done(checked.given.scaled(factor, checked.inplace), checked.arrays, info, factor)


_FALLBACK_SPEC = engine.Spec(engine.CORRECT, 2.0, False)  # what a refusing rank reports


def prepare(
    grads: Any,
    max_norm: Any,
    backend: Backend = NUMPY,
    replicated: Any = None,
    *,
    rank: int,
    size: int,
    comm: Any = None,
    norm_type: Any = 2.0,
    steps: engine.Steps = engine.CORRECT,
    inplace: bool = False,
    reproducible: bool = False,
    error_if_nonfinite: bool = False,
    counting: Callable[[Any, Sequence[Any] | None, Sequence[Any]], engine.Counting] | None = None,
) -> Call:
    """Check every argument; an error is kept, to be agreed on by all ranks.

    The fingerprint that ranks compare holds the checked scalar values (1 and
    1.0 are the same limit); what each group of ranks holds in common is
    checked by the layout's ring sums (see ``layout``).
    """
    spec, limit = _FALLBACK_SPEC, math.nan  # kept if an argument is refused
    try:
        spec, limit = settings(steps, norm_type, max_norm, bool(reproducible), bool(error_if_nonfinite))
        given, arrays, entries = backend.read(grads, replicated, inplace)
        if counting is not None:
            counted = counting(given, entries, arrays)
        elif entries is None:  # no replicated=: every array is this rank's
            counted = engine.EVERY_ARRAY
        else:
            counted = layout.counting(entries, arrays, rank=rank, size=size, comm=comm)
    except Exception as exc:  # noqa: BLE001 - kept, then raised on every rank together
        return Call(None, (), spec, limit, bool(error_if_nonfinite), inplace, engine.EVERY_ARRAY, exc)
    return Call(given, arrays, spec, limit, bool(error_if_nonfinite), inplace, counted, None)


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
