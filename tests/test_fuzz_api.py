"""Fuzzing the public API in one process: anything in, a result or a GclipError out.

``clip_simulated`` runs the very engine of ``clip_by_global_norm`` on 1..4 simulated
ranks, and ``clip_shards`` is the seed contract. Whatever they are given (nested lists,
strings, dicts, None, bools, huge or tiny floats, NaN, inf, object, complex and integer
arrays, 0-d and empty arrays; any limit, norm type or mode), each call must either
return a result of the right layout, dtypes and scale, or raise a ``GclipError`` with a
one-line message: never another exception, never a hang (a watchdog interrupts a call
that runs too long). And for finite float64 values of any magnitude the norm must match
an exact rational oracle to 1e-12, and the clipped gradient must respect the limit.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gclip
import gclip.gallery
from gclip import GclipError

FUZZ = settings(
    max_examples=200,
    deadline=2000,  # ms per example: slow, not hung (the watchdog handles hangs)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
WATCHDOG = 10.0  # seconds one call may take before it counts as hung


class Hung(BaseException):
    """Raised by the watchdog; a BaseException so that gclip's own handlers cannot swallow it."""


@contextlib.contextmanager
def watchdog(seconds: float = WATCHDOG) -> Iterator[None]:
    """Interrupt the block if it runs longer than ``seconds`` (SIGALRM, main thread).

    pytest-timeout's per-test limit uses the same timer: it is put back afterwards with
    the time it had left (at least a moment, so a limit that fell due in the block fires)."""

    def hung(signum, frame):
        raise Hung(f"still running after {seconds} s")

    if not hasattr(signal, "setitimer"):  # pragma: no cover - not on Windows
        yield
        return
    previous = signal.signal(signal.SIGALRM, hung)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def _real(x: Any) -> bool:
    return isinstance(x, (int, float, Fraction, np.floating, np.integer)) and not isinstance(x, bool)


def _is_one_line(message: str) -> bool:
    return bool(message.strip()) and "\n" not in message and "\r" not in message


# --------------------------------------------------------------------------- strategies

FLOAT_DTYPES = [np.float16, np.float32, np.float64]
OTHER_DTYPES = [np.int8, np.int64, np.uint16, np.bool_, np.complex64, np.complex128]

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def float_arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    width = np.dtype(dtype).itemsize * 8
    return draw(hnp.arrays(dtype, draw(shapes), elements=st.floats(width=width)))


other_arrays = st.one_of(
    st.sampled_from(OTHER_DTYPES).flatmap(lambda d: hnp.arrays(d, shapes)),
    st.lists(st.one_of(st.floats(), st.none(), st.text(max_size=2)), max_size=4).map(
        lambda xs: np.array(xs, dtype=object)
    ),
    hnp.arrays(np.dtype("U3"), shapes),
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.complex_numbers(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.fractions(),
    st.decimals(),
    st.dictionaries(st.text(max_size=2), st.floats(), max_size=2),
    st.sets(st.integers(), max_size=2),
)

nested = st.recursive(
    st.one_of(st.floats(), st.integers(-5, 5), st.none(), st.text(max_size=1)),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=8,
)

items = st.one_of(float_arrays(), float_arrays(), other_arrays, scalars, nested)
valid_grads = st.one_of(float_arrays(), st.lists(float_arrays(), max_size=3))
any_grads = st.one_of(items, st.lists(items, max_size=3), st.tuples(items, items))

# Every argument has a valid range and an anything-goes range. A call takes the valid one
# for all arguments but one (or, now and then, anything for all), so that a fault in one
# argument is not hidden behind an earlier complaint about another.
VALID = {
    "grads": valid_grads,
    "max_norm": st.one_of(
        st.floats(min_value=0, max_value=1e300),
        st.integers(0, 10**6),
        st.sampled_from([0, 1, 1.0, np.float32(2.0), np.float64(0.5), Fraction(1, 3)]),
    ),
    "norm_type": st.one_of(
        st.sampled_from([2.0, 2, 1, 1.0, 3.0, math.inf, "inf", "INF", "Infinity", " inf "]),
        st.floats(min_value=0.5, max_value=64.0),
    ),
    "mode": st.sampled_from(sorted(gclip.gallery.STRATEGIES)),
    "reproducible": st.booleans(),
    "error_if_nonfinite": st.booleans(),
    "replicated": st.none(),
}
ANY = {
    "grads": any_grads,
    "max_norm": st.one_of(
        st.sampled_from([None, -1.0, math.nan, math.inf, -math.inf, True, "1", 10**400, np.float16(-1)]),
        st.floats(),
        st.integers(),
        st.fractions(),
        scalars,
    ),
    "norm_type": st.one_of(
        st.sampled_from([0, -1, math.nan, -math.inf, 1e-300, 1e-3, 0.01, 0.5, 1e10, 2000, True, None, "foo"]),
        st.floats(),
        st.integers(-3, 10**4),
        st.fractions(),
        scalars,
    ),
    "mode": st.one_of(st.text(max_size=8), scalars),
    "reproducible": scalars,
    "error_if_nonfinite": scalars,
    "replicated": st.one_of(scalars, st.lists(st.booleans(), max_size=4), st.lists(scalars, max_size=3)),
}


@st.composite
def calls(draw) -> dict:
    """Arguments for clip_simulated: ranks, max_norm and keywords."""
    wild = draw(st.sampled_from([*ANY, "grads", "everything"]))
    args = {k: draw(ANY[k] if wild in (k, "everything") else VALID[k]) for k in VALID if k != "grads"}
    n = draw(st.integers(1, 4))
    rank_grads = ANY["grads"] if wild in ("grads", "everything") else VALID["grads"]
    args["ranks"] = draw(st.lists(st.one_of(VALID["grads"], rank_grads), min_size=n, max_size=n))
    return args


# --------------------------------------------------------------------------- checks


def _layout_ok(given: Any, out: Any) -> str:
    """'' if ``out`` has the layout and dtypes of ``given``, else why not."""
    if isinstance(given, (set, frozenset)):  # any other iterable: its items, as a list
        given = list(given)
    if isinstance(given, (list, tuple)):  # the layout given: a tuple stays a tuple
        if type(out) is not type(given) or len(out) != len(given):
            return f"expected a {type(given).__name__} of {len(given)}, got {type(out).__name__}"
        pairs = list(zip(given, out))
    else:
        pairs = [(given, out)]
    for g, o in pairs:
        a = np.asarray(g)
        if not isinstance(o, np.ndarray):
            return f"expected an ndarray, got {type(o).__name__}"
        if o.dtype != a.dtype or o.shape != a.shape:
            return f"expected {a.dtype}{a.shape}, got {o.dtype}{o.shape}"
        if isinstance(g, np.ndarray) and np.shares_memory(o, g):
            return "the result shares memory with the input (inplace=False)"
    return ""


def _snapshot(ranks: list) -> list:
    """Copies of every numpy array given, to prove the inputs are left alone."""
    out = []
    for g in ranks:
        for a in g if isinstance(g, (list, tuple)) else [g]:
            if isinstance(a, np.ndarray):
                out.append((a, a.copy()))
    return out


def _unchanged(snap: list) -> bool:
    return all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in snap)


# --------------------------------------------------------------------------- API fuzz


@FUZZ
@given(call=calls())
@example(
    call={
        "max_norm": 0.0,
        "norm_type": 2.0,
        "mode": "global",
        "reproducible": False,
        "error_if_nonfinite": False,
        "replicated": None,
        "ranks": [set()],  # an iterable that is neither a list nor a tuple: a list comes back
    }
)
@example(
    call={
        "max_norm": 0.0,
        "norm_type": 2.0,
        "mode": "nan-mask",  # an infinite norm masked into NaN: the scale is NaN, by design
        "reproducible": False,
        "error_if_nonfinite": False,
        "replicated": None,
        "ranks": [np.array(np.inf, dtype=np.float16)],
    }
)
def test_clip_simulated_returns_or_raises_a_gclip_error(call):
    call = dict(call)  # an explicit example is the same dict each time
    ranks, max_norm, mode = call.pop("ranks"), call.pop("max_norm"), call["mode"]
    error_if_nonfinite = call["error_if_nonfinite"]
    snap = _snapshot(ranks)
    try:
        with watchdog():
            results = gclip.gallery.clip_simulated(ranks, max_norm, **call)
    except GclipError as exc:
        assert _is_one_line(str(exc)), repr(str(exc))
        assert _unchanged(snap), "a failed call changed its input"
        return
    except Exception as exc:  # the point: nothing else may escape
        raise AssertionError(f"{type(exc).__name__} escaped: {exc}") from exc

    assert _unchanged(snap), "inplace=False changed the input"
    assert isinstance(results, list) and len(results) == len(ranks)
    for given_, r in zip(ranks, results):
        why = _layout_ok(given_, r.grads)
        assert not why, why
        assert isinstance(r.scale, float), r.scale
        # a bug that masks a non-finite norm into NaN gradients (nan-mask) scales by NaN, by design
        bug = gclip.gallery.STRATEGIES.get(mode) if isinstance(mode, str) else None
        nan_by_design = bug is not None and bug.nan_if_nonfinite
        if nan_by_design and not r.finite:
            assert math.isnan(r.scale), r.scale
        else:
            assert 0.0 <= r.scale <= 1.0, r.scale
        assert r.finite == math.isfinite(r.total_norm)
        assert math.isnan(r.total_norm) or r.total_norm >= 0.0, r.total_norm
        if not r.finite and error_if_nonfinite:
            raise AssertionError("a non-finite norm with error_if_nonfinite=True did not raise")
    if isinstance(mode, str) and mode == "global":  # the correct strategy: one norm, one scale, on every rank
        assert len({repr(float(r.total_norm)) for r in results}) == 1
        assert len({r.scale for r in results}) == 1


shard_items = st.one_of(
    st.floats(),
    st.integers(-(10**6), 10**6),
    st.fractions(max_denominator=1000),
    st.none(),
    st.booleans(),
    st.text(max_size=2),
    st.lists(st.floats(), max_size=2),
)
any_shards = st.one_of(
    st.lists(st.lists(st.floats(), max_size=5), max_size=4),
    st.lists(st.one_of(st.lists(shard_items, max_size=4), shard_items), max_size=4),
    st.tuples(st.lists(st.floats(), max_size=3)),
    scalars,
    hnp.arrays(np.float64, shapes),
)


@FUZZ
@given(shards=any_shards, limit=st.one_of(VALID["max_norm"], ANY["max_norm"]))
def test_clip_shards_returns_or_raises_a_gclip_error(shards, limit):
    try:
        with watchdog():
            out = gclip.clip_shards(shards, limit)
    except GclipError as exc:
        assert _is_one_line(str(exc)), repr(str(exc))
        return
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__} escaped: {exc}") from exc
    assert isinstance(out, list) and len(out) == len(shards)
    for given_, o in zip(shards, out):
        assert isinstance(o, list) and len(o) == len(given_)
        assert all(type(v) is float for v in o)


# --------------------------------------------------------------------------- value fuzz


def exact_norm(values: Any) -> float:
    """The L2 norm from exact rational arithmetic, correctly rounded (an oracle, not gclip)."""
    total = sum(Fraction(float(v)) ** 2 for v in np.ravel(values))
    if total == 0:
        return 0.0
    bits = total.numerator.bit_length() - total.denominator.bit_length()
    k = max(0, (160 - bits) // 2 + 1)  # isqrt then carries >= 80 exact bits
    root = math.isqrt(total.numerator * 4**k // total.denominator)
    return float(Fraction(root, 2**k))


def magnitudes(lo: int = -300, hi: int = 299) -> st.SearchStrategy[float]:
    """Finite float64 of magnitude 1e-300 .. 1e300, either sign, or zero."""
    return st.one_of(
        st.just(0.0),
        st.tuples(st.sampled_from([-1.0, 1.0]), st.floats(1.0, 9.999), st.integers(lo, hi)).map(
            lambda t: t[0] * t[1] * 10.0 ** t[2]
        ),
    )


@st.composite
def layouts(draw) -> list[list[np.ndarray]]:
    """1..4 ranks, each with 0..3 float64 arrays, values spread around one random decade."""
    centre = draw(st.integers(-290, 290))
    spread = draw(st.integers(0, 10))
    values = magnitudes(max(-300, centre - spread), min(299, centre + spread))
    values = st.one_of(values, magnitudes()) if draw(st.booleans()) else values
    arrays = st.lists(values, max_size=6).map(lambda xs: np.array(xs, dtype=np.float64))
    return draw(st.lists(st.lists(arrays, max_size=3), min_size=1, max_size=4))


@FUZZ
@given(ranks=layouts(), limit=st.one_of(st.just(0.0), magnitudes().map(abs)), reproducible=st.booleans())
def test_norm_matches_the_exact_oracle_at_any_magnitude(ranks, limit, reproducible):
    every = [a for r in ranks for a in r]
    values = np.concatenate(every) if every else np.zeros(0)
    want = exact_norm(values)
    assert math.isclose(want, math.hypot(*values), rel_tol=1e-15), "the oracle disagrees with hypot"

    with watchdog():
        results = gclip.clip_simulated(ranks, limit, reproducible=reproducible)
    norm = results[0].total_norm
    assert all(r.total_norm == norm and r.scale == results[0].scale for r in results)
    assert math.isclose(norm, want, rel_tol=1e-12, abs_tol=0.0), f"norm {norm!r}, exact {want!r}"

    scale = results[0].scale
    for given_, r in zip(ranks, results):
        for a, b in zip(given_, r.grads):
            assert np.array_equal(b, a * scale), "not the same scale everywhere"
    clipped = [b for r in results for b in r.grads]
    clipped_norm = exact_norm(np.concatenate(clipped) if clipped else np.zeros(0))
    assert clipped_norm <= limit * (1 + 1e-12) or scale == 1.0, f"{clipped_norm!r} > {limit!r}"
    if want <= limit:
        assert scale == 1.0


@settings(FUZZ, max_examples=100)
@given(ranks=layouts())
def test_reproducible_norm_does_not_depend_on_the_layout(ranks):
    every = [a for r in ranks for a in r]
    values = np.concatenate(every) if every else np.zeros(0)
    with watchdog():
        split = gclip.clip_simulated(ranks, 1.0, reproducible=True)[0].total_norm
        whole = gclip.clip_simulated([[values[::-1].copy()]], 1.0, reproducible=True)[0].total_norm
    assert split == whole, f"{split!r} != {whole!r}"


@FUZZ
@given(
    shards=st.lists(st.lists(magnitudes(-20, 20), max_size=5), max_size=4),
    limit=magnitudes(-20, 20).map(abs),
)
def test_clip_shards_matches_the_exact_oracle(shards, limit):
    with watchdog():
        out = gclip.clip_shards(shards, limit)
    flat = [v for s in shards for v in s]
    norm = exact_norm(flat)
    scale = 1.0 if norm == 0 or norm <= limit else limit / norm
    assert [len(s) for s in out] == [len(s) for s in shards]
    for s, o in zip(shards, out):
        for x, y in zip(s, o):
            # the contract rounds to 12 decimals: allow that rounding and 1e-12 relative
            assert abs(y - x * scale) <= 5e-13 + 1e-12 * abs(x * scale), (x, y, scale)


# --------------------------------------------------------------------------- regressions


def test_none_limit_is_a_gclip_error():
    with pytest.raises(GclipError):
        gclip.clip_simulated([np.ones(3)], None)


@pytest.mark.parametrize(("p", "layout"), [(0.001, [1000]), (0.001, [2, 2]), (0.01, [10**4]), (1e-300, [3])])
def test_small_p_norm_beyond_float_is_inf(p, layout):
    # the p-norm of n ones is n ** (1/p): beyond the float range it is inf (finite=False),
    # neither an OverflowError nor a GclipError
    results = gclip.clip_simulated([np.ones(n) for n in layout], 1.0, norm_type=p)
    assert all(r.total_norm == math.inf and r.finite is False for r in results)


@pytest.mark.parametrize(("p", "x"), [(2000.0, 2.0), (1e10, 3.0), (1100.0, 2.0**-600)])
def test_large_p_norm_of_one_element_is_its_magnitude(p, x):
    # any p-norm of a single element is |x| exactly
    result = gclip.clip_simulated([np.array([x])], 1e300, norm_type=p)[0]
    assert math.isclose(result.total_norm, x, rel_tol=1e-12), result.total_norm


def test_messages_are_one_line_whatever_the_input():
    with pytest.raises(GclipError) as info:
        gclip.gallery.clip_simulated([np.ones(2)], 1.0, mode=np.ones((2, 2)))
    assert _is_one_line(str(info.value)), repr(str(info.value))


@pytest.mark.parametrize(
    ("shards", "limit"),
    [
        ([[1.0]], 10**400),
        ([[10**400]], 1.0),
        ([[Fraction(10**400, 3)]], 1.0),
        ([[1.0]], Fraction(10**400, 3)),
    ],
)
def test_clip_shards_numbers_beyond_float_are_a_gclip_error(shards, limit):
    with pytest.raises(GclipError) as info:
        gclip.clip_shards(shards, limit)
    assert _is_one_line(str(info.value))


@pytest.mark.parametrize(("good", "bad"), [(1, True), (0, False), (1.0, "1.0"), (2.0, [2.0])])
def test_checked_settings_are_not_reused_for_a_lookalike(good, bad):
    # the scalar arguments are checked once per set and remembered: True == 1 and
    # hash(True) == hash(1), yet True must still be refused after 1 was accepted
    x = np.array([3.0, 4.0])
    assert gclip.clip_simulated([x], good)[0].total_norm == 5.0
    with pytest.raises(GclipError, match="max_norm must be a number"):
        gclip.clip_simulated([x], bad)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timers here")
def test_watchdog_gives_the_per_test_limit_back():
    # pytest-timeout (the suite's per-test limit) arms the same timer as the watchdog
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert left > 0, "no per-test limit is armed (pytest-timeout with timeout_method = signal)"
    handler = signal.getsignal(signal.SIGALRM)
    with watchdog():
        pass
    after, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 0 < after <= left
    assert signal.getsignal(signal.SIGALRM) is handler
