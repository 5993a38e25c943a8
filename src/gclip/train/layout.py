"""``--layout pp=2,dp=2,tp=2``: the trainer's MLP laid out as a model parallel job would.

Each rank keeps its pieces of the parameters and updates only those:

- pipeline (pp = 1 or 2): layer 1 (W1, b1) on stage 0, layer 2 (W2, b2) on the last stage;
- tensor parallel (tp): the hidden units split over tp (W1's columns, b1, W2's
  rows: Megatron's column- then row-parallel pair), the output bias b2 whole on
  every tp rank;
- data parallel (dp): identical replicas.

Every step the ranks put the parameters back together (a copy), compute the
full-batch loss and gradient (the same on every rank), and each clips the
gradient of its own pieces with ``replicated=`` saying which are copies: every
element counts once. So the update does not depend on the layout: with
``--reproducible`` the losses have the same bits for every layout of a world,
and the same as the trainer without ``--layout``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..errors import GclipValueError
from ..gallery import clip_by_global_norm, clip_simulated
from ..layout import Mesh, Placement
from .loop import Config, Recorder, Run
from .model import Model, init_params, loss_and_grad, make_data

__all__ = ["Piece", "pieces", "train_layout", "train_layout_simulated"]

SHARD = Placement(replicated=("dp",), sharded=("tp",))
DUPLICATE = Placement(replicated=("dp", "tp"))


class Piece(NamedTuple):
    name: str  # "W1", "b1", "W2" or "b2"
    cut: tuple[slice, ...]  # where it sits in the whole tensor
    replicated: Any  # the entry for replicated=


def pieces(mesh: Mesh, model: Model) -> list[Piece]:
    """This rank's pieces (every rank calls it: it makes the mesh's groups)."""
    if "ep" in mesh.shape:
        raise GclipValueError("the trainer's model has no experts: lay it out over pp, dp and tp")
    pp, tp = mesh.shape.get("pp", 1), mesh.shape.get("tp", 1)
    if pp > 2 or model.hidden % tp:
        raise GclipValueError(
            f"the trainer's MLP has 2 layers and {model.hidden} hidden units: pp must be 1 or 2, "
            f"and tp must divide {model.hidden}"
        )
    shard, duplicate = mesh.entry(SHARD), mesh.entry(DUPLICATE)  # every rank, this order
    stage, t = mesh.coords.get("pp", 0), mesh.coords.get("tp", 0)
    width = model.hidden // tp
    cols = slice(t * width, (t + 1) * width)
    mine = []
    if stage == 0:
        mine += [Piece("W1", (slice(None), cols), shard), Piece("b1", (cols,), shard)]
    if stage == pp - 1:
        mine += [Piece("W2", (cols, slice(None)), shard), Piece("b2", (slice(None),), duplicate)]
    return mine


def _whole(flat: np.ndarray, b2: np.ndarray, model: Model) -> dict[str, np.ndarray]:
    w1, b1, w2 = model.unpack(flat)
    return {"W1": w1, "b1": b1, "W2": w2, "b2": b2}


def train_layout(config: Config, mode: str, mesh: Mesh) -> Run:
    """Train from the seeded start, each rank updating its own pieces."""
    comm = mesh.comm

    def clip(grads: list[list[np.ndarray]], entries: list[list[Any]]) -> list[Any]:
        return [
            clip_by_global_norm(
                grads[0], config.max_norm, comm=comm, replicated=entries[0], **_settings(config, mode)
            )
        ]

    return _train(config, mode, [mesh], lambda mine: comm.allgather(mine[0]), clip)


def train_layout_simulated(config: Config, mode: str, shape: dict[str, int]) -> Run:
    """:func:`train_layout` on the simulated ranks of a mesh of ``shape``, in this one process
    (``--ranks R --layout``): the same engine and arguments, so the same bits as on real ranks."""
    size = math.prod(shape.values())
    meshes = [Mesh((r, size), **shape) for r in range(size)]

    def clip(grads: list[list[np.ndarray]], entries: list[list[Any]]) -> list[Any]:
        return clip_simulated(grads, config.max_norm, replicated=entries, **_settings(config, mode))

    return _train(config, mode, meshes, lambda mine: mine, clip)


def _settings(config: Config, mode: str) -> dict[str, Any]:
    return dict(mode=mode, norm_type=config.norm_type, reproducible=config.reproducible, inplace=True)


def _train(
    config: Config, mode: str, meshes: list[Mesh], everyone: Callable[[list], list], clip: Callable
) -> Run:
    """The training loop over the ranks this process runs (one real rank, or every simulated
    one): ``everyone`` turns what they hold into what every rank of the job holds."""
    model = Model()
    x, y = make_data(config.seed)
    start = _whole(*init_params(config.seed, model), model)
    mine = [pieces(mesh, model) for mesh in meshes]
    params = [[start[p.name][p.cut].copy() for p in held] for held in mine]  # all each rank keeps
    entries = [[p.replicated for p in held] for held in mine]
    record = Recorder(mode, meshes[0].size, config.norm_type)
    for _ in range(config.steps):
        flat, b2 = _assemble(everyone(_labelled(mine, params)), model)
        loss, grad, gb2 = loss_and_grad(flat, b2, x, y, model)
        raw = _whole(grad, gb2, model)
        grads = [[raw[p.name][p.cut].copy() for p in held] for held in mine]
        results = clip(grads, entries)
        applied_flat, applied_b2 = _assemble(everyone(_labelled(mine, grads)), model)  # the whole update
        update = np.concatenate([applied_flat, applied_b2])
        for kept, applied in zip(params, grads):
            for param, g in zip(kept, applied):
                param -= config.lr * g
        told = everyone([(result.total_norm, result.clipped) for result in results])
        record.step(loss, told, update, np.concatenate([grad, gb2]))
    flat, b2 = _assemble(everyone(_labelled(mine, params)), model)
    return record.run(loss_and_grad(flat, b2, x, y, model)[0])


def _labelled(
    mine: list[list[Piece]], arrays: list[list[np.ndarray]]
) -> list[list[tuple[str, tuple, np.ndarray]]]:
    """Each rank's arrays with their piece's name and place, as :func:`_assemble` reads them."""
    return [[(p.name, p.cut, a) for p, a in zip(held, given)] for held, given in zip(mine, arrays)]


def _assemble(
    everyone: list[list[tuple[str, tuple, np.ndarray]]], model: Model
) -> tuple[np.ndarray, np.ndarray]:
    """The whole (flat W1|b1|W2, b2) from every rank's pieces, in rank order: copies, no arithmetic.

    Each piece is taken from the lowest rank that holds it (the rank that counts it).
    """
    whole = {"W1": np.empty((model.inputs, model.hidden)), "b1": np.empty(model.hidden)}
    whole.update({"W2": np.empty((model.hidden, model.classes)), "b2": np.empty(model.classes)})
    filled: set[tuple] = set()
    for held in everyone:
        for name, cut, array in held:
            key = (name, repr(cut))
            if key not in filled:
                whole[name][cut] = array
                filled.add(key)
    flat = np.concatenate([whole["W1"].ravel(), whole["b1"], whole["W2"].ravel()])
    return flat, whole["b2"]
