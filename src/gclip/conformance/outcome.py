"""What one rank's call gave, on the rank (read it off the return) and in the judge (decode it).

The function may return the clipped list, a tuple, any iterable of arrays,
``gclip``'s ``ClipResult``, a ``(grads, norm)`` pair, or None when it clipped
in place: all of these are the same layout, when each array keeps its shape
(nested lists as ``tolist()`` gives them count). Arrays travel to the judge as
JSON (dtype, shape, values as float64, exact for float32 and float64).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Before", "CaseRun", "RankRun", "before", "changed", "decode", "encode", "returned_arrays"]


class RankRun(NamedTuple):
    """One rank in one case, as the judge knows it."""

    kind: str  # "value", "raised", "bad" (a value that is no clip), or "lost" (the case never ended)
    value: list[np.ndarray] | None = None
    message: str | None = None  # the exception, what is wrong with the value, or the hang
    ops: tuple[str, ...] = ()  # the collectives it entered


class CaseRun(NamedTuple):
    """Every rank in one case; ``lost`` says why the case never finished (a hang, a death)."""

    ranks: list[RankRun]
    lost: str | None = None
    lost_kind: str | None = None  # hangs.Stuck.kind
    culprits: tuple[int, ...] = ()


def encode(arrays: Sequence[np.ndarray]) -> list[dict]:
    return [
        {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.astype(np.float64).ravel().tolist()}
        for a in arrays
    ]


def decode(items: Sequence[dict]) -> list[np.ndarray]:
    out = []
    for item in items:
        data = np.asarray(item["data"], dtype=np.float64)
        try:
            out.append(data.astype(np.dtype(item["dtype"])).reshape(item["shape"]))
        except (TypeError, ValueError):
            out.append(data.reshape(item["shape"]))
    return out


def _number(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0


def _iterable(value: Any) -> bool:
    return not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__")


def _as_array(item: Any) -> np.ndarray:
    if hasattr(item, "detach"):  # a torch tensor
        item = item.detach().cpu().numpy()
    return np.asarray(item)


class Before(NamedTuple):
    """An array as it was before the call: what a clip may not change."""

    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"


def before(arrays: Sequence[Any]) -> list[Before]:
    """Each array's shape, dtype (and a tensor's device), recorded before the call."""
    return [Before(tuple(a.shape), str(a.dtype), str(getattr(a, "device", "cpu"))) for a in arrays]


def changed(arrays: Sequence[Any], was: Sequence[Before], what: str = "array", of: str = "") -> str | None:
    """Why ``arrays`` (after the call) are not the arrays recorded in ``was``, or None
    (``of``: what of each item the arrays are, e.g. ".grad " of a parameter)."""
    if len(arrays) != len(was):
        return f"left {len(arrays)} {what}s in the list of the {len(was)} it was given"
    for i, (a, w) in enumerate(zip(arrays, was)):
        now = before([a])[0]
        for field in ("shape", "dtype", "device"):
            old, new = getattr(w, field), getattr(now, field)
            if old != new:
                return f"changed {what} {i}'s {of}{field} from {old} to {new} in place"
    return None


def returned_arrays(
    value: Any, given: Sequence[np.ndarray], was: Sequence[Before] | None = None
) -> tuple[list[np.ndarray] | None, str | None]:
    """The arrays a call produced, or why its return is no clip of ``given``.

    ``was``: the given arrays as they were before the call (default: as they are now). None
    means "clipped in place": the given arrays are the result, and must be as they were.
    """
    if was is None:
        was = before(given)
    if value is None:
        why = changed(given, was)
        if why is not None:
            return None, why
        return [np.array(a, copy=True) for a in given], None
    for i, (a, w) in enumerate(zip(given, was)):  # a returned clip may not reshape its input either
        if tuple(a.shape) != w.shape:
            return None, f"changed array {i}'s shape from {w.shape} to {tuple(a.shape)} in place"
    if hasattr(value, "grads") and hasattr(value, "total_norm"):  # gclip's ClipResult
        value = value.grads
    elif isinstance(value, tuple) and len(value) == 2 and _iterable(value[0]) and _number(value[1]):
        value = value[0]  # (grads, total_norm), as many clips return
    if isinstance(value, np.ndarray) or not _iterable(value):
        return None, (
            f"returned {type(value).__name__}, not a list of arrays "
            "(return the clipped list, or None after clipping in place)"
        )
    try:
        raw = list(value)
        items = [_as_array(v) for v in raw]
    except Exception as exc:  # noqa: BLE001 - whatever the return holds
        return None, f"returned something that is not arrays ({type(exc).__name__}: {exc})"
    if len(items) != len(given):
        return None, f"returned {len(items)} arrays for the {len(given)} it was given"
    for i, (got, w, item) in enumerate(zip(items, was, raw)):
        size = math.prod(w.shape)
        if got.size != size:
            return None, f"returned array {i} with {got.size} values, given {size}"
        if got.dtype.kind not in "fiu":
            return None, f"returned array {i} of dtype {got.dtype}, not numbers"
        # an optimizer needs each array in its own shape; only an empty list stands for any empty shape
        if got.shape != w.shape and not (size == 0 and isinstance(item, (list, tuple))):
            return None, f"returned array {i} of shape {got.shape} for one of shape {w.shape}"
    return [np.asarray(g).reshape(w.shape) for g, w in zip(items, was)], None
