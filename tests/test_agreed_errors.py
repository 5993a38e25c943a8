"""Agreed errors on real ranks: a fault on ONE rank makes EVERY rank raise the same error.

Run as ``timeout 300 mpirun -n N python -m pytest --with-mpi -m mpi tests/test_agreed_errors.py``
(N >= 2). Each test injects one fault on one rank (the last, or rank 0), then checks on
every rank: the call raised, the class and the message are the same everywhere, the
message names the rank at fault and the argument; and a correct clip right after works on
every rank, which proves nobody was left inside a collective.

A failed assert on one rank while the others wait in a collective would hang the job, so
no test asserts on what its own rank saw: each rank's report is all-gathered first, and
every rank then asserts on the same list, passing or failing together. Every test runs
the same collectives on every rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pytest

import gclip
import gclip.gallery
from gclip import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def comm():
    """A private copy of COMM_WORLD, so the tests never share a message stream with pytest-mpi."""
    from mpi4py import MPI

    dup = MPI.COMM_WORLD.Dup()
    yield dup
    dup.Free()


# --------------------------------------------------------------------------- helpers


class Report(NamedTuple):
    """What one rank saw: the exception's class name and message, or None if it returned."""

    kind: str | None
    message: str
    is_gclip: bool


def attempt(call: Callable[[], Any]) -> Report:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it
        return Report(type(exc).__name__, str(exc), isinstance(exc, GclipError))
    return Report(None, "", False)


def everyone(comm, mine: Any) -> list[Any]:
    """Every rank's value, on every rank: assertions on it pass or fail on all ranks at once."""
    return comm.allgather(mine)


def agree(comm, ok: bool, detail: str = "") -> None:
    """Assert a per-rank condition without leaving any rank behind."""
    verdicts = everyone(comm, (bool(ok), detail))
    bad = [f"rank {r}: {d}" for r, (good, d) in enumerate(verdicts) if not good]
    assert not bad, "; ".join(bad)


def names_rank(message: str, rank: int) -> bool:
    """``rank 3`` or ``ranks 0, 3`` (not ``rank 30``)."""
    return re.search(rf"\branks? (?:\d+, )*{rank}\b", message) is not None


def bad_rank(comm, where: str) -> int:
    return comm.Get_size() - 1 if where == "last" else 0


def fresh(comm) -> np.ndarray:
    """This rank's healthy shard: 4 values equal to rank + 1."""
    return np.full(4, comm.Get_rank() + 1.0)


def expected_norm(size: int) -> float:
    """The norm of ``fresh`` over all ranks, from the definition (not from gclip)."""
    return math.sqrt(sum(4 * (r + 1.0) ** 2 for r in range(size)))


def check_comm_still_works(comm) -> None:
    """A correct clip right after an error: all ranks must take part, or this hangs."""
    mine = fresh(comm)
    report = attempt(lambda: gclip.clip_by_global_norm(mine, 1.0, comm=comm))
    reports = everyone(comm, report)
    assert all(r.kind is None for r in reports), f"the clip after the error failed: {reports}"
    result = gclip.clip_by_global_norm(mine, 1.0, comm=comm)
    norm = expected_norm(comm.Get_size())
    ok = math.isclose(result.total_norm, norm, rel_tol=1e-12) and np.allclose(
        result.grads, mine / norm, rtol=1e-12, atol=0
    )
    agree(comm, ok, f"norm {result.total_norm!r}, expected {norm!r}")


def check_agreed(comm, reports: list[Report], expected: type, bad: int | list[int], needle: str = "") -> None:
    """Every rank raised, the same class and message, a GclipError of the expected kind,
    naming the ranks at fault (and no other for a plain error)."""
    bads = [bad] if isinstance(bad, int) else bad
    kinds = {r.kind for r in reports}
    assert None not in kinds, f"some ranks did not raise: {reports}"
    assert len(kinds) == 1, f"ranks raised different classes: {reports}"
    assert len({r.message for r in reports}) == 1, f"ranks raised different messages: {reports}"
    assert all(r.is_gclip for r in reports), reports
    kind, message = reports[0].kind, reports[0].message
    cls = getattr(gclip, kind, None)
    assert isinstance(cls, type) and issubclass(cls, expected), f"{kind} is not a {expected.__name__}"
    assert "\n" not in message, f"not one line: {message!r}"
    for b in bads:
        assert names_rank(message, b), f"rank {b} not named: {message!r}"
    assert needle.lower() in message.lower(), f"{needle!r} not in {message!r}"


# --------------------------------------------------------------------------- the faults


class Fault(NamedTuple):
    """``common`` kwargs on every rank; ``bad`` overrides them on the rank at fault."""

    bad: Callable[[], dict]
    expected: type
    needle: str
    common: Callable[[], dict] = dict


def _readonly() -> np.ndarray:
    a = np.full(4, 2.0)
    a.setflags(write=False)
    return a


FAULTS: dict[str, Fault] = {
    "int-array": Fault(lambda: {"grads": np.arange(4)}, GclipTypeError, "int"),
    "string": Fault(lambda: {"grads": "0.5"}, GclipTypeError, "grads"),
    "dict": Fault(lambda: {"grads": {"w": np.ones(4)}}, GclipTypeError, "grads"),
    # np.asarray drops a mask: the masked values would count (a norm of 100.1 for one of 5)
    "masked-array": Fault(
        lambda: {"grads": np.ma.masked_array([3.0, 4.0, 100.0], mask=[0, 0, 1])}, GclipTypeError, "masked"
    ),
    "list-with-none": Fault(lambda: {"grads": [np.ones(4), None]}, GclipTypeError, "grads[1]"),
    "negative-limit": Fault(lambda: {"max_norm": -1.0}, GclipValueError, "max_norm"),
    "nan-limit": Fault(lambda: {"max_norm": math.nan}, GclipValueError, "nan"),
    "inf-limit": Fault(lambda: {"max_norm": math.inf}, GclipValueError, "inf"),
    "string-limit": Fault(lambda: {"max_norm": "1.0"}, GclipTypeError, "max_norm"),
    "norm-type-0": Fault(lambda: {"norm_type": 0}, GclipValueError, "norm_type"),
    "norm-type-negative": Fault(lambda: {"norm_type": -1}, GclipValueError, "norm_type"),
    "norm-type-nan": Fault(lambda: {"norm_type": math.nan}, GclipValueError, "norm_type"),
    "norm-type-foo": Fault(lambda: {"norm_type": "foo"}, GclipError, "norm_type"),
    "unknown-mode": Fault(lambda: {"mode": "no-such-mode"}, GclipValueError, "no-such-mode"),
    "readonly-inplace": Fault(
        lambda: {"grads": _readonly()}, GclipValueError, "read", common=lambda: {"inplace": True}
    ),
    "replicated-length": Fault(
        lambda: {"replicated": [False, True]},
        GclipValueError,
        "replicated",
        common=lambda: {"replicated": [False]},
    ),
    # None means "no copy here" (Mesh.tied): refused, not counted as a shard
    "replicated-none": Fault(
        lambda: {"replicated": [None]},
        GclipTypeError,
        "replicated[0] is None",
        common=lambda: {"replicated": [False]},
    ),
    "reproducible-p3": Fault(
        lambda: {"norm_type": 3.0}, GclipValueError, "reproducible", common=lambda: {"reproducible": True}
    ),
}

# the arguments are all valid, but the ranks disagree on one: the header's fingerprints
MISMATCHES: dict[str, Fault] = {
    "norm_type": Fault(lambda: {"norm_type": 1.0}, GclipValueError, "norm_type"),
    "norm_type-inf": Fault(lambda: {"norm_type": math.inf}, GclipValueError, "norm_type"),
    "mode": Fault(lambda: {"mode": "rms"}, GclipValueError, "'rms'"),
    "max_norm": Fault(lambda: {"max_norm": 2.5}, GclipValueError, "2.5"),
    "reproducible": Fault(lambda: {"reproducible": True}, GclipValueError, "reproducible"),
    "error_if_nonfinite": Fault(lambda: {"error_if_nonfinite": True}, GclipValueError, "error_if_nonfinite"),
}


def clip_with_fault(comm, fault: Fault, bad: int, **extra) -> Report:
    kwargs: dict = {"grads": fresh(comm), "max_norm": 1.0, "comm": comm, **extra, **fault.common()}
    if comm.Get_rank() == bad:
        kwargs.update(fault.bad())
    grads, max_norm = kwargs.pop("grads"), kwargs.pop("max_norm")
    return attempt(lambda: gclip.gallery.clip_by_global_norm(grads, max_norm, **kwargs))


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("name", list(FAULTS))
def test_bad_input_on_one_rank_raises_everywhere(comm, name, where):
    fault, bad = FAULTS[name], bad_rank(comm, where)
    reports = everyone(comm, clip_with_fault(comm, fault, bad))
    check_agreed(comm, reports, fault.expected, bad, fault.needle)
    others = [r for r in range(comm.Get_size()) if r != bad]
    assert not any(names_rank(reports[0].message, r) for r in others), reports[0].message
    check_comm_still_works(comm)


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_ranks_that_disagree_raise_everywhere(comm, name, where):
    fault, bad = MISMATCHES[name], bad_rank(comm, where)
    reports = everyone(comm, clip_with_fault(comm, fault, bad))
    check_agreed(comm, reports, fault.expected, bad, fault.needle)
    check_comm_still_works(comm)


# the programs with a second, config-dependent collective must not be entered by anyone
PROGRAMS = {
    "l2": {},
    "inf": {"norm_type": math.inf},
    "p3": {"norm_type": 3.0},
    "reproducible": {"reproducible": True},
    "reproducible-inf": {"reproducible": True, "norm_type": "inf"},
    "sum-of-norms": {"mode": "sum-of-norms"},
    "max-of-norms": {"mode": "max-of-norms"},
    "rank0-norm": {"mode": "rank0-norm"},
    "per-rank": {"mode": "per-rank"},
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_bad_input_is_agreed_in_every_program(comm, program):
    bad = comm.Get_size() - 1
    reports = everyone(comm, clip_with_fault(comm, FAULTS["int-array"], bad, **PROGRAMS[program]))
    check_agreed(comm, reports, GclipTypeError, bad, "int")
    check_comm_still_works(comm)


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_nonfinite_norm_raises_everywhere(comm, value, where, norm_type):
    bad = bad_rank(comm, where)
    grads = fresh(comm)
    if comm.Get_rank() == bad:
        grads[1] = value
    call = lambda: gclip.clip_by_global_norm(  # noqa: E731
        grads, 1.0, comm=comm, norm_type=norm_type, error_if_nonfinite=True
    )
    reports = everyone(comm, attempt(call))
    needle = "nan" if math.isnan(value) else "inf"
    check_agreed(comm, reports, NonFiniteNormError, [], needle)
    check_comm_still_works(comm)


@pytest.mark.parametrize("where", ["last", "first"])
def test_nonfinite_norm_error_names_the_rank(comm, where):
    bad = bad_rank(comm, where)
    grads = fresh(comm)
    if comm.Get_rank() == bad:
        grads[0] = math.nan
    call = lambda: gclip.clip_by_global_norm(grads, 1.0, comm=comm, error_if_nonfinite=True)  # noqa: E731
    reports = everyone(comm, attempt(call))
    check_agreed(comm, reports, NonFiniteNormError, bad)


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("inplace", [False, True])
def test_nonfinite_norm_without_error_leaves_every_rank_untouched(comm, value, where, inplace):
    bad = bad_rank(comm, where)
    grads = fresh(comm)
    if comm.Get_rank() == bad:
        grads[2] = value
    before = grads.copy()
    report = attempt(lambda: gclip.clip_by_global_norm(grads.copy(), 1.0, comm=comm))
    reports = everyone(comm, report)
    assert all(r.kind is None for r in reports), reports
    result = gclip.clip_by_global_norm(grads, 1.0, comm=comm, inplace=inplace)
    norms = everyone(comm, repr(float(result.total_norm)))
    assert len(set(norms)) == 1, f"ranks disagree on the norm: {norms}"
    expected_norm_repr = "nan" if math.isnan(value) else "inf"
    agree(comm, norms[0] == expected_norm_repr, f"norm {norms[0]}")
    agree(comm, result.finite is False, f"finite={result.finite}")
    agree(comm, result.scale == 1.0, f"scale={result.scale}")
    agree(comm, np.array_equal(result.grads, before, equal_nan=True), "gradients changed")
    agree(comm, np.array_equal(grads, before, equal_nan=True), "input changed")
    check_comm_still_works(comm)


def test_two_ranks_failing_differently_are_both_named(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    grads, max_norm = fresh(comm), 1.0
    if rank == 0:
        grads = np.arange(4)
    if rank == size - 1:
        max_norm = -3.0
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(grads, max_norm, comm=comm)))
    check_agreed(comm, reports, GclipError, [0, size - 1])
    check_comm_still_works(comm)


def test_global_norm_agrees_on_errors_too(comm):
    bad = comm.Get_size() - 1
    grads = np.arange(4) if comm.Get_rank() == bad else fresh(comm)
    reports = everyone(comm, attempt(lambda: gclip.global_norm(grads, comm=comm)))
    check_agreed(comm, reports, GclipTypeError, bad, "int")
    check_comm_still_works(comm)


def test_default_communicator_agrees_on_errors(comm):
    """comm=None is COMM_WORLD: the same agreement there."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    bad = world.Get_size() - 1
    max_norm = math.nan if world.Get_rank() == bad else 1.0
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(fresh(comm), max_norm)))
    check_agreed(comm, reports, GclipValueError, bad, "nan")
    result = gclip.clip_by_global_norm(fresh(comm), 1.0)
    norm = expected_norm(world.Get_size())
    agree(comm, math.isclose(result.total_norm, norm, rel_tol=1e-12), f"norm {result.total_norm!r}")


def exact_norm(values) -> float:
    """The L2 norm of the values, from exact rational arithmetic (an oracle independent of gclip)."""
    total = sum(Fraction(float(v)) ** 2 for v in values)
    if total == 0:
        return 0.0
    bits = total.numerator.bit_length() - total.denominator.bit_length()
    k = max(0, (160 - bits) // 2 + 1)  # enough bits for isqrt to be exact to ~2**-64
    root = math.isqrt(total.numerator * 4**k // total.denominator)
    return float(Fraction(root, 2**k))


@pytest.mark.parametrize("case", ["huge-on-one-rank", "tiny-everywhere"])
@pytest.mark.parametrize("where", ["last", "first"])
def test_rescue_takes_every_rank_along(comm, case, where):
    """Squares that overflow on one rank (or underflow on all): the two-pass rescue needs
    more collectives, which every rank must enter together; the norm stays exact."""
    bad, size = bad_rank(comm, where), comm.Get_size()

    def shard(r: int) -> np.ndarray:
        base = np.full(4, r + 1.0)
        if case == "huge-on-one-rank":
            return base * (1e200 if r == bad else 1.0)
        return base * (1e-200 * (7.0 if r == bad else 1.0))

    grads = shard(comm.Get_rank())
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(grads, 1.0, comm=comm)))
    assert all(r.kind is None for r in reports), reports
    result = gclip.clip_by_global_norm(grads, 1.0, comm=comm)
    norm = exact_norm(np.concatenate([shard(r) for r in range(size)]))
    norms = everyone(comm, float(result.total_norm))
    assert len(set(norms)) == 1, f"ranks disagree on the norm: {norms}"
    assert math.isclose(norms[0], norm, rel_tol=1e-12), f"norm {norms[0]!r}, expected {norm!r}"
    agree(comm, np.allclose(result.grads, grads * min(1.0, 1.0 / norm), rtol=1e-12, atol=0), "scale")
    check_comm_still_works(comm)


def _modes() -> list:
    """Every strategy but per-rank (whose norm is each rank's own by design)."""
    return [name for name in gclip.gallery.STRATEGIES if name != "per-rank"]


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("mode", _modes())
def test_nan_on_one_rank_gives_one_norm_in_every_mode(comm, mode, where):
    """Every rank sees the same norm: NaN, as the NaN is in the gradient, except where the mode
    reads rank 0's shard alone (rank0-norm) and the NaN is elsewhere: rank 0's own norm. Also
    the simulated run of the same layout (the other driver of the same program)."""
    bad, size = bad_rank(comm, where), comm.Get_size()

    def shard(r: int) -> np.ndarray:
        g = np.full(4, r + 1.0)
        if r == bad:
            g[3] = math.nan
        return g

    grads = shard(comm.Get_rank())
    reports = everyone(
        comm, attempt(lambda: gclip.gallery.clip_by_global_norm(grads, 1.0, comm=comm, mode=mode))
    )
    assert all(r.kind is None for r in reports), reports
    result = gclip.gallery.clip_by_global_norm(grads, 1.0, comm=comm, mode=mode)
    want = repr(exact_norm(shard(0))) if mode == "rank0-norm" and bad != 0 else "nan"
    norms = everyone(comm, repr(float(result.total_norm)))
    assert norms == [want] * size, f"norms {norms}, expected {want}"
    simulated = gclip.gallery.clip_simulated([shard(r) for r in range(size)], 1.0, mode=mode)
    assert repr(float(simulated[0].total_norm)) == want, f"simulated {simulated[0].total_norm}"


@pytest.mark.parametrize("other", [1, np.float64(1.0), np.float32(1.0)], ids=["int", "float64", "float32"])
def test_equal_limits_of_different_types_are_not_a_disagreement(comm, other):
    max_norm = other if comm.Get_rank() == comm.Get_size() - 1 else 1.0
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(fresh(comm), max_norm, comm=comm)))
    assert all(r.kind is None for r in reports), reports[0].message


def test_a_limit_of_minus_zero_is_zero_on_every_rank(comm):
    """-0.0 == 0.0: ranks passing either agree, and every value is clipped to +0.0."""
    max_norm = -0.0 if comm.Get_rank() == comm.Get_size() - 1 else 0.0
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(fresh(comm), max_norm, comm=comm)))
    assert all(r.kind is None for r in reports), reports[0].message
    result = gclip.clip_by_global_norm(fresh(comm), max_norm, comm=comm)
    signs = everyone(comm, (math.copysign(1.0, result.scale), bool(np.signbit(result.grads).any())))
    assert signs == [(1.0, False)] * comm.Get_size(), signs


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("step", ["max_abs", "scaled_power_sum"])
def test_a_failure_in_the_rescue_after_the_header_is_agreed(comm, monkeypatch, step, where):
    """The overflow rescue reads the arrays again after the header: an out-of-memory (or
    device) error there on one rank is raised on every rank, naming it, not left alone."""
    from gclip import partials

    bad, size = bad_rank(comm, where), comm.Get_size()
    huge = (bad + 1) % size  # another rank overflows, so every rank takes the rescue
    grads = fresh(comm) * (1e200 if comm.Get_rank() == huge else 1.0)
    if comm.Get_rank() == bad:

        def fail(*args, **kwargs):
            raise MemoryError("cannot allocate 8 MiB")

        monkeypatch.setattr(partials, step, fail)
    reports = everyone(comm, attempt(lambda: gclip.clip_by_global_norm(grads, 1.0, comm=comm)))
    monkeypatch.undo()
    check_agreed(comm, reports, GclipError, bad, "MemoryError: cannot allocate")
    check_comm_still_works(comm)


@pytest.mark.parametrize("where", ["last", "first"])
def test_explain_and_check_replicas_agree_on_errors_and_keep_their_class(comm, where):
    from gclip import replicas

    bad, mine = bad_rank(comm, where), comm.Get_rank() == bad_rank(comm, where)
    norm_type = 0 if mine else 2.0  # checked inside the agreement, not before it
    reports = everyone(comm, attempt(lambda: replicas.explain(fresh(comm), comm=comm, norm_type=norm_type)))
    check_agreed(comm, reports, GclipValueError, bad, "norm_type")
    grads = "0.5" if mine else fresh(comm)
    reports = everyone(comm, attempt(lambda: replicas.explain(grads, comm=comm)))
    check_agreed(comm, reports, GclipTypeError, bad, "grads")
    reps = [None] if mine else [True]
    reports = everyone(
        comm, attempt(lambda: replicas.check_replicas([fresh(comm)], replicated=reps, comm=comm))
    )
    check_agreed(comm, reports, GclipTypeError, bad, "replicated[0] is None")
    check_comm_still_works(comm)
