"""The trainer's command: flags -> the run (and the correct run next to a bug) -> report and plot."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from .. import strategies
from .._lab import plots
from .._lab.cli import ArgParser, UsageError, check_writable, entry, parse_max_norm, say
from ..layout import Mesh
from .figure import plot
from .layout import train_layout
from .loop import Config, train
from .report import json_report, text_report

__all__ = ["DESCRIPTION", "MAX_STEPS", "PROG", "main"]

PROG = "gclip.train"
DESCRIPTION = "A small model trained with sharded parameters and global-norm clipping."
MAX_STEPS = 100_000


def _positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_STEPS:
        raise ValueError(text)
    return value


_positive_int.__name__ = "steps (1..100000)"  # argparse names the type in its message


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


def _bug(text: str) -> str:
    if text not in strategies.STRATEGIES or strategies.STRATEGIES[text].correct:
        names = ", ".join(b.name for b in strategies.BUGS)
        raise argparse.ArgumentTypeError(f"unknown bug {text!r}; choose from {names}")
    return text


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--steps", type=_positive_int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=_seed, default=0, help="data and initialisation seed (default 0)")
    p.add_argument("--lr", type=_positive_float, default=1.0, help="learning rate (default 1.0)")
    p.add_argument("--max-norm", type=parse_max_norm, default=0.05, help="clipping limit (default 0.05)")
    p.add_argument(
        "--buggy",
        nargs="?",
        const="per-rank",
        type=_bug,
        metavar="NAME",
        help="clip with a gallery bug (alone: per-rank) and compare with the correct run",
    )
    p.add_argument("--reproducible", action="store_true", help="the same bits for any rank count and layout")
    p.add_argument("--layout", metavar="AXES", help="lay the MLP out over pp, dp and tp, e.g. pp=2,dp=2,tp=2")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="save loss curves (needs matplotlib)")
    return p


def _check_plot_path(path: str) -> None:
    """Every rank checks, so a plot that cannot be made is a usage error on all of them."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path!r}: the file name must end in .png")
    check_writable("--plot", path)
    plots.require()


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
        layout=args.layout,
    )
    if args.layout:
        mesh = Mesh.parse(comm, args.layout)
        runs = [train_layout(config, mode, mesh)]
        if args.buggy:
            runs.append(train_layout(config, "global", mesh))
        mesh.free()
    else:
        runs = [train(config, mode, comm)]
        if args.buggy:
            runs.append(train(config, "global", comm))
    ranks = comm.Get_size()
    if args.json:
        say(json_report(runs, config, ranks))
    else:
        text_report(runs, config, ranks)
    if args.plot and comm.Get_rank() == 0:
        plot(args.plot, runs, config, ranks)
        if not args.json:
            say(f"wrote {args.plot}")
    return 0


main = entry(PROG, _main)
