"""gclip.engine: the norm program's collectives and its agreement, on simulated ranks.

The ranks are driven in lockstep by the test's own small driver (sum or max of the
ranks' vectors, a list for a gather), so each rank's outcome is seen, not only the
first error; norms are checked against exact arithmetic (fractions) or math.fsum."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from gclip import GclipError, GclipTypeError, GclipValueError, engine, partials


def lockstep(programs) -> tuple[list[Any], list[Any]]:
    """Run the programs as ranks would: (each rank's NormInfo or exception, the collectives)."""
    size = len(programs)
    outcome: list[Any] = [None] * size
    requests: list[Any] = [next(p) for p in programs]
    seen = []
    while any(r is not None for r in requests):
        live = [r for r in requests if r is not None]
        assert len(live) == size, f"ranks left the collective: {outcome}"
        first = live[0]
        assert all(type(r) is type(first) for r in live)
        seen.append(first)
        if isinstance(first, engine.Reduce):
            stack = np.stack([r.data for r in live])
            reply: Any = stack.max(axis=0) if first.op is engine.NormOp.MAX else stack.sum(axis=0)
        else:
            reply = [r.item for r in live]
        for i, prog in enumerate(programs):
            try:
                requests[i] = prog.send(reply.copy() if isinstance(reply, np.ndarray) else reply)
            except StopIteration as done:
                requests[i], outcome[i] = None, done.value
            except Exception as exc:  # noqa: BLE001 - recorded per rank
                requests[i], outcome[i] = None, exc
    return outcome, seen


def spec(p: float = 2.0, reproducible: bool = False) -> engine.Spec:
    return engine.Spec(engine.CORRECT, p, reproducible)


def programs(shards, p: float = 2.0, reproducible: bool = False, backends=None, refused=None):
    size = len(shards)
    return [
        engine.norm_program(
            [np.asarray(s, dtype=np.float64)],
            spec(p, reproducible),
            rank=r,
            size=size,
            refused=None if refused is None else refused[r],
            backend=partials if backends is None else backends[r],
        )
        for r, s in enumerate(shards)
    ]


def exact_norm(values, p: int = 2) -> float:
    total = sum(abs(Fraction(float(v))) ** p for v in values)
    if p == 2:  # exact integer square root on a scaled numerator: correctly rounded enough
        k = 200
        return float(Fraction(math.isqrt(total.numerator * 4**k // total.denominator), 2**k))
    return float(total) ** (1.0 / p)


SHARDS = [[3.0, -1.5], [2.0], [0.25, 7.0, -8.0]]


def test_the_default_l2_norm_is_one_header_collective():
    outcome, seen = lockstep(programs(SHARDS))
    assert len(seen) == 1 and seen[0].data.size == engine.HEADER_SIZE
    want = math.sqrt(math.fsum(v * v for s in SHARDS for v in s))
    assert [o.norm for o in outcome] == [want] * 3
    assert [o.local_power for o in outcome] == [math.fsum(v * v for v in s) for s in SHARDS]


def test_the_inf_norm_takes_one_max_after_the_header():
    outcome, seen = lockstep(programs(SHARDS, p=math.inf))
    assert [type(c).__name__ for c in seen] == ["Reduce", "Reduce"] and seen[1].op is engine.NormOp.MAX
    assert {o.norm for o in outcome} == {8.0}


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_reproducible_is_exact_and_the_same_bits_for_any_split(p):
    values = [0.1, 1e-3, 12345.678, -3.25, 1e10, 1e-10]
    want = exact_norm(values, int(p))
    got = set()
    for split in ([values], [values[:2], values[2:]], [[v] for v in values]):
        outcome, _ = lockstep(programs(split, p=p, reproducible=True))
        got |= {o.norm.hex() for o in outcome}
    assert len(got) == 1
    assert float.fromhex(got.pop()) == pytest.approx(want, rel=2.3e-16)


@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_the_rescue_takes_every_rank_along_and_is_exact(scale):
    shards = [[3.0 * scale, 4.0 * scale], [1.0], [2.0 * scale]]
    outcome, seen = lockstep(programs(shards))
    assert len(seen) == 3  # the header, then the rescue's MAX and SUM
    want = exact_norm([v for s in shards for v in s])
    assert len({o.norm for o in outcome}) == 1
    assert outcome[0].norm == pytest.approx(want, rel=1e-15)


class Failing:
    """partials, but one function raises (an out-of-memory or device error on one rank)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr == self.name:

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise MemoryError("cannot allocate 8 MiB")

            return fail
        return getattr(partials, attr)


@pytest.mark.parametrize("where", ["max_abs", "scaled_power_sum"])
@pytest.mark.parametrize("bad", [0, 2])
def test_a_failure_in_the_rescue_is_raised_on_every_rank(where, bad):
    """The rescue reads the arrays after the header: a failure there must not leave
    the other ranks waiting in the rescue's collectives."""
    shards = [[1.0], [1e200], [2.0]]  # rank 1 overflows, so every rank takes the rescue
    backends = [Failing(where) if r == bad else partials for r in range(3)]
    outcome, _ = lockstep(programs(shards, backends=backends))
    assert all(isinstance(o, GclipError) for o in outcome), outcome
    messages = {str(o) for o in outcome}
    assert messages == {f"rank {bad} of 3: MemoryError: cannot allocate 8 MiB"}


def test_an_error_before_the_header_is_raised_on_every_rank_with_its_class():
    outcome, seen = lockstep(programs(SHARDS, refused=[None, TypeError("grads[0] is a string"), None]))
    assert len(seen) == 2 and isinstance(seen[1], engine.Gather)  # the header, then the error's gather
    assert {type(o) for o in outcome} == {GclipTypeError}
    assert {str(o) for o in outcome} == {"rank 1 of 3: grads[0] is a string"}


def test_ranks_that_disagree_on_the_arguments_all_raise():
    progs = [engine.norm_program([np.ones(2)], spec(p), rank=r, size=2) for r, p in enumerate((2.0, 1.0))]
    outcome, _ = lockstep(progs)
    assert all(isinstance(o, GclipValueError) and "disagree" in str(o) for o in outcome)
    assert len({str(o) for o in outcome}) == 1


def test_local_norm_is_right_where_the_plain_sum_is_not():
    for values, rescued in (
        ([1e200, 1e200], True),
        ([1e-200, 3e-200], True),
        ([0.0], False),
        ([1.5, -2.0], False),
    ):
        power, rescue, norm = engine.local_norm([np.array(values)], 2.0)
        assert norm == pytest.approx(exact_norm(values), rel=1e-15) if any(values) else norm == 0.0
        assert rescue is rescued, values
        if not rescued:
            assert power == math.fsum(v * v for v in values)


def test_the_hook_runs_a_replaced_step_in_place_of_the_engines_own():
    assert all(
        getattr(engine.CORRECT, step) is None
        for step in ("local_partials", "in_header", "combine", "finish", "scale")
    )
    doubled = engine.Steps("doubled", finish=lambda norm, **_: 2.0 * norm)
    progs = [
        engine.norm_program([np.array(s)], engine.Spec(hook, 2.0, False), rank=r, size=2)
        for hook in (engine.CORRECT, doubled)
        for r, s in enumerate(([3.0], [4.0]))
    ]
    correct, _ = lockstep(progs[:2])
    replaced, _ = lockstep(progs[2:])
    assert [i.norm for i in correct] == [5.0, 5.0]
    assert [i.norm for i in replaced] == [10.0, 10.0]  # the replaced finish, on every rank
    mixed = [
        engine.norm_program([np.ones(1)], engine.Spec(hook, 2.0, False), rank=r, size=2)
        for r, hook in enumerate((engine.CORRECT, doubled))
    ]
    outcome, _ = lockstep(mixed)
    assert all(isinstance(e, GclipError) for e in outcome)  # different steps: the fingerprints differ


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5])
def test_root_inverts_the_power_without_overflow(p):
    assert engine.root(16.0, 0, p) == pytest.approx(16.0 ** (1 / p), rel=1e-15)
    # 2**2000 as (1.0, 1000) for p=2: the root is 2**1000
    assert engine.root(1.0, 1000, 2.0) == 2.0**1000
    assert engine.root(0.0, 5, p) == 0.0 and math.isinf(engine.root(math.inf, 0, p))
