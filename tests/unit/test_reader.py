"""gclip.reader (and the engine's scalar checks): what they accept, refuse (in one line) and return."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gclip
from gclip import GclipTypeError, GclipValueError, engine, reader


@pytest.mark.parametrize("value, want", [(1, 1.0), (2.5, 2.5), (np.float32(0.5), 0.5), (np.array(3.0), 3.0)])
def test_max_norm_takes_real_numbers_and_one_element_arrays(value, want):
    got = engine.max_norm(value)
    assert type(got) is float and got == want


def test_max_norm_of_minus_zero_is_plus_zero():
    assert math.copysign(1.0, engine.max_norm(-0.0)) == 1.0


@pytest.mark.parametrize(
    "bad, kind",
    [
        (-1.0, GclipValueError),
        (math.inf, GclipValueError),
        (math.nan, GclipValueError),
        ("1", GclipTypeError),
        (True, GclipTypeError),
        (np.ones(2), GclipTypeError),
        (10**400, GclipValueError),
    ],
)
def test_max_norm_refuses_in_one_line(bad, kind):
    with pytest.raises(kind, match="max_norm") as caught:
        engine.max_norm(bad)
    assert "\n" not in str(caught.value)


def test_scale_and_norm_type():
    assert math.copysign(1.0, engine.scale(-0.0)) == 1.0
    with pytest.raises(GclipValueError, match="scale"):
        engine.scale(-0.5)
    assert engine.norm_type("inf") == math.inf and engine.norm_type(" Infinity ") == math.inf
    assert engine.norm_type(3) == 3.0
    for bad in (0, -1, math.nan):
        with pytest.raises(GclipValueError, match="norm_type"):
            engine.norm_type(bad)
    with pytest.raises(GclipTypeError, match="norm_type"):
        engine.norm_type(None)


def test_arrays_are_viewed_and_a_list_of_floats_is_copied():
    a = np.arange(4.0)
    given = reader.grads([a[:2], a[2:]], inplace=False)  # disjoint views of one buffer
    assert all(np.shares_memory(x, a) for x in given.arrays)
    floats = [1.0, 2.0]
    one = reader.grads(floats, inplace=False)  # a list of numbers: each becomes an array
    assert [float(x) for x in one.arrays] == floats
    with pytest.raises(GclipTypeError, match="inplace=True needs arrays"):
        reader.grads(floats, inplace=True)


def test_the_same_array_twice_is_one_array_and_a_partial_overlap_is_refused():
    a = np.arange(6.0)
    given = reader.grads([a, np.ones(2), a], inplace=False)
    assert len(given.arrays) == 2 and given.slots == (0, 1, 0) and given.given == 3
    assert given.per_array(["x", "y", "x"], "names") == ["x", "y"]
    with pytest.raises(GclipValueError, match="same array"):
        given.per_array([True, False, False], "replicated")
    with pytest.raises(GclipValueError):
        reader.grads([a[:4], a[2:]], inplace=False)


@pytest.mark.parametrize("dtype", ["<f2", ">f4", "<f8", ">f8"])
def test_float_dtypes_in_either_byte_order(dtype):
    x = np.arange(3, dtype=dtype)
    assert reader.grads(x, inplace=False).arrays[0].dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    "bad, needle",
    [(np.arange(3), "dtype int"), (None, "is None"), ([np.ones(2), "x"], "grads[1]"), ({"w": 1.0}, "grads")],
)
def test_bad_grads_are_refused_by_name(bad, needle):
    with pytest.raises(GclipTypeError) as caught:
        reader.grads(bad, inplace=False)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_read_only_arrays_are_refused_in_place_only():
    a = np.ones(3)
    a.setflags(write=False)
    assert reader.grads(a, inplace=False).arrays[0] is a
    with pytest.raises(GclipValueError, match="read-only"):
        reader.grads([a], inplace=True)


def test_per_array_needs_one_entry_per_array():
    given = reader.grads([np.ones(2), np.ones(3)], inplace=False)
    with pytest.raises(GclipValueError, match="replicated has 1 entries for 2 arrays"):
        given.per_array([True], "replicated")


def test_rebuild_keeps_the_layout_given():
    a, b = np.ones(2), np.zeros(3)
    for container in (list, tuple):
        given = reader.grads(container([a, b, a]), inplace=False)
        out = given.rebuild([x * 2 for x in given.arrays])
        assert type(out) is container and len(out) == 3 and out[0] is out[2]
    assert reader.grads(a, inplace=False).rebuild([b]) is b


class _Wrapper:
    """An object numpy reads through ``__array__``: the very array it wraps, each time."""

    def __init__(self, array):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array


@pytest.mark.parametrize("n", [2, 20])  # the per-item path, and a list long enough for the kernels
def test_two_wrappers_of_one_array_are_one_array(n):
    a = np.array([3.0, 4.0])
    items = [_Wrapper(a), _Wrapper(a)] + [np.zeros(1) for _ in range(n - 2)]
    given = reader.grads(items, inplace=True)
    assert len(given.arrays) == n - 1 and given.slots[:2] == (0, 0)
    given.scaled(0.5, inplace=True)
    assert a.tolist() == [1.5, 2.0]  # scaled once, not twice
    assert gclip.clip_simulated([[_Wrapper(a), _Wrapper(a)]], 1.0)[0].total_norm == 2.5  # counted once
