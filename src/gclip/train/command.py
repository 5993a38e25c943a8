"""The trainer's command: flags -> the run (and the correct run next to a bug) -> report and plot."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from .. import gallery
from .._lab import plots
from .._lab.cli import (
    ArgParser,
    UsageError,
    check_writable,
    entry,
    in_range,
    mpi_world,
    parse_max_norm,
    rank_size,
    say,
)
from ..layout import Mesh
from .figure import plot
from .layout import train_layout, train_layout_simulated
from .loop import CLIPS, SPIKE, Config, train, train_simulated
from .report import json_report, text_report

__all__ = ["DESCRIPTION", "MAX_STEPS", "PROG", "main"]

PROG = "gclip.train"
DESCRIPTION = "A small model trained with sharded parameters and global-norm clipping."
MAX_STEPS = 100_000


MAX_SIMULATED = 64


def _bug(text: str) -> str:
    if text not in gallery.STRATEGIES or gallery.STRATEGIES[text].correct:
        names = ", ".join(b.name for b in gallery.BUGS)
        raise argparse.ArgumentTypeError(f"unknown bug {text!r}; choose from {names}")
    return text


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=DESCRIPTION)
    p.add_argument(
        "--steps",
        type=in_range(int, 1, MAX_STEPS, f"steps (1..{MAX_STEPS})"),
        default=200,
        help="training steps (default 200)",
    )
    p.add_argument(
        "--seed",
        type=in_range(int, 0, math.inf, "seed (an integer >= 0)"),
        default=0,
        help="data and initialisation seed (default 0)",
    )
    p.add_argument(
        "--lr",
        type=in_range(float, 0, math.inf, "number (finite, > 0)", above=True),
        default=1.0,
        help="learning rate (default 1.0)",
    )
    p.add_argument("--max-norm", type=parse_max_norm, default=0.05, help="clipping limit (default 0.05)")
    p.add_argument(
        "--buggy",
        nargs="?",
        const="per-rank",
        type=_bug,
        metavar="NAME",
        help="clip with a gallery bug (alone: per-rank) and compare with the correct run",
    )
    p.add_argument(
        "--ranks",
        type=in_range(int, 1, MAX_SIMULATED, f"rank count (1..{MAX_SIMULATED})"),
        metavar="R",
        help="simulate R ranks in this one process, without mpirun (the same clip engine; no MPI needed)",
    )
    p.add_argument("--reproducible", action="store_true", help="the same bits for any rank count and layout")
    p.add_argument(
        "--fused",
        action="store_true",
        help="fold the clip into the update: global_norm, clip_scale, then one pass lr * scale * gradient",
    )
    p.add_argument(
        "--layout",
        metavar="AXES",
        help="lay the MLP out over pp, dp and tp, e.g. pp=2,dp=2,tp=2 (on real ranks, or on --ranks R)",
    )
    p.add_argument(
        "--clip",
        choices=CLIPS,
        default="fixed",
        help="the clip: the fixed --max-norm (default), or one of gclip.limits with the references' "
        "defaults: zclip (z-score 2.5 after 25 steps, capped at 1.0), autoclip (the 10th "
        "percentile of the norms seen), agc (unit-wise, 0.05 of each unit's weight norm)",
    )
    p.add_argument(
        "--spike",
        type=in_range(int, 0, MAX_STEPS, "step (an integer >= 0)"),
        metavar="STEP",
        help=f"a bad batch: that step's gradient times {SPIKE:g} (shows how the clip handles it)",
    )
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
    if args.ranks is not None:
        real = rank_size()[1]
        if real > 1:
            raise UsageError(
                f"--ranks simulates ranks in one process, but this runs on {real} real ranks: "
                "drop --ranks, or drop mpirun"
            )
    if args.fused and (args.buggy or args.layout or args.ranks is not None):
        raise UsageError(
            "--fused folds the correct clip into the update on real ranks: drop --buggy, --layout, --ranks"
        )
    if args.clip != "fixed" and (args.buggy or args.layout or args.fused):
        raise UsageError(f"--clip {args.clip} runs gclip's own clipper: drop --buggy, --layout, --fused")
    if args.spike is not None and args.fused:
        raise UsageError("--spike shows a clip at work: drop --fused")
    if args.plot:
        _check_plot_path(args.plot)
    if args.ranks is not None:
        return _simulated(args)
    comm = mpi_world(PROG)  # real ranks: MPI, or a one-line error that suggests --ranks
    mode = args.buggy or "global"
    config = _config(args)
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
    _report(args, runs, config, comm.Get_size())
    return 0


def _config(args: argparse.Namespace, simulated: bool = False) -> Config:
    strategy = gallery.get(args.buggy or "global")
    return Config(
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        max_norm=args.max_norm,
        reproducible=args.reproducible,
        norm_type=strategy.norm_type or 2.0,
        layout=args.layout,
        simulated=simulated,
        fused=bool(getattr(args, "fused", False)),
        clip=args.clip,
        spike=args.spike,
    )


def _simulated(args: argparse.Namespace) -> int:
    """``--ranks R``: the same training on R simulated ranks, in this one process."""
    config = _config(args, simulated=True)
    if args.layout:
        shape = Mesh.parse((0, args.ranks), args.layout).shape  # checked against --ranks here
        runs = [train_layout_simulated(config, args.buggy or "global", shape)]
        if args.buggy:
            runs.append(train_layout_simulated(config, "global", shape))
    else:
        runs = [train_simulated(config, args.buggy or "global", args.ranks)]
        if args.buggy:
            runs.append(train_simulated(config, "global", args.ranks))
    _report(args, runs, config, args.ranks)
    return 0


def _report(args: argparse.Namespace, runs: list, config: Config, ranks: int) -> None:
    if args.json:
        say(json_report(runs, config, ranks))
    else:
        text_report(runs, config, ranks)
    if args.plot and rank_size()[0] == 0:
        plot(args.plot, runs, config, ranks)
        if not args.json:
            say(f"wrote {args.plot}")


main = entry(PROG, _main)
