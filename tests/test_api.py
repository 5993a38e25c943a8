"""The public API in one process: aliases and overlaps, memory layouts, byte orders, float16,
COMM_SELF, the halves of a clip (clip_scale, apply_scale, clip_with_norm), global_norm's
error_if_nonfinite, and the communicator checks.

The oracles are not gclip's code: exact rational norms (tests/oracles.py), products computed
here with numpy, and the rules of the documentation written out in the tests.
"""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import gclip
from conftest import OneRankComm, venv_env
from gclip import partials
from oracles import exact_norm


@pytest.fixture(scope="module")
def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- aliases


@pytest.mark.parametrize("container", [list, tuple])
def test_the_same_array_twice_counts_once_and_is_scaled_once(self_comm, container):
    a = np.ones(4)
    result = gclip.clip_by_global_norm(container([a, a]), 1.0, inplace=True, comm=self_comm)
    assert result.total_norm == 2.0  # not sqrt(8)
    assert result.scale == 0.5
    assert type(result.grads) is container and result.grads[0] is a and result.grads[1] is a
    assert np.array_equal(a, np.full(4, 0.5))  # not 0.25


def test_the_same_array_twice_with_two_entries_is_named_without_addresses(self_comm):
    a = np.ones(3)
    for entries, words in (
        ([True, False], "(True, False)"),
        ([self_comm, False], "(Intracomm of 1 ranks, False)"),
    ):
        with pytest.raises(gclip.GclipValueError) as info:
            gclip.global_norm([a, a], replicated=entries, comm=self_comm)
        assert (
            f"grads[0] and grads[1] are the same array but replicated gives them different entries {words}"
            in str(info.value)
        ), str(info.value)
        assert " at 0x" not in str(info.value)


def test_the_same_array_twice_not_in_place(self_comm):
    a = np.ones(4)
    result = gclip.clip_by_global_norm([a, np.full(2, 3.0), a], 1.0, comm=self_comm)
    assert result.total_norm == exact_norm([1.0] * 4 + [3.0] * 2)
    assert len(result.grads) == 3 and np.array_equal(result.grads[0], result.grads[2])
    assert np.array_equal(result.grads[0], np.full(4, result.scale))
    assert np.array_equal(a, np.ones(4))


@pytest.mark.parametrize(
    "pick",
    [
        lambda x: [x, x[1:3]],
        lambda x: [x[0:3], x[2:5]],
        lambda x: [x[::-1], x],
        lambda x: [x.reshape(5, 1), x],
        lambda x: [x[::2], x[2:3]],
        lambda x: [x.view(np.float32), x],
    ],
    ids=["view-and-base", "partial", "reversed", "reshaped", "strided-and-slice", "other-dtype"],
)
def test_overlapping_arrays_are_refused(self_comm, pick):
    x = np.arange(1.0, 6.0)
    before = x.copy()
    with pytest.raises(gclip.GclipValueError, match="overlap") as info:
        gclip.clip_by_global_norm(pick(x), 0.1, inplace=True, comm=self_comm)
    assert "\n" not in str(info.value)
    assert same_bits(x, before)


@pytest.mark.parametrize(
    "pick", [lambda x: [x[0:2], x[2:5]], lambda x: [x[::2], x[1::2]], lambda x: [x[1:1], x[1:3], x[3:]]]
)
def test_disjoint_views_of_one_array_are_fine(self_comm, pick):
    x = np.arange(1.0, 6.0)
    views = pick(x)
    values = np.concatenate([v.ravel() for v in views])
    result = gclip.clip_by_global_norm(views, 1.0, inplace=True, comm=self_comm)
    assert math.isclose(result.total_norm, exact_norm(values), rel_tol=1e-15)
    assert np.array_equal(np.concatenate([v.ravel() for v in views]), values * result.scale)


def test_an_overlap_on_one_simulated_rank_leaves_every_rank_untouched():
    x = np.arange(1.0, 6.0)
    others = [np.full(3, 7.0), np.full(2, -1.0)]
    before = [x.copy()] + [o.copy() for o in others]
    with pytest.raises(gclip.GclipValueError, match=r"rank 1 of 3.*overlap"):
        gclip.clip_simulated([[others[0]], [x[0:3], x[2:5]], [others[1]]], 0.1, inplace=True)
    assert all(same_bits(a, b) for a, b in zip([x, *others], before))


# The same memory reached through something other than numpy views: a memoryview, a buffer
# read by np.frombuffer, as_strided (whose base is not an ndarray): found by address.


@pytest.mark.parametrize(
    "alias",
    [memoryview, lambda x: np.frombuffer(x.data), lambda x: as_strided(x, shape=x.shape, strides=x.strides)],
    ids=["memoryview", "frombuffer", "as_strided"],
)
def test_the_same_memory_through_a_buffer_counts_once(self_comm, alias):
    x = np.ones(4)
    try:
        result = gclip.clip_by_global_norm([x, alias(x)], 1.0, inplace=True, comm=self_comm)
    except gclip.GclipValueError:
        return  # refusing is acceptable too
    assert result.total_norm == 2.0, f"norm {result.total_norm}: counted twice"
    assert np.array_equal(x, np.full(4, 0.5)), f"{x}: scaled twice"


@pytest.mark.parametrize(
    "alias",
    [
        lambda x: np.asarray(memoryview(x))[1:3],
        lambda x: np.frombuffer(x.data)[1:3],
        lambda x: as_strided(x)[1:3],
    ],
    ids=["memoryview", "frombuffer", "as_strided"],
)
def test_a_partial_overlap_through_a_buffer_is_refused(self_comm, alias):
    x = np.arange(1.0, 6.0)
    with pytest.raises(gclip.GclipValueError, match="overlap"):
        gclip.clip_by_global_norm([x, alias(x)], 1.0, comm=self_comm)


# --------------------------------------------------------------------------- memory layouts

BASE_VIEWS = {
    "strided": (False, lambda b: b[:, ::3]),
    "negative-stride": (False, lambda b: b[::-1, ::-2]),
    "1d-negative-stride": (False, lambda b: b[3, ::-1]),
    "transposed": (False, lambda b: b.T),
    "fortran-order": (True, lambda b: b),
    "fortran-slice": (True, lambda b: b[1:5, ::-2]),
    "fortran-column": (True, lambda b: b[:, 2]),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("name", list(BASE_VIEWS))
def test_views_are_read_and_written_where_they_point(self_comm, name, inplace, dtype):
    fortran, pick = BASE_VIEWS[name]
    base = np.random.default_rng(5).normal(size=(6, 8)).astype(dtype)
    if fortran:
        base = np.asfortranarray(base)
    view = pick(base)
    mask = np.zeros(base.shape, dtype=bool)
    pick(mask)[...] = True
    before, values = base.copy(), np.array(view, dtype=np.float64)
    norm = exact_norm(values)
    result = gclip.clip_by_global_norm(view, 0.5, inplace=inplace, comm=self_comm)
    assert math.isclose(result.total_norm, norm, rel_tol=1e-15)
    assert math.isclose(result.scale, 0.5 / norm, rel_tol=1e-15)
    exact = values * result.scale
    got = np.asarray(result.grads, dtype=np.float64)
    if dtype is np.float64:
        assert np.array_equal(got, exact)
    else:
        assert np.all(np.abs(got - exact) <= 2.5 * np.spacing(np.abs(exact).astype(np.float32)))
    assert same_bits(base[~mask], before[~mask]), "written outside the view"
    if inplace:
        assert result.grads is view  # checked above: so the base holds the clipped values in the view
        assert not same_bits(base[mask], before[mask])
    else:
        assert same_bits(base, before)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", ["<f2", ">f2"])
def test_float16_in_place_is_rounded_once(self_comm, dtype):
    x = (np.random.default_rng(8).normal(size=(9, 11)) * 30).astype(dtype)
    values = x.astype(np.float64)
    result = gclip.clip_by_global_norm(x, 1.0, inplace=True, comm=self_comm)
    assert math.isclose(result.total_norm, exact_norm(values), rel_tol=1e-15)
    assert result.grads is x and x.dtype == np.dtype(dtype)
    assert np.array_equal(x, (values * result.scale).astype(np.float16))  # float64 product, one rounding


@pytest.mark.parametrize("dtype", [">f8", ">f4", ">f2"])
@pytest.mark.parametrize("inplace", [True, False])
def test_big_endian_input(self_comm, dtype, inplace):
    x = (np.random.default_rng(9).normal(size=40) * 5).astype(dtype)
    native = x.astype(np.dtype(dtype).newbyteorder("="))
    before, values = x.copy(), x.astype(np.float64)
    result = gclip.clip_by_global_norm(x, 1.0, inplace=inplace, comm=self_comm)
    assert math.isclose(result.total_norm, exact_norm(values), rel_tol=1e-15)
    out = result.grads
    assert out.dtype == np.dtype(dtype)
    if inplace:
        assert out is x
    else:
        assert same_bits(x, before)
    exact = values * result.scale
    if x.dtype.itemsize == 8:
        assert np.array_equal(out, exact)
    elif x.dtype.itemsize == 2:
        assert np.array_equal(out, exact.astype(np.float16))
    else:
        assert np.all(
            np.abs(out.astype(np.float64) - exact) <= 2.5 * np.spacing(np.abs(exact).astype(np.float32))
        )
    # the byte order changes nothing but the bytes
    twin = gclip.clip_by_global_norm(native, 1.0, comm=self_comm)
    assert twin.total_norm == result.total_norm and np.array_equal(twin.grads, out)


def _float32_ulps(out: np.ndarray, x: np.ndarray, scale: float) -> float:
    """The largest distance, in float32 ulps, of out from the exact product x * scale."""
    worst = Fraction(0)
    for o, v in zip(out.tolist(), x.tolist()):
        exact = Fraction(v) * Fraction(scale)
        ulp = Fraction(float(np.spacing(np.float32(abs(float(exact))))))
        worst = max(worst, abs(Fraction(o) - exact) / ulp)
    return float(worst)


def test_float32_scaling_keeps_the_documented_bound():
    """At most half an ulp above the exact product, less than 2**-23 + 2**-24 below it (relative)."""
    x = np.array([1.912708044052124], dtype=np.float32)
    scale = 0.5111420118541159
    out = gclip.apply_scale(x, scale)
    exact = Fraction(float(x[0])) * Fraction(scale)
    got = Fraction(float(out[0]))
    half_ulp = Fraction(float(np.spacing(np.float32(abs(float(out[0])))))) / 2
    assert got <= exact + half_ulp
    assert got >= exact * (1 - Fraction(1, 2**23) - Fraction(1, 2**24))
    assert _float32_ulps(out, x, scale) > 1.0  # the case that showed an earlier "1 ulp" claim wrong


def test_float32_scaling_never_rounds_the_scale_up():
    rng = np.random.default_rng(12)
    for _ in range(50):
        x = rng.normal(size=200).astype(np.float32)
        scale = float(rng.uniform(0.01, 1.0))
        out = gclip.apply_scale(x, scale)
        assert _float32_ulps(out, x, scale) <= 2.5
        # the factor actually used (each |out| / |x| rounds once) is never above the scale by more
        # than the product's own rounding
        big = np.abs(x) > 1e-3
        assert np.all(
            np.abs(out[big]).astype(np.float64) <= np.abs(x[big]).astype(np.float64) * scale * (1 + 2**-24)
        )


# --------------------------------------------------------------------------- communicators


def test_comm_self_clips_this_process_alone(self_comm):
    x = np.array([3.0, 4.0, 12.0])
    result = gclip.clip_by_global_norm(x, 1.0, comm=self_comm)
    assert result.total_norm == 13.0 and result.scale == 1.0 / 13.0
    assert np.array_equal(result.grads, x * (1.0 / 13.0))
    assert gclip.global_norm(x, comm=self_comm) == 13.0


# --------------------------------------------------------------------------- the limit


@pytest.mark.parametrize("limit", [np.array(5.0), np.array([5.0]), np.array([[5.0]]), np.float32(5.0)])
def test_a_limit_held_in_an_array_of_one_value_is_that_value(self_comm, limit):
    x = np.array([3.0, 4.0, 12.0])  # norm 13: the scale is 5/13
    result = gclip.clip_by_global_norm(x, limit, comm=self_comm)
    assert result.scale == 5.0 / 13.0


def test_an_array_limit_of_several_values_is_a_one_line_type_error(self_comm):
    with pytest.raises(gclip.GclipTypeError, match="max_norm must be a number, got a ndarray of 2 values"):
        gclip.clip_by_global_norm(np.ones(3), np.array([1.0, 2.0]), comm=self_comm)


def test_a_limit_changed_in_place_between_calls_is_read_afresh(self_comm):
    """A mutable limit (an adaptive clip keeping it in an array) is never remembered by identity."""
    limit = np.array([1.0])
    x = np.array([3.0, 4.0])
    assert gclip.clip_by_global_norm(x, limit, comm=self_comm).scale == 1.0 / 5.0
    limit[0] = 2.0
    assert gclip.clip_by_global_norm(x, limit, comm=self_comm).scale == 2.0 / 5.0


@pytest.mark.parametrize("comm", [object(), 42, "world", [1, 2]], ids=["object", "int", "str", "list"])
def test_a_comm_that_is_not_mpi4py_is_a_type_error(comm):
    for call in (
        lambda: gclip.clip_by_global_norm(np.ones(3), 1.0, comm=comm),
        lambda: gclip.global_norm(np.ones(3), comm=comm),
    ):
        with pytest.raises(gclip.GclipTypeError, match="comm must be an mpi4py communicator") as info:
            call()
        assert "\n" not in str(info.value)


LONE = """
import json, sys
import numpy as np
from mpi4py import MPI
import gclip
comm = {"none": None, "world": MPI.COMM_WORLD, "self": MPI.COMM_SELF}[sys.argv[1]]
try:
    result = gclip.clip_by_global_norm(np.array([3.0, 4.0]), 1.0, comm=comm)
except gclip.GclipError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
print(json.dumps({"norm": result.total_norm}))
"""

LAUNCHER_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def run_alone(comm: str = "none", **env_vars: str) -> tuple[int, str]:
    """LONE in a fresh Python, without mpirun, with these launcher variables (and no others)."""
    env = venv_env()
    for var in [*LAUNCHER_VARS, "PMI_RANK", "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD", "OMPI_COMM_WORLD_RANK"]:
        env.pop(var, None)
    env.update(env_vars)
    proc = subprocess.run(
        [sys.executable, "-c", LONE, comm], capture_output=True, text=True, env=env, timeout=120
    )
    return proc.returncode, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("var", "value"), [("WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("SLURM_STEP_NUM_TASKS", "3")]
)
def test_comm_none_is_refused_in_a_process_launched_as_one_of_several(var, value):
    import json

    code, line = run_alone(**{var: value})
    assert code == 3, line
    report = json.loads(line)
    assert report["error"] == "GclipError", report
    message = report["message"]
    assert "\n" not in message and f"{var}={value}" in message and "comm=None" in message, message


@pytest.mark.slow
def test_comm_world_spelled_out_is_refused_there_too_and_comm_self_is_not():
    import json

    code, line = run_alone("world", WORLD_SIZE="2")
    assert code == 3, line
    assert "comm=MPI.COMM_WORLD: MPI sees 1 rank" in json.loads(line)["message"], line
    code, line = run_alone("self", WORLD_SIZE="2")  # each process clipping alone, said explicitly
    assert code == 0 and json.loads(line) == {"norm": 5.0}, line


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1"}], ids=["no-launcher", "WORLD_SIZE=1"])
def test_comm_none_alone_is_fine_when_nothing_says_otherwise(env):
    import json

    code, line = run_alone(**env)
    assert code == 0, line
    assert json.loads(line) == {"norm": 5.0}


# --------------------------------------------------------------------------- the halves of a clip


@pytest.mark.parametrize(
    ("total_norm", "max_norm"), [(1e138, 1e-175), (3.0, 1e-308), (7.1e200, 2.3e-120), (1.9, 1e-320)]
)
def test_a_subnormal_scale_is_the_largest_that_does_not_lift_the_norm(self_comm, total_norm, max_norm):
    """Exact arithmetic as the oracle: scale * norm <= limit, and the next float up would exceed it
    (a subnormal quotient rounded to nearest can be 1e-11 above: the clipped norm over the limit)."""
    scale = gclip.clip_scale(total_norm, max_norm)
    assert 0.0 < scale < sys.float_info.min
    assert Fraction(scale) * Fraction(total_norm) <= Fraction(max_norm)
    assert Fraction(math.nextafter(scale, 1.0)) * Fraction(total_norm) > Fraction(max_norm)
    x = np.array([-total_norm])  # the case Hypothesis found: one value, the scale subnormal
    clipped = gclip.clip_by_global_norm(x, max_norm, comm=self_comm).grads
    assert abs(Fraction(float(clipped[0]))) <= Fraction(max_norm) * (1 + Fraction(1, 2**52))


@pytest.mark.parametrize(
    ("total_norm", "max_norm", "expected"),
    [
        (0.0, 1.0, 1.0),  # zero norm: 1
        (0.0, 0.0, 1.0),  # zero norm, zero limit: still 1
        (math.inf, 1.0, 1.0),  # non-finite: untouched
        (math.nan, 1.0, 1.0),
        (math.inf, 0.0, 1.0),
        (2.0, 1.0, 0.5),
        (3.0, 1.0, 1.0 / 3.0),
        (0.5, 1.0, 1.0),  # below the limit: 1
        (1.0, 1.0, 1.0),
        (3.0, 0.0, 0.0),  # zero limit
        (1e-300, 1e300, 1.0),
        (1e300, 1e-300, 1e-300 / 1e300),
        (5, 2, 0.4),  # ints
        (np.float32(4.0), np.float64(1.0), 0.25),
    ],
)
def test_clip_scale_rules(total_norm, max_norm, expected):
    got = gclip.clip_scale(total_norm, max_norm)
    assert type(got) is float and got == expected


@pytest.mark.parametrize(
    ("total_norm", "max_norm", "error"),
    [
        (-1.0, 1.0, gclip.GclipValueError),
        (1.0, -1.0, gclip.GclipValueError),
        (1.0, math.nan, gclip.GclipValueError),
        (1.0, math.inf, gclip.GclipValueError),
        ("1", 1.0, gclip.GclipTypeError),
        (1.0, True, gclip.GclipTypeError),
        (None, 1.0, gclip.GclipTypeError),
    ],
)
def test_clip_scale_refuses_bad_input(total_norm, max_norm, error):
    with pytest.raises(error):
        gclip.clip_scale(total_norm, max_norm)


def test_clip_with_norm_scales_by_a_known_norm():
    g = [np.array([3.0, 0.0]), np.array([[0.0], [4.0]], dtype=np.float32)]
    scale = min(1.0, 1.0 / 5.0)  # the rule, written out
    out = gclip.clip_with_norm(g, 1.0, 5.0)
    assert np.array_equal(out[0], np.array([3.0, 0.0]) * scale)
    assert out[1].dtype == np.float32 and abs(float(out[1][1, 0]) - 0.8) <= float(np.spacing(np.float32(0.8)))
    assert np.array_equal(g[0], [3.0, 0.0])  # not in place
    same = gclip.clip_with_norm(g, 10.0, 5.0, inplace=True)  # below the limit: nothing to do
    assert same is g and np.array_equal(g[0], [3.0, 0.0])
    out = gclip.clip_with_norm(g, 1.0, 5.0, inplace=True)
    assert out is g and np.array_equal(g[0], np.array([3.0, 0.0]) * scale)
    assert gclip.clip_with_norm(np.zeros(2), 0.0, 0.0).tolist() == [0.0, 0.0]  # zero norm: scale 1
    with pytest.raises(gclip.GclipValueError):
        gclip.clip_with_norm(g, 1.0, -5.0)


def test_clip_with_norm_after_global_norm_is_the_clip(self_comm):
    g = np.random.default_rng(2).normal(size=30)
    norm = gclip.global_norm(g, comm=self_comm)
    assert math.isclose(norm, exact_norm(g), rel_tol=1e-15)
    assert np.array_equal(gclip.clip_with_norm(g, 0.5, norm), g * (0.5 / norm))


@pytest.mark.parametrize("inplace", [True, False])
def test_apply_scale_one_touches_nothing(monkeypatch, inplace):
    calls = []
    real = partials._multiply_one
    monkeypatch.setattr(partials, "_multiply_one", lambda *a: calls.append(1) or real(*a))
    x = np.array([0.1, np.nan, -0.0], dtype=np.float32)
    before = x.copy()
    out = gclip.apply_scale(x, 1.0, inplace=inplace)
    assert calls == []
    assert same_bits(x, before)
    if inplace:
        assert out is x
    else:
        assert out is not x and same_bits(out, before)
    given = [x, np.ones(2)]
    assert gclip.apply_scale(given, 1, inplace=True) is given  # the very list
    given_t = (x,)
    assert gclip.apply_scale(given_t, 1.0, inplace=True) is given_t


@pytest.mark.parametrize("inplace", [True, False])
def test_apply_scale_zero(inplace):
    x = np.array([1.5, -2.0, 0.0])
    y = np.array([3.0, 7.0], dtype=np.float16)
    out = gclip.apply_scale([x, y], 0.0, inplace=inplace)
    assert all(np.all(o == 0) for o in out) and out[1].dtype == np.float16
    assert (out[0] is x and out[1] is y) if inplace else x[0] == 1.5


@pytest.mark.parametrize(
    ("scale", "error"),
    [
        (-0.5, gclip.GclipValueError),
        (-math.inf, gclip.GclipValueError),
        (math.inf, gclip.GclipValueError),
        (math.nan, gclip.GclipValueError),
        (True, gclip.GclipTypeError),
        ("0.5", gclip.GclipTypeError),
        (None, gclip.GclipTypeError),
    ],
)
def test_apply_scale_refuses_bad_scales(scale, error):
    x = np.ones(3)
    with pytest.raises(error) as info:
        gclip.apply_scale(x, scale, inplace=True)
    assert "\n" not in str(info.value)
    assert np.array_equal(x, np.ones(3))


@pytest.mark.parametrize("inplace", [True, False])
def test_apply_scale_keeps_the_layout(inplace):
    a, b = np.ones(2), np.full(3, 2.0)
    as_tuple = gclip.apply_scale((a, b), 0.5, inplace=inplace)
    assert type(as_tuple) is tuple and len(as_tuple) == 2
    as_list = gclip.apply_scale([a, b], 0.5, inplace=inplace)
    assert type(as_list) is list and len(as_list) == 2
    one = gclip.apply_scale(a, 0.5, inplace=inplace)
    assert isinstance(one, np.ndarray) and one.shape == (2,)
    generated = gclip.apply_scale((g for g in [a, b]), 0.5, inplace=inplace)
    assert type(generated) is list and len(generated) == 2


def test_apply_scale_scales_an_array_given_twice_once():
    a = np.ones(4)
    out = gclip.apply_scale([a, a, np.ones(1)], 0.5, inplace=True)
    assert out[0] is a and out[1] is a
    assert np.array_equal(a, np.full(4, 0.5))  # not 0.25
    b = np.ones(4)
    out = gclip.apply_scale((b, b), 0.5)
    assert np.array_equal(out[0], np.full(4, 0.5)) and np.array_equal(out[1], np.full(4, 0.5))
    assert np.array_equal(b, np.ones(4))


# --------------------------------------------------------------------------- global_norm


@pytest.mark.parametrize("comm", ["self", "one-rank"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_global_norm_error_if_nonfinite(self_comm, comm, value, norm_type):
    c = self_comm if comm == "self" else OneRankComm()
    x = np.array([1.0, value, 2.0])
    with pytest.raises(gclip.NonFiniteNormError) as info:
        gclip.global_norm(x, comm=c, norm_type=norm_type, error_if_nonfinite=True)
    assert "\n" not in str(info.value) and "rank 0" in str(info.value)
    plain = gclip.global_norm(x, comm=c, norm_type=norm_type)
    assert math.isnan(plain) if math.isnan(value) else plain == math.inf
    assert gclip.global_norm(np.ones(4), comm=c, norm_type=norm_type, error_if_nonfinite=True) == (
        4.0 ** (1 / norm_type) if math.isfinite(norm_type) else 1.0
    )
