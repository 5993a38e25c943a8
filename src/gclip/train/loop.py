"""Training with sharded parameters: each rank keeps its slice, gathers the rest, clips globally."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._lab.vectors import cosine, vector_norm
from ..clip import clip_scale, global_norm
from ..engine import NO_LIMIT
from ..gallery import clip_by_global_norm, clip_simulated
from ..limits import AGC, AutoClip, ZClip
from .model import Model, init_params, loss_and_grad, make_data, shard_bounds

__all__ = ["CLIPS", "SPIKE", "Config", "Recorder", "Run", "departs_at", "digest", "train", "train_simulated"]

CLIPS = ("fixed", "zclip", "autoclip", "agc")
SPIKE = 50.0  # --spike: the factor a bad batch multiplies that step's gradient by
AGC_CLIPPING = (
    0.05  # AGC's ratio of a unit's gradient norm to its weight norm: 5% of the weights a step at lr 1
)


class Run(NamedTuple):
    """One training run, as rank 0 saw it.

    Under a correct clip every rank sees the same numbers. Under a per-rank bug
    each rank clips by a norm of its own, and the ranks scale the replicated
    bias differently, so its copies drift apart, as they would in a real job;
    the loss is rank 0's view.
    """

    mode: str
    losses: list[float]  # loss before each step's update
    final_loss: float  # loss after the last update
    norms_used: list[list[float]]  # per step, the norm each rank's clip used (rank order)
    true_norms: list[float]  # per step, the global norm of the gradient the ranks clipped (bias once)
    update_norms: list[float]  # the true global norm of the (clipped) gradient applied
    cosines: list[float | None]  # cos(applied update, raw gradient): 1 = direction kept; None: undefined
    ranks_scaled: list[int]  # per step, how many ranks scaled their part down (scale < 1)
    ranks: int
    limits: tuple[float, ...] = ()  # per step, the limit the clip used (--clip; NaN: unit-wise AGC)

    @property
    def clipped(self) -> list[bool]:
        """Per step: at least one rank scaled its part of the update down."""
        return [k > 0 for k in self.ranks_scaled]

    @property
    def steps_any_rank_scaled_down(self) -> int:
        """Steps on which at least one rank scaled its part down."""
        return sum(self.clipped)

    @property
    def scaled_everywhere_steps(self) -> int:
        """Steps on which every rank scaled its part down."""
        return sum(k == self.ranks for k in self.ranks_scaled)

    @property
    def norms_used_rank0(self) -> list[float]:
        return [n[0] for n in self.norms_used]

    @property
    def same_norm_on_all_ranks(self) -> bool:
        """Every rank clipped by the same norm on every step (the correct clip, most bugs)."""
        return all(len(set(n)) == 1 for n in self.norms_used)

    def steps_above(self, max_norm: float) -> int:
        """Steps whose applied update is longer than ``max_norm`` (beyond rounding)."""
        return sum(u > max_norm * (1 + 1e-9) for u in self.update_norms)


class Config(NamedTuple):
    steps: int
    seed: int
    lr: float
    max_norm: float
    reproducible: bool
    norm_type: float
    layout: str | None = None  # e.g. "pp=2,dp=2,tp=2"; None: flat slices, one per rank
    simulated: bool = False  # the ranks were simulated in one process (--ranks)
    fused: bool = False  # the scale folded into the update (global_norm + clip_scale): --fused
    clip: str = "fixed"  # --clip: the fixed max_norm, or zclip, autoclip, agc (gclip.limits)
    spike: int | None = None  # --spike: this step's gradient times SPIKE (a bad batch)


class Recorder:
    """What a training loop reports, one step at a time (shared by every trainer)."""

    def __init__(self, mode: str, ranks: int, norm_type: float) -> None:
        self.mode, self.ranks, self.p = mode, ranks, norm_type
        self.losses: list[float] = []
        self.norms: list[list[float]] = []
        self.true: list[float] = []
        self.updates: list[float] = []
        self.cosines: list[float | None] = []
        self.scaled: list[int] = []
        self.limits: list[float] = []

    def step(
        self, loss: float, told: Sequence[tuple[float, bool]], update: np.ndarray, raw: np.ndarray
    ) -> None:
        """``told``: (the norm used, scaled down?) of each rank; ``update``, ``raw``: the whole
        gradient applied and the whole gradient the ranks clipped."""
        self.losses.append(loss)
        self.norms.append([float(n) for n, _ in told])
        self.scaled.append(sum(bool(c) for _, c in told))
        self.true.append(vector_norm(raw, self.p))
        self.updates.append(vector_norm(update, self.p))
        self.cosines.append(cosine(update, raw))

    @property
    def step_count(self) -> int:
        """The steps recorded so far: the index of the step being taken."""
        return len(self.losses)

    def run(self, final_loss: float) -> Run:
        return Run(
            self.mode,
            self.losses,
            final_loss,
            self.norms,
            self.true,
            self.updates,
            self.cosines,
            self.scaled,
            self.ranks,
            tuple(self.limits),
        )


def train(config: Config, mode: str, comm: Any) -> Run:
    """Train from the seeded start with clipping ``mode``; collective over ``comm``."""
    from mpi4py import MPI

    model = Model()
    x, y = make_data(config.seed)
    flat, b2 = init_params(config.seed, model)
    counts, displs = shard_bounds(model.flat_size, comm.Get_size())
    lo = displs[comm.Get_rank()]
    mine = flat[lo : lo + counts[comm.Get_rank()]].copy()  # this rank's slice: all it keeps
    gathered, applied, clipped_in = (np.empty(model.flat_size) for _ in range(3))
    record = Recorder(mode, comm.Get_size(), config.norm_type)
    clipper = make_clipper(config)
    for _ in range(config.steps):
        comm.Allgatherv(mine, [gathered, counts, displs, MPI.DOUBLE])
        loss, grad, raw_b2 = loss_and_grad(gathered, b2, x, y, model)
        if record.step_count == config.spike:
            grad, raw_b2 = grad * SPIKE, raw_b2 * SPIKE
        raw_shard = grad[lo : lo + mine.size].copy()
        if clipper is not None:
            if config.clip == "agc":  # every rank holds the full gradient here: its units are whole
                flat_g, gb2 = agc_full(clipper, gathered, b2, grad, raw_b2, model)
                shard, limit = flat_g[lo : lo + mine.size].copy(), math.nan
                norm = global_norm([raw_shard, raw_b2], comm=comm, replicated=[False, True])
                clipped = not np.array_equal(flat_g, grad) or not np.array_equal(gb2, raw_b2)
            else:
                shard, gb2 = raw_shard.copy(), raw_b2.copy()
                out = clipper.step(
                    [shard, gb2],
                    comm=comm,
                    norm_type=config.norm_type,
                    reproducible=config.reproducible,
                    replicated=[False, True],
                    inplace=True,
                )
                norm, limit, clipped = out.total_norm, out.limit, out.clipped
            told = comm.allgather((norm, clipped))
            comm.Allgatherv(shard, [applied, counts, displs, MPI.DOUBLE])
            comm.Allgatherv(raw_shard, [clipped_in, counts, displs, MPI.DOUBLE])
            mine -= config.lr * shard
            b2 = b2 - config.lr * gb2
            record.limits.append(limit)
            record.step(loss, told, np.concatenate([applied, gb2]), np.concatenate([clipped_in, raw_b2]))
            continue
        if config.fused:  # the norm (one read), then the update applies the scale in its own pass
            norm = global_norm(
                [raw_shard, raw_b2],
                comm=comm,
                norm_type=config.norm_type,
                reproducible=config.reproducible,
                replicated=[False, True],
            )
            scale = clip_scale(norm, config.max_norm)
            mine -= (config.lr * scale) * raw_shard
            b2 = b2 - (config.lr * scale) * raw_b2
            # diagnostics only, as below: the update as applied is scale * gradient
            told = comm.allgather((norm, scale < 1.0))
            comm.Allgatherv(raw_shard, [clipped_in, counts, displs, MPI.DOUBLE])
            record.step(
                loss, told, scale * np.concatenate([clipped_in, raw_b2]), np.concatenate([clipped_in, raw_b2])
            )
            continue
        shard, gb2 = raw_shard.copy(), raw_b2.copy()
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
        # diagnostics only: what each rank used, the whole update as applied and the whole
        # gradient as clipped, gathered (copies, so the same on every rank)
        told = comm.allgather((result.total_norm, result.clipped))
        comm.Allgatherv(shard, [applied, counts, displs, MPI.DOUBLE])
        comm.Allgatherv(raw_shard, [clipped_in, counts, displs, MPI.DOUBLE])
        mine -= config.lr * shard
        b2 = b2 - config.lr * gb2
        record.step(loss, told, np.concatenate([applied, gb2]), np.concatenate([clipped_in, raw_b2]))
    comm.Allgatherv(mine, [gathered, counts, displs, MPI.DOUBLE])
    return record.run(loss_and_grad(gathered, b2, x, y, model)[0])


def train_simulated(config: Config, mode: str, ranks: int) -> Run:
    """:func:`train` on ``ranks`` simulated ranks in this one process (``--ranks``, no MPI).

    Each simulated rank keeps its own copy of the replicated bias (a per-rank
    bug makes them drift apart, as on real ranks) and computes the gradient from
    it; ``gclip.clip_simulated`` clips all of them with the library's engine.
    Under ``--reproducible`` the losses have the bits of the real ranks' run.
    """
    model = Model()
    x, y = make_data(config.seed)
    flat, b2 = init_params(config.seed, model)
    counts, displs = shard_bounds(model.flat_size, ranks)
    cuts = [slice(d, d + c) for c, d in zip(counts, displs)]
    b2s = [b2.copy() for _ in range(ranks)]
    record = Recorder(mode, ranks, config.norm_type)
    clipper = make_clipper(config)
    for _ in range(config.steps):
        seen: dict[bytes, tuple[float, np.ndarray, np.ndarray]] = {}  # ranks with equal copies: one pass
        for copy in b2s:
            if copy.tobytes() not in seen:
                seen[copy.tobytes()] = loss_and_grad(flat, copy, x, y, model)
        views = [seen[copy.tobytes()] for copy in b2s]
        if record.step_count == config.spike:
            views = [(loss, g * SPIKE, gb * SPIKE) for loss, g, gb in views]
        raw = [views[r][1][cuts[r]].copy() for r in range(ranks)]
        if clipper is not None:  # the ranks' copies of b2 stay equal: the clip is the same everywhere
            loss, full, gb2 = views[0]
            norm = clip_simulated(
                [[raw[r], gb2] for r in range(ranks)], NO_LIMIT, replicated=[False, True],
                norm_type=config.norm_type, reproducible=config.reproducible,
            )[0].total_norm  # fmt: skip
            if config.clip == "agc":
                full_c, gb2_c = agc_full(clipper, flat, b2s[0], full, gb2, model)
                limit, clipped = math.nan, not (np.array_equal(full_c, full) and np.array_equal(gb2_c, gb2))
            else:
                limit = clipper.decide(norm)
                scale = 1.0 if math.isinf(limit) else clip_scale(norm, limit)
                full_c, gb2_c, clipped = full * scale, gb2 * scale, scale < 1.0
            for r in range(ranks):
                flat[cuts[r]] -= config.lr * full_c[cuts[r]]
                b2s[r] = b2s[r] - config.lr * gb2_c
            record.limits.append(limit)
            record.step(
                loss, [(norm, clipped)] * ranks, np.concatenate([full_c, gb2_c]), np.concatenate([full, gb2])
            )
            continue
        results = clip_simulated(
            [[raw[r].copy(), views[r][2].copy()] for r in range(ranks)],
            config.max_norm,
            mode=mode,
            norm_type=config.norm_type,
            reproducible=config.reproducible,
            replicated=[False, True],
        )
        shards = [res.grads[0] for res in results]
        update = np.concatenate([*shards, results[0].grads[1]])
        for r, res in enumerate(results):
            flat[cuts[r]] -= config.lr * shards[r]
            b2s[r] = b2s[r] - config.lr * res.grads[1]
        told = [(res.total_norm, res.clipped) for res in results]
        record.step(views[0][0], told, update, np.concatenate([*raw, views[0][2]]))
    return record.run(loss_and_grad(flat, b2s[0], x, y, model)[0])


def make_clipper(config: Config) -> Any:
    """``--clip``'s clipper (None: the fixed max_norm, clipped as before), with the references'
    defaults (ZClip's cap ``max_grad_norm`` 1.0, AutoClip's 10th percentile)."""
    if config.clip == "zclip":
        return ZClip()
    if config.clip == "autoclip":
        return AutoClip(percentile=10.0)
    if config.clip == "agc":
        return AGC(AGC_CLIPPING, layout="in-first")  # the model computes x @ W: its kernels are in-first
    return None


def agc_full(
    agc: Any, flat: np.ndarray, b2: np.ndarray, grad: np.ndarray, gb2: np.ndarray, model: Model
) -> tuple[np.ndarray, np.ndarray]:
    """AGC over the full parameters and gradient (W1, b1, W2, b2 unit-wise), flat again."""
    clipped = agc.step([*model.unpack(flat), b2], [*model.unpack(grad), gb2])
    return np.concatenate([c.ravel() for c in clipped[:3]]), clipped[3]


def departs_at(a: Sequence[float], b: Sequence[float]) -> int | None:
    """The first step where two loss trajectories differ, or None."""
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)


def digest(losses: Sequence[float]) -> str:
    """A short hash of the trajectory's exact bits: equal digests, equal runs."""
    return hashlib.sha256(np.asarray(losses, dtype=np.float64).tobytes()).hexdigest()[:16]
