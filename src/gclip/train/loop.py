"""Training with sharded parameters: each rank keeps its slice, gathers the rest, clips globally."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._lab.vectors import cosine, vector_norm
from ..clip import clip_by_global_norm
from .model import Model, init_params, loss_and_grad, make_data, shard_bounds

__all__ = ["Config", "Run", "departs_at", "digest", "train"]


class Run(NamedTuple):
    """One training run, as rank 0 saw it.

    Under a correct clip every rank sees the same numbers. Under a per-rank bug
    the ranks scale the replicated bias differently, so its copies drift apart,
    as they would in a real job; rank 0's view is reported.
    """

    mode: str
    losses: list[float]  # loss before each step's update
    final_loss: float  # loss after the last update
    grad_norms: list[float]  # the norm the clip used (rank 0's, for per-rank bugs)
    update_norms: list[float]  # the true global norm of the (clipped) gradient applied
    cosines: list[float | None]  # cos(applied update, raw gradient): 1 = direction kept; None: undefined
    clipped: list[bool]  # True when any rank scaled its gradient down

    @property
    def clipped_steps(self) -> int:
        return sum(self.clipped)


class Config(NamedTuple):
    steps: int
    seed: int
    lr: float
    max_norm: float
    reproducible: bool
    norm_type: float
    layout: str | None = None  # e.g. "pp=2,dp=2,tp=2"; None: flat slices, one per rank


def train(config: Config, mode: str, comm: Any) -> Run:
    """Train from the seeded start with clipping ``mode``; collective over ``comm``."""
    from mpi4py import MPI

    model = Model()
    x, y = make_data(config.seed)
    flat, b2 = init_params(config.seed, model)
    counts, displs = shard_bounds(model.flat_size, comm.Get_size())
    lo = displs[comm.Get_rank()]
    mine = flat[lo : lo + counts[comm.Get_rank()]].copy()  # this rank's slice: all it keeps
    gathered, applied = np.empty(model.flat_size), np.empty(model.flat_size)
    losses, norms, updates, cosines, clipped = [], [], [], [], []
    flag = np.zeros(1, dtype=np.int32)
    for _ in range(config.steps):
        comm.Allgatherv(mine, [gathered, counts, displs, MPI.DOUBLE])
        loss, grad, raw_b2 = loss_and_grad(gathered, b2, x, y, model)
        shard, gb2 = grad[lo : lo + mine.size].copy(), raw_b2.copy()
        result = clip_by_global_norm(
            [shard, gb2],
            config.max_norm,
            comm=comm,
            mode=mode,
            norm_type=config.norm_type,
            reproducible=config.reproducible,
            replicated=[False, True],
            inplace=True,
        )
        any_clipped = np.zeros(1, dtype=np.int32)
        flag[0] = result.clipped
        comm.Allreduce(flag, any_clipped, op=MPI.MAX)
        # diagnostics only: the whole update as applied, gathered (a copy, so the same on every rank)
        comm.Allgatherv(shard, [applied, counts, displs, MPI.DOUBLE])
        update, raw = np.concatenate([applied, gb2]), np.concatenate([grad, raw_b2])
        mine -= config.lr * shard
        b2 = b2 - config.lr * gb2
        losses.append(loss)
        norms.append(result.total_norm)
        updates.append(vector_norm(update, config.norm_type))
        cosines.append(cosine(update, raw))
        clipped.append(bool(any_clipped[0]))
    comm.Allgatherv(mine, [gathered, counts, displs, MPI.DOUBLE])
    final = loss_and_grad(gathered, b2, x, y, model)[0]
    return Run(mode, losses, final, norms, updates, cosines, clipped)


def departs_at(a: Sequence[float], b: Sequence[float]) -> int | None:
    """The first step where two loss trajectories differ, or None."""
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)


def digest(losses: Sequence[float]) -> str:
    """A short hash of the trajectory's exact bits: equal digests, equal runs."""
    return hashlib.sha256(np.asarray(losses, dtype=np.float64).tobytes()).hexdigest()[:16]
