"""``--layout``: the lab's transformer model over a mesh, and what each gallery bug makes of it.

Each case scales the model's gradient (``gclip._lab.transformer``) by a factor,
in float64 or float32, and sets a limit below, above or at zero; with several
pipeline stages one case freezes the last stage (its ranks hold nothing to
clip, as in a fine-tuning job: the case where a rank that skips the
collective hangs the others). The ranks build their arrays and their
``replicated=`` declaration from the mesh; the judge builds the very same
arrays on simulated ranks and runs gclip, each bug of the engine (``gclip.gallery``'s ``mode=``)
and each layout bug (a wrong declaration, a reduction over part of the mesh,
tensors left out) on them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from .._lab import transformer
from ..clip import apply_scale
from ..gallery import GLOBAL, LAYOUT_BUG_NAMES, LAYOUT_BUGS, LayoutBug, clip_simulated
from ..layout import Group, Mesh, Placement

__all__ = [
    "LayoutCase",
    "frozen_ranks",
    "layout_inputs",
    "layout_pairs",
    "make_layout_cases",
    "parse_layout",
    "simulate",
]


class LayoutCase(NamedTuple):
    label: str
    dtype: str
    factor: float  # the model's gradient times this
    max_norm: float
    frozen: bool  # the last pipeline stage holds no gradient


def parse_layout(text: str) -> dict[str, int]:
    """'pp=2,dp=2,tp=2' -> {'pp': 2, 'dp': 2, 'tp': 2}, checked by Mesh and by the model."""
    mesh = Mesh.parse((0, _size(text)), text)
    transformer.pieces(Mesh((0, mesh.size), **mesh.shape))  # the model must split evenly
    return dict(mesh.shape)


def _size(text: str) -> int:
    size = 1
    for part in text.split(","):
        value = part.partition("=")[2].strip()
        size *= int(value) if value.isdigit() and int(value) > 0 else 1
    return size


def _declared(frozen: bool, bug: LayoutBug | None) -> dict[Placement, Placement]:
    """What each kind of tensor is declared as: as it lies, untied when the last stage is
    frozen (its copy of the embedding is not trained), then as the bug declares it."""
    out = {}
    for pl in transformer.PLACEMENTS:
        base = pl._replace(tied=None) if frozen and pl.tied else pl
        out[pl] = bug.declare(base) if bug is not None else base
    return out


def frozen_ranks(shape: dict[str, int]) -> list[int]:
    size = math.prod(shape.values())
    last = shape.get("pp", 1) - 1
    return [r for r in range(size) if Mesh((r, size), **shape).coords.get("pp", 0) == last]


def layout_inputs(
    case: LayoutCase, mesh: Mesh, bug: LayoutBug | None = None
) -> tuple[list[np.ndarray], list[Any], list[transformer.Piece]]:
    """(arrays, replicated entries, pieces) of this rank; every rank must call it (Split)."""
    pieces = transformer.pieces(mesh, np.dtype(case.dtype), _declared(case.frozen, bug))
    if case.frozen and mesh.coords.get("pp", 0) == mesh.shape.get("pp", 1) - 1:
        return [], [], []
    arrays = [(p.array * case.factor).astype(case.dtype) for p in pieces]
    return arrays, [p.replicated for p in pieces], pieces


def make_layout_cases(shape: dict[str, int], count: int, seed: int) -> list[LayoutCase]:
    """The fixed cases in both dtypes, a frozen last stage (pp > 1), then ``count`` random ones."""
    norm = _model_norm(shape)
    cases = []
    for dtype in ("float64", "float32"):
        cases += [
            LayoutCase(f"layout {dtype}: clipped (limit half the norm)", dtype, 1.0, norm / 2, False),
            LayoutCase(f"layout {dtype}: unchanged (limit twice the norm)", dtype, 1.0, norm * 2, False),
            LayoutCase(f"layout {dtype}: zero limit", dtype, 1.0, 0.0, False),
        ]
    if shape.get("pp", 1) > 1:
        cases.append(
            LayoutCase("layout: the last stage is frozen (holds no gradient)", "float64", 1.0, 1.0, True)
        )
    rng = np.random.default_rng([seed, 3])
    for i in range(count):
        factor = float(f"{10 ** rng.uniform(-2, 2):.6g}")
        ratio = float(rng.choice([0.1, 0.5, 0.9, 1.5]))
        dtype = "float32" if rng.random() < 0.3 else "float64"
        limit = float(f"{norm * factor * ratio:.6g}")
        cases.append(
            LayoutCase(f"layout random #{i} ({dtype}, gradient x {factor:g})", dtype, factor, limit, False)
        )
    return cases


def _model_norm(shape: dict[str, int]) -> float:
    size = math.prod(shape.values())
    arrays, entries = _simulated_inputs(LayoutCase("", "float64", 1.0, 1.0, False), shape, None)
    return clip_simulated(arrays, 1.0, replicated=entries)[0].total_norm if size else 0.0


def _simulated_inputs(
    case: LayoutCase, shape: dict[str, int], bug: LayoutBug | None
) -> tuple[list[list[np.ndarray]], list[list[Any]]]:
    """Every simulated rank's arrays and entries for the case (the model built once per kind)."""
    arrays, entries, _ = _simulated_model(tuple(shape.items()), case.dtype, case.frozen, bug)
    return [[(a * case.factor).astype(case.dtype) for a in rank] for rank in arrays], entries


@functools.lru_cache(maxsize=64)
def _simulated_model(
    shape: tuple[tuple[str, int], ...], dtype: str, frozen: bool, bug: LayoutBug | None
) -> tuple[list[list[np.ndarray]], list[list[Any]], list[list[transformer.Piece]]]:
    axes = dict(shape)
    size = math.prod(axes.values())
    unit = LayoutCase("", dtype, 1.0, 1.0, frozen)
    built = [layout_inputs(unit, Mesh((r, size), **axes), bug) for r in range(size)]
    return [b[0] for b in built], [b[1] for b in built], [b[2] for b in built]


def _slices(shape: dict[str, int], axis: str) -> list[list[int]]:
    size = math.prod(shape.values())
    coords = [Mesh((r, size), **shape).coords[axis] for r in range(size)]
    return [[r for r in range(size) if coords[r] == v] for v in range(shape[axis])]


def _apart(
    case: LayoutCase, shape: dict[str, int], bug: LayoutBug, arrays: list, entries: list
) -> list[list[np.ndarray]]:
    """The bug as declared: each slice along ``bug.apart`` a clip of its own (gclip's engine)."""
    out: list[list[np.ndarray]] = [[] for _ in arrays]
    for members in _slices(shape, bug.apart or ""):
        where = {m: i for i, m in enumerate(members)}
        local = [[_local(e, where) for e in entries[m]] for m in members]
        results = clip_simulated([arrays[m] for m in members], case.max_norm, replicated=local)
        for m, res in zip(members, results):
            out[m] = list(res.grads)
    return out


def _apart_kept(case: LayoutCase, shape: dict[str, int], axis: str) -> list[list[np.ndarray]]:
    """The other reading: the copies declared right (each counted on its group's first rank),
    but the sum reduced within each slice along ``axis`` only."""
    arrays, entries = _simulated_inputs(case, shape, None)
    out: list[list[np.ndarray]] = [[] for _ in arrays]
    for members in _slices(shape, axis):
        total = math.fsum(
            float(np.sum(np.square(a, dtype=np.float64)))
            for m in members
            for a, e in zip(arrays[m], entries[m])
            if not isinstance(e, Group) or e.rank == 0
        )
        scale = GLOBAL.scale(math.sqrt(total), case.max_norm)
        for m in members:
            out[m] = list(apply_scale(arrays[m], scale)) if arrays[m] else []
    return out


def _local(entry: Any, where: dict[int, int]) -> Any:
    """A Group of world ranks as a Group of one slice's ranks."""
    if isinstance(entry, Group):
        return Group(tuple(where[m] for m in entry.members), entry.rank)
    return entry


def combine(first: LayoutBug, second: LayoutBug) -> LayoutBug | None:
    """The two layout bugs at once, as one (named 'first + second'), or None where they cannot
    apply together: a hang, two reductions over parts of the mesh, two splits, or a reduction
    over part of the mesh beside a split or beside tensors left out."""
    pair = (first, second)
    if any(b.skips_collective for b in pair):
        return None
    for field in ("apart", "omit", "within", "split"):
        if all(getattr(b, field) for b in pair):
            return None
    kinds = [any(b.apart for b in pair), any(b.split for b in pair), any(b.omit or b.mp_rank0 for b in pair)]
    if sum(kinds) > 1:
        return None
    if any(b.within for b in pair) and any(b.drop or b.add for b in pair if not b.within):
        return None
    return dataclasses.replace(
        first,
        name=f"{first.name} + {second.name}",
        summary=f"{first.summary}; and {second.summary}",
        incident="",
        explanation="",
        drop=tuple(dict.fromkeys(first.drop + second.drop)),
        add=tuple(dict.fromkeys(first.add + second.add)),
        untie=first.untie or second.untie,
        apart=first.apart or second.apart,
        omit=first.omit or second.omit,
        within=first.within or second.within,
        split=first.split or second.split,
        mp_rank0=first.mp_rank0 or second.mp_rank0,
    )


def layout_pairs(shape: dict[str, int]) -> list[LayoutBug]:
    """Every two layout bugs that show on this mesh and apply together, in the gallery's order."""
    axes = {a for a, n in shape.items() if n > 1}
    shown = [b for b in LAYOUT_BUGS if not b.skips_collective and b.axes() <= axes]
    both = (combine(a, b) for a, b in itertools.combinations(shown, 2))
    return [b for b in both if b is not None]


def simulate(case: LayoutCase, shape: dict[str, int], bug: str | LayoutBug | None = None) -> Any:
    """Every rank's arrays after gclip's clip, or after the gallery bug ``bug``.

    None: the bug cannot show as values (a hang). A tuple: the bug's variants,
    each a per-rank list (a reduction over part of the mesh, with the copies
    declared as the bug declares them, or as they are). ``bug`` may be a LayoutBug
    (two bugs at once: ``combine``)."""
    layout_bug = bug if isinstance(bug, LayoutBug) else LAYOUT_BUG_NAMES.get(bug or "")
    if layout_bug is not None and layout_bug.skips_collective:
        return None  # a hang, not a value: told apart by how the case never ends
    arrays, entries = _simulated_inputs(case, shape, layout_bug)
    mode = bug if isinstance(bug, str) and layout_bug is None else "global"
    size = len(arrays)
    if layout_bug is not None and layout_bug.apart in shape:
        apart = layout_bug.apart
        return (_apart(case, shape, layout_bug, arrays, entries), _apart_kept(case, shape, apart))
    if layout_bug is not None and layout_bug.split in shape:  # the experts and the rest: two clips
        pieces = _simulated_model(tuple(shape.items()), case.dtype, case.frozen, layout_bug)[2]
        out: list[list[np.ndarray]] = [list(a) for a in arrays]
        for experts in (False, True):
            part = [[i for i, p in enumerate(ps) if (layout_bug.split in p.placement.sharded) == experts]
                    for ps in pieces]  # fmt: skip
            results = clip_simulated(
                [[arrays[r][i] for i in part[r]] for r in range(size)],
                case.max_norm,
                replicated=[[entries[r][i] for i in part[r]] for r in range(size)],
            )
            for r, res in enumerate(results):
                for i, g in zip(part[r], res.grads):
                    out[r][i] = g
        return out
    if layout_bug is not None and layout_bug.omits(shape):
        pieces = _simulated_model(tuple(shape.items()), case.dtype, case.frozen, layout_bug)[2]
        coords = [Mesh((r, size), **shape).coords for r in range(size)]
        kept = [[i for i, p in enumerate(ps) if not layout_bug.left_out(p.placement, coords[r])]
                for r, ps in enumerate(pieces)]  # fmt: skip
        norm = clip_simulated(
            [[arrays[r][i] for i in kept[r]] for r in range(size)],
            case.max_norm,
            replicated=[[entries[r][i] for i in kept[r]] for r in range(size)],
        )[0].total_norm
        scale = GLOBAL.scale(norm, case.max_norm)
        return [list(apply_scale(a, scale)) if a else [] for a in arrays]
    results = clip_simulated(arrays, case.max_norm, mode=mode, replicated=entries)
    return [list(r.grads) for r in results]
