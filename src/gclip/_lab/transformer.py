"""A small transformer-like model laid out over pp x dp x tp x ep ranks.

The lab's model for parallel layouts (the demo's ``--layout``, the trainer,
the tests). Its parameters are what real layouts shard and copy:

- ``embed`` (V x H): the input embedding, tied to the output head. Vocab-
  parallel (rows sharded over tp). With one pipeline stage it is ONE array
  used twice (the demo passes it twice, as tied weights are); with several it
  lives on the first and the last stage: a group tied across stages.
- per layer: ``ln1``/``ln2`` (H) duplicated on every tp rank; attention
  ``qkv`` (3H x H, rows over tp) and ``proj`` (H x 3H, columns over tp);
  a dense MLP ``fc1``/``fc2``, or, with an ``ep`` axis, a ``router`` (E x H,
  duplicated) and E experts spread over the ep ranks (each sharded over tp).
- ``final_ln`` (H) on the last stage, duplicated over tp.

Layers are split evenly over the pp stages. Every rank of a dp (and, for the
dense part, ep) group holds the same copies. Each tensor's values depend only
on its name and element index (and the :class:`Model` setting), so the model's
gradient is the same for every layout of the world: its norm is a property of
the model, not of the layout.

:class:`Model` picks the values: ``seed`` (0: the lab's model; any other: values
of its own, for a student's layout mystery) and ``proportions``. ``"lab"``
leaves every value N(0, SCALE); ``"incidents"`` rescales each kind of tensor so
that the tied embedding holds half of the norm**2 and the tp-duplicated norms
16%, the proportions of the incidents the gallery cites, where counting a
tensor twice moved the norm by 1.2x to 1.5x (see :data:`SHARES`).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import GclipValueError
from ..layout import Mesh, Placement

__all__ = [
    "LAB",
    "LAYERS",
    "PLACEMENTS",
    "PROPORTIONS",
    "SHARES",
    "Model",
    "Piece",
    "clip_arguments",
    "full_tensor",
    "kind_of",
    "model_shapes",
    "pieces",
]

# sizes divisible by 1, 2, 3, 4 (and tp = 6, 8): any small world has layouts on every axis
HIDDEN = 24
FFN = 48
VOCAB = 48
LAYERS = 12  # split evenly over pp = 1, 2, 3, 4, 6 stages
EXPERTS = 12  # spread evenly over ep = 1, 2, 3, 4, 6 ranks
SCALE = 2.0  # N(0, SCALE) values: large enough that a rank's float16 sum of squares overflows


class Model(NamedTuple):
    """Which values the model's tensors hold (their shapes are the same for every setting)."""

    proportions: str = "lab"  # one of PROPORTIONS
    seed: int = 0


LAB = Model()
# the share of the model's norm**2 each kind of tensor holds under "incidents" (the rest: "other").
# Counting a share s twice multiplies the norm by sqrt(1 + s): the tied embedding's 0.5 gives 1.22x
# on any pipeline (Megatron-LM PR #7227 reported 1.41x, the weight counted twice being the whole
# norm there); tp copies of a share d give sqrt(1 + (tp - 1) d): 1.08x at tp = 2, 1.22x at tp = 4,
# 1.46x at tp = 8 (ROCm TransformerEngine PR #715: 1.36-1.52x at TP=8).
SHARES = {"embedding": 0.5, "tp-duplicate": 0.16}
PROPORTIONS = ("lab", "incidents")


class Piece(NamedTuple):
    """One array on one rank: which tensor, which part of it, and who holds copies."""

    name: str  # the tensor's name in the model
    part: tuple[int, int, int]  # (axis, index, count): the shard of the tensor along axis (count 1: whole)
    array: np.ndarray
    replicated: Any  # the entry for replicated=: False, or the group holding identical copies
    kind: str  # what it is in the layout: "tp-shard", "tp-duplicate", "tied embedding", "expert", ...
    placement: Placement


# where each kind of tensor lies (axes the mesh lacks are ignored)
EMBEDDING = Placement(replicated=("dp", "ep"), sharded=("tp",), tied="pp")
TP_SHARD = Placement(replicated=("dp", "ep"), sharded=("tp",))
TP_DUPLICATE = Placement(replicated=("dp", "ep", "tp"))
EXPERT = Placement(replicated=("dp",), sharded=("ep", "tp"))
PLACEMENTS = (EMBEDDING, TP_SHARD, TP_DUPLICATE, EXPERT)


def model_shapes(ep: bool) -> dict[str, tuple[int, ...]]:
    """The whole model, name -> shape (the same for every layout but for ep's experts)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        shapes[p + "ln1"] = (HIDDEN,)
        shapes[p + "attn.qkv"] = (3 * HIDDEN, HIDDEN)
        shapes[p + "attn.proj"] = (HIDDEN, 3 * HIDDEN)
        shapes[p + "ln2"] = (HIDDEN,)
        if ep:
            shapes[p + "mlp.router"] = (EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                shapes[p + f"mlp.experts.{e}.fc1"] = (FFN, HIDDEN)
                shapes[p + f"mlp.experts.{e}.fc2"] = (HIDDEN, FFN)
        else:
            shapes[p + "mlp.fc1"] = (FFN, HIDDEN)
            shapes[p + "mlp.fc2"] = (HIDDEN, FFN)
    shapes["final_ln"] = (HIDDEN,)
    return shapes


def kind_of(name: str) -> str:
    """The kind of a tensor for the model's proportions: "embedding", "tp-duplicate" or "other"."""
    if name == "embed":
        return "embedding"
    if name.endswith(("ln1", "ln2", "final_ln", "mlp.router")):
        return "tp-duplicate"
    return "other"


def _draw(name: str, size: int, seed: int) -> np.ndarray:
    key = [zlib.crc32(name.encode()), 7] if seed == 0 else [zlib.crc32(name.encode()), 7, seed]
    return np.random.default_rng(key).standard_normal(size) * SCALE


@functools.lru_cache(maxsize=16)
def _kind_factors(model: Model, ep: bool) -> dict[str, float]:
    """Per kind, the factor that gives it its share of the norm**2 (all 1 for "lab")."""
    if model.proportions not in PROPORTIONS:
        raise GclipValueError(f"unknown model proportions {model.proportions!r}; choose from {PROPORTIONS}")
    if model.proportions == "lab":
        return {"embedding": 1.0, "tp-duplicate": 1.0, "other": 1.0}
    sums: dict[str, float] = {"embedding": 0.0, "tp-duplicate": 0.0, "other": 0.0}
    for name, shape in model_shapes(ep).items():
        sums[kind_of(name)] += math.fsum(_draw(name, math.prod(shape), model.seed) ** 2)
    total = math.fsum(sums.values())  # the lab's total: the values stay of the lab's size
    shares = {**SHARES, "other": 1.0 - math.fsum(SHARES.values())}
    return {kind: math.sqrt(shares[kind] * total / s) for kind, s in sums.items()}


def full_tensor(
    name: str, shape: Sequence[int], dtype: Any = np.float64, model: Model = LAB, ep: bool = False
) -> np.ndarray:
    """The tensor's values: a function of its name, element index and the model setting only
    (``ep``: the model with experts, whose proportions are its own)."""
    values = _draw(name, math.prod(shape), model.seed)
    factor = _kind_factors(model, ep)
    if factor[kind_of(name)] != 1.0:
        values = values * factor[kind_of(name)]
    return values.reshape(shape).astype(dtype)


def _shard(full: np.ndarray, axis: int, index: int, count: int) -> np.ndarray:
    return np.ascontiguousarray(np.split(full, count, axis=axis)[index])


def pieces(mesh: Mesh, dtype: Any = np.float64, placements: Any = None, model: Model = LAB) -> list[Piece]:
    """This rank's arrays of the model under ``mesh`` (axes among pp, dp, tp, ep).

    ``placements`` maps each of PLACEMENTS to the one declared (a gallery bug
    declares some wrongly); by default each is declared as it lies. Every rank
    must call this (it makes the mesh's groups: a collective, in one order).
    """
    pp, tp, ep = (mesh.shape.get(a, 1) for a in ("pp", "tp", "ep"))
    stage, t, e_rank = (mesh.coords.get(a, 0) for a in ("pp", "tp", "ep"))
    if LAYERS % pp or EXPERTS % ep or HIDDEN % tp or VOCAB % tp or FFN % tp:
        raise GclipValueError(
            f"the lab's model has {LAYERS} layers, {EXPERTS} experts and widths {HIDDEN}, {FFN}, "
            f"{VOCAB}: {mesh!r} does not split them evenly (pp must divide {LAYERS}, ep {EXPERTS}, "
            f"tp {math.gcd(HIDDEN, FFN, VOCAB)})"
        )
    declared = dict(zip(PLACEMENTS, PLACEMENTS)) if placements is None else placements
    entries = {pl: mesh.entry(declared[pl]) for pl in PLACEMENTS}  # every rank, this order
    shapes = model_shapes("ep" in mesh.shape)
    per_stage = LAYERS // pp
    mine: list[Piece] = []

    def add(name: str, axis: int, placement: Placement, kind: str, count: int = tp, index: int = t) -> None:
        full = full_tensor(name, shapes[name], dtype, model, "ep" in mesh.shape)
        array = _shard(full, axis, index, count) if count > 1 else full
        mine.append(Piece(name, (axis, index, count), array, entries[placement], kind, declared[placement]))

    if stage == 0 or stage == pp - 1:
        add("embed", 0, EMBEDDING, "tied embedding" if pp > 1 else "embedding (tied to the head)")
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        p = f"layers.{layer}."
        add(p + "ln1", 0, TP_DUPLICATE, "tp-duplicate", count=1, index=0)
        add(p + "attn.qkv", 0, TP_SHARD, "tp-shard")
        add(p + "attn.proj", 1, TP_SHARD, "tp-shard")
        add(p + "ln2", 0, TP_DUPLICATE, "tp-duplicate", count=1, index=0)
        if "ep" in mesh.shape:
            add(p + "mlp.router", 0, TP_DUPLICATE, "tp-duplicate", count=1, index=0)
            for e in range(e_rank * (EXPERTS // ep), (e_rank + 1) * (EXPERTS // ep)):
                add(p + f"mlp.experts.{e}.fc1", 0, EXPERT, "expert")
                add(p + f"mlp.experts.{e}.fc2", 1, EXPERT, "expert")
        else:
            add(p + "mlp.fc1", 0, TP_SHARD, "tp-shard")
            add(p + "mlp.fc2", 1, TP_SHARD, "tp-shard")
    if stage == pp - 1:
        add("final_ln", 0, TP_DUPLICATE, "tp-duplicate", count=1, index=0)
    return mine


def clip_arguments(
    mesh: Mesh, dtype: Any = np.float64, placements: Any = None, model: Model = LAB
) -> tuple[list[np.ndarray], list[Any], list[str], list[Piece]]:
    """(arrays, replicated, names, pieces) as a training step passes them to the clip.

    With one pipeline stage the tied embedding is used twice (input and
    output), and passed twice: the very same array, counted and scaled once.
    """
    mine = pieces(mesh, dtype, placements, model)
    arrays = [p.array for p in mine]
    entries = [p.replicated for p in mine]
    names = [p.name for p in mine]
    if mesh.shape.get("pp", 1) == 1:
        head = next(p for p in mine if p.name == "embed")
        arrays.append(head.array)
        entries.append(head.replicated)
        names.append("head (= embed)")
    return arrays, entries, names, mine
