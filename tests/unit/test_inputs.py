"""What the reader takes as one array: anything with the buffer protocol; and what it refuses
in one line: masked arrays (their mask would be ignored, the masked values counted).

The oracle is the values themselves (their norm from math.hypot), never gclip."""

from __future__ import annotations

import array
import math

import numpy as np
import pytest

import gclip
from gclip import GclipTypeError, GclipValueError


@pytest.fixture
def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


BUFFERS = {
    "memoryview": lambda: memoryview(np.arange(4.0)),
    "array.array-d": lambda: array.array("d", [3.0, 4.0]),
    "array.array-f": lambda: array.array("f", [3.0, 4.0, 12.0]),
    "memoryview-2d": lambda: memoryview(np.arange(6.0).reshape(2, 3)),
    "memoryview-of-bytearray": lambda: memoryview(bytearray(np.array([3.0, 4.0]).tobytes())).cast("d"),
}


@pytest.mark.parametrize("name", list(BUFFERS))
def test_a_buffer_is_one_array(self_comm, name):
    buf = BUFFERS[name]()
    values = np.asarray(buf).copy()
    result = gclip.clip_by_global_norm(buf, 1.0, comm=self_comm)
    assert math.isclose(result.total_norm, math.hypot(*values.ravel().tolist()), rel_tol=1e-15)
    assert type(result.grads) is np.ndarray, type(result.grads)
    assert result.grads.shape == values.shape and result.grads.dtype == values.dtype
    assert np.allclose(result.grads, values * result.scale, rtol=_ulps(values), atol=0)
    assert np.array_equal(np.asarray(buf), values), "without inplace the buffer is untouched"


@pytest.mark.parametrize("name", list(BUFFERS))
def test_a_writable_buffer_is_scaled_in_place(self_comm, name):
    buf = BUFFERS[name]()
    values = np.asarray(buf).copy()
    result = gclip.clip_by_global_norm(buf, 1.0, inplace=True, comm=self_comm)
    assert result.grads is buf, "in place, the very object given comes back"
    assert result.scale < 1.0
    assert np.allclose(np.asarray(buf), values * result.scale, rtol=_ulps(values), atol=0)


def _ulps(values: np.ndarray) -> float:
    """The product's rounding, with room for float32's factor rounded toward zero (numerics.md)."""
    return 2.0**-52 if values.dtype == np.float64 else 2.0**-22


def test_a_read_only_buffer_is_refused_in_place_only(self_comm):
    buf = memoryview(np.array([3.0, 4.0]).tobytes()).cast("d")  # bytes: read-only
    assert gclip.clip_by_global_norm(buf, 1.0, comm=self_comm).total_norm == 5.0
    with pytest.raises(GclipValueError, match="read-only"):
        gclip.clip_by_global_norm(buf, 1.0, inplace=True, comm=self_comm)


def test_a_buffer_of_bytes_is_refused_by_its_dtype(self_comm):
    with pytest.raises(GclipTypeError, match="dtype uint8"):
        gclip.global_norm(bytearray(b"\x01\x02"), comm=self_comm)


def test_a_large_buffer_is_read_at_array_speed(self_comm):
    """200k doubles: one array (the reader once iterated them as 200k scalars, about 1e5 times
    slower); checked by what comes back, not by a clock."""
    x = np.ones(200_000)
    result = gclip.clip_by_global_norm(memoryview(x), 1.0, inplace=True, comm=self_comm)
    assert math.isclose(result.total_norm, math.sqrt(200_000), rel_tol=1e-15)
    assert np.all(x == result.scale)


MASKED = {
    "one": lambda: np.ma.masked_array([3.0, 4.0, 100.0], mask=[0, 0, 1]),
    "nothing-masked": lambda: np.ma.masked_array([3.0, 4.0]),
    "in-a-list": lambda: [np.ones(2), np.ma.masked_array([3.0, 4.0, 100.0], mask=[0, 0, 1])],
}


@pytest.mark.parametrize("name", list(MASKED))
@pytest.mark.parametrize("call", ["global_norm", "clip", "apply_scale"])
def test_a_masked_array_is_refused_in_one_line(self_comm, name, call):
    grads = MASKED[name]()
    run = {
        "global_norm": lambda: gclip.global_norm(grads, comm=self_comm),
        "clip": lambda: gclip.clip_by_global_norm(grads, 1.0, comm=self_comm),
        "apply_scale": lambda: gclip.apply_scale(grads, 0.5),
    }[call]
    with pytest.raises(GclipTypeError, match="masked") as raised:
        run()
    assert "\n" not in str(raised.value)


def test_many_arrays_with_a_masked_one_are_refused(self_comm):
    """Past the reader's many-arrays fast path (a table read at once), a masked array too."""
    grads = [np.ones(8, np.float32) for _ in range(300)]
    grads[150] = np.ma.masked_array(np.ones(8, np.float32), mask=[1] + [0] * 7)
    with pytest.raises(GclipTypeError, match=r"grads\[150\].*masked"):
        gclip.clip_by_global_norm(grads, 1.0, inplace=True, comm=self_comm)
