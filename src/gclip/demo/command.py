"""The demo's command: flags -> the clip on every rank -> rank 0's report (text or JSON) and plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._lab.cli import entry, mpi_world, rank_size
from .figure import check_plot, render_layout_plot, render_plot
from .gallery import render_bugs
from .layout import render_layout, run_layout
from .layout import to_json as layout_json
from .options import PROG, parse_args
from .ranks import run, run_simulated, to_json
from .text import render_text

__all__ = ["main"]


def _main(argv: Sequence[str] | None = None, comm: Any = None) -> int:
    if comm is None:
        opts = parse_args(argv, None)  # the flags alone (--help ends here): MPI is not loaded yet
        if opts.list_bugs or opts.simulate is not None:
            # no MPI needed (nor loaded): the launcher's environment says if this is one of several
            opts = parse_args(argv, rank_size()[1])
        else:
            comm = mpi_world(PROG)  # real ranks: MPI, or a one-line error that suggests --ranks
            opts = parse_args(argv, comm.Get_size())
    else:
        opts = parse_args(argv, comm.Get_size())
    rank = comm.Get_rank() if comm is not None else rank_size()[0]

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    if opts.list_bugs:
        say(render_bugs(opts.json))
        return 0
    if opts.layout:
        real = None if opts.simulate else comm  # None: simulated ranks, in this one process
        if opts.plot:
            check_plot(opts, real)
        report = run_layout(opts, real)
        if report is None:
            return 0
        plotted = render_layout_plot(report, opts, opts.plot) if opts.plot else 0
        say(layout_json(report) if opts.json else render_layout(report, opts))
        if opts.plot and not opts.json:
            say(f"plot: wrote {opts.plot} ({plotted // 1024} KB)")
        return 0
    if opts.plot:
        check_plot(opts, comm)
    report = run_simulated(opts) if opts.simulate else run(opts, comm)  # --ranks: one real rank
    if report is None:
        return 0
    plotted = render_plot(report, opts, opts.plot) if opts.plot else 0
    if opts.json:
        say(to_json(report, opts.values))
    else:
        say(render_text(report, opts))
        if opts.plot:
            say(f"plot: wrote {opts.plot} ({plotted // 1024} KB)")
    return 0


main = entry(PROG, _main)
