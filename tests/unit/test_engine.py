"""gclip.engine: one rank's checks, the norm program's collectives and its agreement, on simulated ranks.

The ranks are driven in lockstep by the test's own small driver (sum or max of the
ranks' vectors, a list for a gather), so each rank's outcome is seen, not only the
first error; norms are checked against exact arithmetic (fractions) or math.fsum."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from gclip import GclipError, GclipTypeError, GclipValueError, drivers, engine, partials, reader


def lockstep(programs) -> tuple[list[Any], list[Any]]:
    """Run the programs as ranks would: (each rank's outcome or exception, the collectives)."""
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


def programs(shards, p: float = 2.0, reproducible: bool = False, backends=None, refused=None, limit=1.0):
    size = len(shards)
    out = []
    for r, s in enumerate(shards):
        backend = engine.NUMPY if backends is None else engine.Backend(reader.read, backends[r])
        args = engine.check(
            [np.asarray(s, dtype=np.float64)],
            limit,
            backend,
            rank=r,
            size=size,
            norm_type=p,
            reproducible=reproducible,
        )
        if refused is not None and refused[r] is not None:
            args = dataclasses.replace(args, error=refused[r])
        out.append(engine.program(args))
    return out


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
    assert [norm for norm, _ in outcome] == [want] * 3
    assert [scale for _, scale in outcome] == [1.0 / want] * 3


def test_the_inf_norm_takes_one_max_after_the_header():
    outcome, seen = lockstep(programs(SHARDS, p=math.inf))
    assert [type(c).__name__ for c in seen] == ["Reduce", "Reduce"] and seen[1].op is engine.NormOp.MAX
    assert {norm for norm, _ in outcome} == {8.0}


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_reproducible_is_exact_and_the_same_bits_for_any_split(p):
    values = [0.1, 1e-3, 12345.678, -3.25, 1e10, 1e-10]
    want = exact_norm(values, int(p))
    got = set()
    for split in ([values], [values[:2], values[2:]], [[v] for v in values]):
        outcome, _ = lockstep(programs(split, p=p, reproducible=True))
        got |= {norm.hex() for norm, _ in outcome}
    assert len(got) == 1
    assert float.fromhex(got.pop()) == pytest.approx(want, rel=2.3e-16)


@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_the_rescue_takes_every_rank_along_and_is_exact(scale):
    shards = [[3.0 * scale, 4.0 * scale], [1.0], [2.0 * scale]]
    outcome, seen = lockstep(programs(shards))
    assert len(seen) == 3  # the header, then the rescue's MAX and SUM
    want = exact_norm([v for s in shards for v in s])
    assert len({norm for norm, _ in outcome}) == 1
    assert outcome[0][0] == pytest.approx(want, rel=1e-15)


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
    progs = [
        engine.program(engine.check([np.ones(2)], 1.0, rank=r, size=2, norm_type=p))
        for r, p in enumerate((2.0, 1.0))
    ]
    outcome, _ = lockstep(progs)
    assert all(isinstance(o, GclipValueError) and "disagree" in str(o) for o in outcome)
    assert len({str(o) for o in outcome}) == 1
    assert "norm_type=2.0" in str(outcome[0]) and "norm_type=1.0" in str(outcome[0])


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


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, 0.5])
def test_root_inverts_the_power_without_overflow(p):
    assert engine.root(16.0, 0, p) == pytest.approx(16.0 ** (1 / p), rel=1e-15)
    # 2**2000 as (1.0, 1000) for p=2: the root is 2**1000
    assert engine.root(1.0, 1000, 2.0) == 2.0**1000
    assert engine.root(0.0, 5, p) == 0.0 and math.isinf(engine.root(math.inf, 0, p))


# ---------------------------------------------------------------------------
# one rank's call: the checks, the norm, the factor


def exact_clip(shards, limit):
    """(norm, scale) of the shards' global L2 norm, from fractions: the oracle."""
    power = sum(Fraction(float(v)) ** 2 for s in shards for v in np.ravel(s))
    norm = math.sqrt(power)  # correctly rounded from the exact sum (< 2**53 here)
    return norm, min(Fraction(1), Fraction(limit) / Fraction(norm))


def test_the_program_checks_reduces_and_gives_the_factor_on_every_rank():
    shards = [np.array([3.0, 4.0]), np.array([12.0])]
    calls = [engine.check(s, 1.0, rank=r, size=2) for r, s in enumerate(shards)]
    done, seen = lockstep([engine.program(args) for args in calls])
    norm, scale = exact_clip(shards, 1.0)
    assert len(seen) == 1  # the header is the one collective: the scale needs none
    for (got_norm, got_scale), args, s in zip(done, calls, shards):
        assert got_norm == norm == 13.0
        assert got_scale == float(scale)  # the exact quotient, rounded once
        out = args.grads.scaled(got_scale, False)  # new arrays, in the layout given (one array)
        assert np.array_equal(out, s * got_scale) and out is not s


def test_a_norm_alone_scales_nothing():
    x = np.array([3.0, 4.0])
    (done,), _ = lockstep([engine.program(engine.check(x, engine.NO_LIMIT, rank=0, size=1))])
    assert done == (5.0, 1.0)
    assert np.array_equal(x, [3.0, 4.0])


def test_a_refused_argument_is_raised_on_every_rank_together():
    shards = [np.ones(2), np.ones(2, dtype=np.int64)]  # rank 1's array is not a float array
    calls = [engine.check(s, 1.0, rank=r, size=2) for r, s in enumerate(shards)]
    assert calls[0].error is None and isinstance(calls[1].error, GclipTypeError)  # kept, not raised
    done, _ = lockstep([engine.program(args) for args in calls])
    assert all(isinstance(d, GclipTypeError) for d in done), done
    assert len({str(d) for d in done}) == 1 and "rank 1" in str(done[0])


def test_a_driver_runs_the_program_and_the_reader_scales_in_place():
    given = [np.array([6.0, 8.0], dtype=np.float32), np.array([0.0])]
    ops = []

    def reduce(data, op):
        ops.append(op)
        return data.copy()

    args = engine.check(given, 5.0, rank=0, size=1, inplace=True)
    norm, scale = drivers.drive(engine.program(args), reduce, lambda item: [item])
    assert ops == [engine.NormOp.SUM]  # the header alone
    assert (norm, scale) == (10.0, 0.5)
    assert args.grads.scaled(scale, True) is given  # in place: the very list given
    assert np.array_equal(given[0], np.array([3.0, 4.0], dtype=np.float32))


@pytest.mark.parametrize("bad", ["x", 3])
def test_replicated_must_be_a_list(bad):
    (done,), _ = lockstep([engine.program(engine.check([np.ones(2)], 1.0, rank=0, size=1, replicated=bad))])
    assert isinstance(done, GclipTypeError) and "replicated must be a list" in str(done)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.5])
@pytest.mark.parametrize("reproducible", [False, True])
@pytest.mark.parametrize("flag", [False, True])
def test_the_checked_settings_fingerprint_is_the_specs_own(p, reproducible, flag):
    """check() fingerprints a new limit from a cached CRC of the settings before it: the value
    must be the one Spec.fingerprint computes from the whole description (the ranks compare it)."""
    if reproducible and p == 3.5:
        pytest.skip("reproducible takes p = 1, 2 or inf")
    for limit in (0.5, 1e-300, 0.0, 1, engine.NO_LIMIT, 123456.789, 5e307):
        spec, _ = engine._check_settings(p, limit, reproducible, flag)
        assert spec.fingerprint == engine.Spec(spec.norm_type, spec.reproducible, spec.extra).fingerprint


def _one_rank(arrays, limit=1.0, **settings):
    return engine.check(arrays, limit, rank=0, size=1, **settings)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("limit", [engine.NO_LIMIT, 0.5, 1e9])
def test_alone_is_the_programs_result_to_the_bit(dtype, limit):
    rng = np.random.default_rng(7)
    for n in (1, 3, 1000, 5000):
        arrays = [(rng.standard_normal(n) * rng.choice([1e-3, 1.0, 50.0])).astype(dtype)]
        args = _one_rank(arrays, limit)
        got = engine.alone(args)
        want = drivers.run_simulated([engine.program(args)])[0]
        assert got is not None and got == want  # (norm, factor), bit for bit
        exact = math.sqrt(math.fsum(float(Fraction(float(x)) ** 2) for x in arrays[0]))
        assert math.isclose(got[0], exact, rel_tol=1e-12)


@pytest.mark.parametrize(
    "arrays, settings",
    [
        ([np.array([1e200, 1e200])], {}),  # the sum overflows: the program's rescue
        ([np.array([1e-300])], {}),  # underflows: the rescue too
        ([np.array([np.inf, 1.0])], {"error_if_nonfinite": True}),  # the program raises it
        ([np.array([3.0, 4.0])], {"norm_type": 1.0}),
        ([np.array([3.0, 4.0])], {"norm_type": math.inf}),
        ([np.array([3.0, 4.0])], {"reproducible": True}),
        ([np.array([3.0, 4.0])], {"replicated": [True]}),  # a layout to count
        (["not an array"], {}),  # an error to raise
    ],
)
def test_alone_leaves_to_the_program_what_only_it_says(arrays, settings):
    args = _one_rank(arrays, **settings)
    assert engine.alone(args) is None
    outcome, _ = lockstep([engine.program(args)])
    if isinstance(arrays[0], np.ndarray) and not settings.get("error_if_nonfinite"):
        assert not isinstance(outcome[0], Exception)  # the program's own answer where alone declines


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_alone_answers_a_non_finite_sum_as_the_program_does(bad):
    args = _one_rank([np.array([3.0, bad, 4.0])], 1.0)
    got, (want,) = engine.alone(args), drivers.run_simulated([engine.program(args)])
    assert got is not None and got[1] == want[1] == 1.0  # nothing scaled
    assert got[0] == want[0] or (math.isnan(got[0]) and math.isnan(want[0]))


def test_alone_is_for_one_rank_only():
    args = engine.check([np.array([3.0, 4.0])], 1.0, rank=0, size=2)
    assert engine.alone(args) is None
