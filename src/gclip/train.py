"""A small model trained with sharded parameters and global-norm clipping.

usage:: mpiexec -n R python -m gclip.train [--steps 200] [--seed 0] [--lr 1.0] [--max-norm 0.05]
            [--buggy [NAME]] [--reproducible] [--json] [--plot FILE.png]

A 2-layer MLP (2 -> 16 tanh -> 3 softmax) learns a synthetic 3-class spiral,
numpy only. Its weights live as one flat vector split into R contiguous
slices, one per rank, as in ZeRO-3 or FSDP: each step gathers the vector
(``Allgatherv``, a pure copy), computes the loss and the gradient, and each
rank keeps the gradient of its own slice. The output bias is replicated on
every rank, as biases are under tensor parallelism, and counts once in the
norm. The gradient slices are then clipped by ``gclip.clip_by_global_norm``
(active on most early steps) and each rank updates its slice.

With ``--reproducible`` every number that crosses ranks is either a copy or
an exact (integer) sum, so the loss trajectory has the same bits for any R.
``--buggy NAME`` clips with a gallery bug instead (alone: ``per-rank``, the
seed's bug) and also trains the correct run, to show where the two part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import strategies
from ._lab import cli as _cli
from .clip import clip_by_global_norm

__all__ = [
    "Config",
    "Model",
    "Run",
    "cosine",
    "init_params",
    "loss_and_grad",
    "main",
    "make_data",
    "shard_bounds",
    "train",
    "vector_norm",
]

HIDDEN = 16
CLASSES = 3
POINTS_PER_CLASS = 100
MAX_STEPS = 100_000


# ---------------------------------------------------------------------------
# the model: pure functions of the full parameters, the same on every rank


class Model(NamedTuple):
    """Shapes of the sharded flat vector (W1, b1, W2) and the replicated bias b2."""

    inputs: int = 2
    hidden: int = HIDDEN
    classes: int = CLASSES

    @property
    def flat_size(self) -> int:
        return self.inputs * self.hidden + self.hidden + self.hidden * self.classes

    def unpack(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i, h, c = self
        w1 = flat[: i * h].reshape(i, h)
        b1 = flat[i * h : i * h + h]
        w2 = flat[i * h + h :].reshape(h, c)
        return w1, b1, w2


def make_data(seed: int, per_class: int = POINTS_PER_CLASS) -> tuple[np.ndarray, np.ndarray]:
    """A noisy 3-arm spiral: not linearly separable, so the hidden layer has work to do."""
    rng = np.random.default_rng([seed, 1])
    xs, ys = [], []
    for k in range(CLASSES):
        r = np.linspace(0.1, 1.0, per_class)
        t = np.linspace(k * 4.0, (k + 1) * 4.0, per_class) + rng.normal(0.0, 0.25, per_class)
        xs.append(np.column_stack([r * np.sin(t), r * np.cos(t)]))
        ys.append(np.full(per_class, k))
    return np.concatenate(xs) * 2.0, np.concatenate(ys)


def init_params(seed: int, model: Model | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(flat W1|b1|W2, b2): the same draw on every rank, whatever R."""
    model = model or Model()
    rng = np.random.default_rng([seed, 2])
    w1 = rng.normal(0.0, 1.0, (model.inputs, model.hidden))
    b1 = np.zeros(model.hidden)
    w2 = rng.normal(0.0, 1.0 / math.sqrt(model.hidden), (model.hidden, model.classes))
    return np.concatenate([w1.ravel(), b1, w2.ravel()]), np.zeros(model.classes)


def loss_and_grad(
    flat: np.ndarray, b2: np.ndarray, x: np.ndarray, y: np.ndarray, model: Model | None = None
) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy and its gradient w.r.t. (flat, b2)."""
    model = model or Model()
    w1, b1, w2 = model.unpack(flat)
    n = x.shape[0]
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -float(logp[np.arange(n), y].mean())
    d = np.exp(logp)
    d[np.arange(n), y] -= 1.0
    d /= n
    gw2 = h.T @ d
    gb2 = d.sum(axis=0)
    dh = (d @ w2.T) * (1.0 - h * h)
    gw1 = x.T @ dh
    gb1 = dh.sum(axis=0)
    return loss, np.concatenate([gw1.ravel(), gb1, gw2.ravel()]), gb2


def shard_bounds(n: int, ranks: int) -> tuple[list[int], list[int]]:
    """(counts, displacements) of n elements split into contiguous, near-equal slices."""
    counts = [n // ranks + (r < n % ranks) for r in range(ranks)]
    displs = [sum(counts[:r]) for r in range(ranks)]
    return counts, displs


# ---------------------------------------------------------------------------
# training


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
    cosines: list[float]  # cos(applied update, raw gradient): 1 = direction kept
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


def vector_norm(v: np.ndarray, p: float) -> float:
    """A whole vector's p-norm on one rank (p = 2 or inf here)."""
    return float(np.abs(v).max()) if math.isinf(p) else float(np.sum(np.abs(v) ** p) ** (1.0 / p))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(angle) between the update applied and the raw gradient: 1 when clipping kept the direction."""
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / den if den else 1.0


def departs_at(a: Sequence[float], b: Sequence[float]) -> int | None:
    """The first step where two loss trajectories differ, or None."""
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)


def digest(losses: Sequence[float]) -> str:
    """A short hash of the trajectory's exact bits: equal digests, equal runs."""
    return hashlib.sha256(np.asarray(losses, dtype=np.float64).tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# reporting


def summary(run: Run, config: Config, ranks: int) -> dict:
    return {
        "mode": run.mode,
        "ranks": ranks,
        "steps": config.steps,
        "seed": config.seed,
        "lr": config.lr,
        "max_norm": config.max_norm,
        "norm_type": _ptext(config.norm_type),
        "reproducible": config.reproducible,
        "params": Model().flat_size + CLASSES,
        "clipped_steps": run.clipped_steps,
        "final_loss": run.final_loss,
        "losses": run.losses,
        "grad_norms": run.grad_norms,
        "update_norms": run.update_norms,
        "cosines": run.cosines,
        "digest": digest(run.losses),
    }


def _ptext(p: float) -> float | str:
    return "inf" if math.isinf(p) else p


def _text_report(runs: list[Run], config: Config, ranks: int) -> None:
    run = runs[0]
    model = Model()
    _cli.say(
        f"gclip.train: MLP {model.inputs}-{model.hidden}-{model.classes}, {model.flat_size} weights "
        f"sharded over {ranks} rank(s) + {CLASSES} replicated; mode {run.mode}, "
        f"max_norm {config.max_norm:g}, lr {config.lr:g}, reproducible={config.reproducible}"
    )
    _cli.say(f"{'step':>6} {'loss':>12} {'clip norm':>12} {'applied':>10}  clipped")
    every = max(1, config.steps // 10)
    for i in range(config.steps):
        if i % every == 0 or i == config.steps - 1:
            mark = "yes" if run.clipped[i] else ""
            norms = f"{run.grad_norms[i]:>12.4g} {run.update_norms[i]:>10.4g}"
            _cli.say(f"{i:>6} {run.losses[i]:>12.6f} {norms}  {mark}")
    _cli.say(f"final loss {run.final_loss:.6f}; clipped on {run.clipped_steps} of {config.steps} steps")
    _cli.say(f"trajectory digest {digest(run.losses)} (equal digests: bitwise-equal losses)")
    if len(runs) > 1:
        ref = runs[1]
        at = departs_at(run.losses, ref.losses)
        where = "never" if at is None else f"at step {at}"
        _cli.say(
            f"correct run (global): final loss {ref.final_loss:.6f}, clipped on {ref.clipped_steps} steps; "
            f"the {run.mode} run departs from it {where}"
        )
        _cli.say(
            f"largest update applied: {run.mode} {max(run.update_norms):.4g}, "
            f"global {max(ref.update_norms):.4g} (limit {config.max_norm:g}); smallest cos(update, "
            f"gradient): {run.mode} {min(run.cosines):.4f}, global {min(ref.cosines):.4f}"
        )


def _need_matplotlib() -> None:
    """Every rank checks, so a missing matplotlib is a usage error on all of them."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise _cli.UsageError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None


def plot(path: str, runs: list[Run], config: Config, ranks: int) -> None:
    """Loss curves, the norm of the update actually applied, and its direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(8, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.4]}
    )
    styles = {"global": ("tab:blue", "-")}
    for run in reversed(runs):
        colour, line = styles.get(run.mode, ("tab:red", "--"))
        label = f"{run.mode}: clipped on {run.clipped_steps}/{config.steps} steps, "
        label += f"final loss {run.final_loss:.4f}"
        steps = np.arange(len(run.losses))
        top.plot(steps, run.losses, line, color=colour, lw=2, label=label)
        middle.plot(steps, run.update_norms, line, color=colour, lw=1.5, label=run.mode, zorder=3)
        bottom.plot(steps, run.cosines, line, color=colour, lw=1.5, label=run.mode)
    middle.axhline(config.max_norm, color="grey", lw=1, ls=":", label=f"max_norm = {config.max_norm:g}")
    if any(not r.mode == "global" for r in runs) and ranks > 1:
        middle.axhline(
            math.sqrt(ranks) * config.max_norm, color="grey", lw=1, ls="-.", label=f"sqrt({ranks}) x max_norm"
        )
    top.set_ylabel("training loss")
    top.set_yscale("log")
    title = "loss (cross-entropy, full batch)"
    if any(max(r.update_norms) > config.max_norm * (1 + 1e-9) for r in runs):
        title += ": a bug that oversteps the limit (middle) may even fall faster"
    top.set_title(title, fontsize=10)
    middle.set_ylabel("norm")
    middle.set_title("norm of the whole update applied: clipping promises <= max_norm", fontsize=10)
    bottom.set_ylabel("cosine")
    bottom.set_title("cos(update applied, raw gradient): 1 = direction kept", fontsize=10)
    bottom.set_xlabel("step")
    for ax in (top, middle, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    model = Model()
    fig.suptitle(
        f"gclip.train: MLP {model.inputs}-{model.hidden}-{model.classes}, weights sharded over {ranks} "
        f"rank(s), lr {config.lr:g}, seed {config.seed}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# command line


def _positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_STEPS:
        raise ValueError(text)
    return value


_positive_int.__name__ = "steps (1..100000)"


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_seed.__name__ = "seed (an integer >= 0)"


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


_positive_float.__name__ = "number (finite, > 0)"


def _limit(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(text)
    return value


_limit.__name__ = "limit (finite, >= 0)"


def _bug(text: str) -> str:
    if text not in strategies.STRATEGIES or strategies.STRATEGIES[text].correct:
        names = ", ".join(b.name for b in strategies.BUGS)
        raise argparse.ArgumentTypeError(f"unknown bug {text!r}; choose from {names}")
    return text


def _parser() -> _cli.ArgParser:
    p = _cli.ArgParser(prog="gclip.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=_positive_int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=_seed, default=0, help="data and initialisation seed (default 0)")
    p.add_argument("--lr", type=_positive_float, default=1.0, help="learning rate (default 1.0)")
    p.add_argument("--max-norm", type=_limit, default=0.05, help="clipping limit (default 0.05)")
    p.add_argument(
        "--buggy",
        nargs="?",
        const="per-rank",
        type=_bug,
        metavar="NAME",
        help="clip with a gallery bug (alone: per-rank) and compare with the correct run",
    )
    p.add_argument("--reproducible", action="store_true", help="the same bits for any rank count")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="save loss curves (needs matplotlib)")
    return p


def _check_plot_path(path: str) -> None:
    import os

    if not path.lower().endswith(".png"):
        raise _cli.UsageError(f"--plot {path!r}: the file name must end in .png")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise _cli.UsageError(f"--plot {path!r}: no writable folder {os.path.dirname(path) or '.'!r}")
    _need_matplotlib()


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.plot:
        _check_plot_path(args.plot)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode = args.buggy or "global"
    strategy = strategies.get(mode)
    config = Config(
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        max_norm=args.max_norm,
        reproducible=args.reproducible,
        norm_type=strategy.norm_type or 2.0,
    )
    runs = [train(config, mode, comm)]
    if args.buggy:
        runs.append(train(config, "global", comm))
    ranks = comm.Get_size()
    if args.json:
        out = summary(runs[0], config, ranks)
        if len(runs) > 1:
            ref = runs[1]
            out["correct"] = {
                "mode": ref.mode,
                "losses": ref.losses,
                "final_loss": ref.final_loss,
                "clipped_steps": ref.clipped_steps,
                "update_norms": ref.update_norms,
                "cosines": ref.cosines,
                "digest": digest(ref.losses),
            }
            out["departs_at"] = departs_at(runs[0].losses, ref.losses)
        _cli.say(json.dumps(out))
    else:
        _text_report(runs, config, ranks)
    if args.plot and comm.Get_rank() == 0:
        plot(args.plot, runs, config, ranks)
        if not args.json:
            _cli.say(f"wrote {args.plot}")
    return 0


main = _cli.entry("gclip.train", _main)

if __name__ == "__main__":
    main()
