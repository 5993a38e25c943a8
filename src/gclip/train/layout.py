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

from typing import Any, NamedTuple

import numpy as np

from ..errors import GclipValueError
from ..gallery import clip_by_global_norm
from ..layout import Mesh, Placement
from .loop import Config, Recorder, Run
from .model import Model, init_params, loss_and_grad, make_data

__all__ = ["Piece", "pieces", "train_layout"]

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
    model = Model()
    x, y = make_data(config.seed)
    start = _whole(*init_params(config.seed, model), model)
    mine = pieces(mesh, model)
    params = [start[p.name][p.cut].copy() for p in mine]  # all this rank keeps
    entries = [p.replicated for p in mine]
    record = Recorder(mode, comm.Get_size(), config.norm_type)
    for _ in range(config.steps):
        flat, b2 = _assemble(comm, mine, params, model)
        loss, grad, gb2 = loss_and_grad(flat, b2, x, y, model)
        raw = _whole(grad, gb2, model)
        grads = [raw[p.name][p.cut].copy() for p in mine]
        result = clip_by_global_norm(
            grads,
            config.max_norm,
            comm=comm,
            mode=mode,
            norm_type=config.norm_type,
            reproducible=config.reproducible,
            replicated=entries,
            inplace=True,
        )
        applied_flat, applied_b2 = _assemble(comm, mine, grads, model)  # diagnostics: the whole update
        update = np.concatenate([applied_flat, applied_b2])
        for param, g in zip(params, grads):
            param -= config.lr * g
        told = comm.allgather((result.total_norm, result.clipped))
        record.step(loss, told, update, np.concatenate([grad, gb2]))
    flat, b2 = _assemble(comm, mine, params, model)
    return record.run(loss_and_grad(flat, b2, x, y, model)[0])


def _assemble(
    comm: Any, mine: list[Piece], arrays: list[np.ndarray], model: Model
) -> tuple[np.ndarray, np.ndarray]:
    """The whole (flat W1|b1|W2, b2) from every rank's pieces: copies, no arithmetic.

    Each piece is taken from the lowest rank that holds it (the rank that counts it).
    """
    whole = {"W1": np.empty((model.inputs, model.hidden)), "b1": np.empty(model.hidden)}
    whole.update({"W2": np.empty((model.hidden, model.classes)), "b2": np.empty(model.classes)})
    filled: set[tuple] = set()
    for held in comm.allgather([(p.name, p.cut, a) for p, a in zip(mine, arrays)]):
        for name, cut, array in held:
            key = (name, repr(cut))
            if key not in filled:
                whole[name][cut] = array
                filled.add(key)
    flat = np.concatenate([whole["W1"].ravel(), whole["b1"], whole["W2"].ravel()])
    return flat, whole["b2"]
