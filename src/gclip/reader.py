"""The reader: this rank's numpy arrays, as given, checked, each distinct array once.

:func:`read` is how the engine (``engine.check``) reads numpy arrays, each refusal a
one-line error that the engine raises on every rank together. It gives a :class:`Grads`,
which gives the clip's result back in the layout given (:meth:`Grads.scaled`: the factor
applied by the numpy backend, ``partials``). Nothing here talks to MPI.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _kernels, partials
from .errors import GclipTypeError, GclipValueError

__all__ = ["FLOAT_DTYPES", "Grads", "entries_of", "grads", "read", "same_memory"]

FLOAT_DTYPES = frozenset(np.dtype(t) for t in ("<f2", ">f2", "<f4", ">f4", "<f8", ">f8"))
_NATIVE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


# the gradient arrays


class Grads(NamedTuple):
    """This rank's arrays, checked: each distinct array once, and how to give back the layout.

    ``slots[i]`` is the index in ``arrays`` of the i-th array given: the same
    array given twice (tied weights) is counted once and scaled once.
    """

    arrays: list[np.ndarray]
    slots: tuple[int, ...] | None  # None: the arrays as given, no alias
    container: type | None  # None: one array was given; else list or tuple
    source: Any = None  # what was given: the array, the list or tuple (a generator: its items)

    @property
    def given(self) -> int:
        return len(self.slots) if self.slots is not None else len(self.arrays)

    def per_array(self, values: Sequence[Any], name: str) -> list[Any]:
        """One entry per given array -> one per distinct array; aliases must agree."""
        if len(values) != self.given:
            raise GclipValueError(f"{name} has {len(values)} entries for {self.given} arrays")
        if self.slots is None:
            return list(values)
        out: list[Any] = [None] * len(self.arrays)
        seen = [False] * len(self.arrays)
        for i, (slot, value) in enumerate(zip(self.slots, values)):
            if not seen[slot]:
                out[slot], seen[slot] = value, True
            elif not _same_entry(out[slot], value):
                first = self.slots.index(slot)
                raise GclipValueError(
                    f"grads[{first}] and grads[{i}] are the same array but {name} gives them "
                    f"different entries ({_entry_text(out[slot])}, {_entry_text(value)})"
                )
        return out

    def rebuild(self, outputs: Sequence[Any]) -> Any:
        """The outputs (one per distinct array) in the layout given; where a torch
        tensor was given, a tensor (on the new array's memory) comes back."""
        if self.container is None:
            return _like(self.source, outputs[0])
        items = outputs if self.slots is None else [outputs[s] for s in self.slots]
        if self.source is not None:
            items = list(map(_like, self.source, items))
        return tuple(items) if self.container is tuple else items

    def as_given(self) -> Any:
        """What was given, the very objects (a generator's items as a list)."""
        return self.source

    def scaled(self, factor: float, inplace: bool) -> Any:
        """The arrays multiplied by ``factor`` (``partials.multiply_by``), in the layout given: in
        place, the very objects given (a factor of exactly 1 touches nothing); else new arrays
        of the same dtypes, laid out as given, then filled."""
        out = self.arrays if inplace else list(map(np.empty_like, self.arrays))
        if inplace:
            result = self.source
        elif self.container is None and type(self.source) is np.ndarray:  # one plain array: its copy
            result = out[0]
        else:
            result = self.rebuild(out)
        partials.multiply_by(self.arrays, factor, out)
        return result


def _like(source: Any, out: np.ndarray) -> Any:
    """``out`` as the kind of array ``source`` was: a torch tensor for a tensor (torch
    is imported already, since a tensor was given), else the numpy array itself."""
    if _is_tensor(source):
        return sys.modules["torch"].from_numpy(out)
    return out


def _entry_text(entry: Any) -> str:
    """An entry as every rank can print it alike (never an object's address)."""
    if isinstance(entry, (bool, np.bool_, type(None))):
        return repr(bool(entry)) if entry is not None else "None"
    size = getattr(entry, "Get_size", None) or getattr(entry, "size", None)  # torch groups: size()
    if callable(size):
        return f"{type(entry).__name__} of {size()} ranks"
    return type(entry).__name__


def _same_entry(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, (bool, np.bool_)) and isinstance(b, (bool, np.bool_)) and a == b)


def read(value: Any, replicated: Any, inplace: bool) -> tuple[Grads, list[np.ndarray], Sequence[Any] | None]:
    """The engine's reader for numpy arrays: (the checked :class:`Grads`, its distinct
    arrays, their ``replicated=`` entries or None)."""
    if replicated is None and type(value) is np.ndarray and value.dtype in _NATIVE:
        if value.flags.writeable or not inplace:  # one plain array, as in grads(): a call saved
            given = Grads([value], None, None, value)
            return given, given.arrays, None
    given = grads(value, inplace)
    entries = None if replicated is None else given.per_array(entries_of(replicated, "array"), "replicated")
    return given, given.arrays, entries


def entries_of(replicated: Any, what: str) -> Sequence[Any]:
    """``replicated=`` as a sequence, or a one-line error."""
    if isinstance(replicated, (str, bytes)) or not hasattr(replicated, "__len__"):
        raise GclipTypeError(
            f"replicated must be a list with one entry per {what}, got {type(replicated).__name__}"
        )
    entries: Sequence[Any] = replicated
    return entries


def grads(value: Any, inplace: bool) -> Grads:
    """What was given as numpy arrays, checked; aliases found.

    One array (numpy, or anything numpy can view: buffer protocol,
    ``__array__``), or a list, tuple or any other iterable of them (a
    generator is read once). float16, float32 and float64 in either byte order.
    Arrays are views of what was given; only what is not an array already (a
    list of floats, say) is copied into a new one, and ``inplace`` refuses it.
    """
    if type(value) is np.ndarray and value.dtype in _NATIVE and (value.flags.writeable or not inplace):
        return Grads([value], None, None, value)  # one plain array: checked in one line
    if isinstance(value, np.ndarray) or _array_like(value):
        return Grads([_array(value, "grads", inplace)], None, None, value)
    if isinstance(value, (list, tuple)):
        items, container = value, tuple if isinstance(value, tuple) else list
    elif _is_buffer(value):  # a memoryview, an array.array: one array, not a list of its items
        return Grads([_array(value, "grads", inplace)], None, None, value)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        items, container = list(value), list  # a generator: read once
    else:
        return Grads([_array(value, "grads", inplace)], None, None, value)
    if len(items) >= _kernels.MANY:
        checked = _with_table(items, inplace, whole=True)
        if checked is not None:
            return Grads(checked, None, container, items)
    arrays = [
        g
        if type(g) is np.ndarray and g.dtype in _NATIVE and (g.flags.writeable or not inplace)
        else _array(g, f"grads[{i}]", inplace)  # the common case above, checked in one line
        for i, g in enumerate(items)
    ]
    given = _unaliased(items, arrays, container)._replace(source=items)
    checked = _with_table(given.arrays, inplace) if len(arrays) >= _kernels.MANY else None
    return given if checked is None else given._replace(arrays=checked)


def _with_table(items: Sequence[Any], inplace: bool, whole: bool = False) -> list[np.ndarray] | None:
    """The items with the compiled kernels' table read once here for the whole call (its sum, its
    digits and its in-place scale), or None where the kernels take none of them. ``whole``: read
    from the headers alone when every item is a float32/float64 ndarray, contiguous, aligned (and
    writable for inplace), and no two share memory; else None leaves it to the item-by-item checks
    (and their error messages)."""
    kernels = _kernels.get()
    table = kernels.table(items, writable=inplace) if kernels is not None else None
    if table is None or not table.compiled or (whole and (table.compiled != len(items) or table.overlaps())):
        return None
    checked = _kernels.Checked(items)
    checked.table, checked.writable = table, inplace
    return checked


def _array_like(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "__array_interface__") or _is_tensor(value)


def _is_buffer(value: Any) -> bool:
    """Whether ``value`` has the buffer protocol (``collections.abc.Buffer`` from Python 3.12)."""
    try:
        memoryview(value)
    except TypeError:
        return False
    return True


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _array(g: Any, where: str, inplace: bool) -> np.ndarray:
    if g is None:
        raise GclipTypeError(f"{where} is None: pass only the gradients that exist")
    if _is_tensor(g) and getattr(g, "requires_grad", False):
        raise GclipTypeError(
            f"{where} is a torch tensor that requires grad (a parameter?): pass its .grad, "
            "or use gclip.torch.clip_grad_norm_(parameters, ...)"
        )
    if isinstance(g, np.ma.MaskedArray):  # np.asarray would drop the mask: masked values would count
        raise GclipTypeError(f"{where} is a masked array; pass its values (.compressed() or .filled(0))")
    if inplace and isinstance(g, (list, tuple, numbers.Number)):
        raise GclipTypeError(f"{where}: inplace=True needs arrays, got {type(g).__name__}")
    try:
        a = np.asarray(g)
    except Exception as exc:  # noqa: BLE001 - any failure here is a type error of the input
        hint = "; for torch tensors use gclip.torch" if _is_tensor(g) else ""
        raise GclipTypeError(f"{where}: cannot be read as an array ({exc}){hint}") from None
    if a.dtype not in FLOAT_DTYPES:
        raise GclipTypeError(f"{where} has dtype {a.dtype}; gclip clips float16, float32 or float64 arrays")
    if inplace and not a.flags.writeable:
        raise GclipValueError(f"{where} is read-only; inplace=True needs writable arrays")
    return a


# aliases: the same memory given twice counts once; a partial overlap is an error


def _unaliased(items: Sequence[Any], arrays: list[np.ndarray], container: type) -> Grads:
    """Drop repeats of one array; refuse arrays that overlap only in part.

    Arrays that each own their memory cannot overlap one another, so the usual
    list of separately allocated gradients costs one pass over ``base``. Once
    any array is a view (of a numpy array, a memoryview, a tensor...), every
    array's memory span is compared: whatever wrapper leads to a buffer, its
    address tells.
    """
    n = len(arrays)
    first_of: dict[int, int] = {}
    same: dict[int, int] = {}  # a later duplicate -> the first of its kind
    views = False
    for i, (item, a) in enumerate(zip(items, arrays)):
        first = first_of.setdefault(id(item), i)
        if first == i and a is not item:  # two wrappers (``__array__``) may give the very same array
            first = first_of.setdefault(id(a), i)
        if first != i:
            same[i] = first
        elif a.base is not None:
            views = True
    if views:
        same.update(_overlaps(arrays, [i for i in range(n) if i not in same]))
    if not same:
        return Grads(arrays, None, container)
    unique: list[np.ndarray] = []
    slots: list[int] = []
    position: dict[int, int] = {}
    for i in range(n):
        first = same.get(i, i)
        while first in same:  # chains: c is b, b is a
            first = same[first]
        if first not in position:
            position[first] = len(unique)
            unique.append(arrays[first])
        slots.append(position[first])
    return Grads(unique, tuple(slots), container)


def _overlaps(arrays: Sequence[np.ndarray], members: Sequence[int]) -> dict[int, int]:
    """Among numpy arrays of one buffer: exact repeats -> their first; a partial overlap raises."""
    return same_memory(
        members,
        span=lambda i: _span(arrays[i]),
        same_view=lambda i, j: _same_view(arrays[i], arrays[j]),
        shares=lambda i, j: bool(np.shares_memory(arrays[i], arrays[j], max_work=10**6)),  # type: ignore[arg-type]
        overlap=lambda lo, hi: GclipValueError(
            f"grads[{lo}] and grads[{hi}] overlap in memory without being the same array: "
            "each value must be given once"
        ),
    )


def same_memory(
    members: Sequence[int],
    *,
    span: Callable[[int], tuple[int, int]],
    same_view: Callable[[int, int], bool],
    shares: Callable[[int, int], bool],
    overlap: Callable[[int, int], Exception],
) -> dict[int, int]:
    """Among arrays of one memory (numpy arrays, torch tensors): exact repeats -> their first;
    a partial overlap raises ``overlap(lo, hi)``.

    ``span(i)`` is [first byte, past the last byte) of array i; arrays whose spans meet are
    compared: the same view is a repeat, and one that ``shares`` an element otherwise is refused.
    """
    spans = sorted((span(i), i) for i in members)
    same: dict[int, int] = {}
    open_: list[tuple[tuple[int, int], int]] = []  # spans that may still overlap the next
    for here, i in spans:
        open_ = [(s, j) for s, j in open_ if s[1] > here[0]]
        for s, j in open_:
            if same_view(j, i):
                same[max(i, j)] = min(i, j)
            elif s[0] < s[1] and here[0] < here[1] and shares(j, i):
                raise overlap(*sorted((i, j)))
        open_.append((here, i))
    return same


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.__array_interface__["data"][0]
    if a.size == 0:
        return start, start
    lo = hi = start
    for n, stride in zip(a.shape, a.strides):
        step = (n - 1) * stride
        if step < 0:
            lo += step
        else:
            hi += step
    return lo, hi + a.itemsize


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
    )
