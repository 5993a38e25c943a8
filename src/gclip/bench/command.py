"""The bench's command: one run on this job's ranks, or ``--ranks-sweep`` (which starts mpirun itself)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .._lab.cli import UsageError, entry, rank_size
from .._lab.jsonout import dumps
from .figure import plot_results, plot_sweep
from .options import PROG, parse_options, reexec_pinned
from .run import run_bench
from .sweep import format_sweep, run_sweep
from .table import format_table

__all__ = ["main"]


def _emit(result: dict[str, Any], args: Any, table: str) -> None:
    """Table on stdout (stderr when JSON goes to stdout); JSON; plot. Rank 0 only."""
    to_stdout = args.json == "-"
    print(table, file=sys.stderr if to_stdout else sys.stdout, flush=True)
    if args.json:
        text = dumps(result, indent=1, sort_keys=False)
        if to_stdout:
            print(text, flush=True)
        else:
            _write(args.json, text + "\n")
    if args.plot:
        plot_results(result, args.plot) if not args.ranks_sweep else plot_sweep(result, args.plot)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror or exc}") from None


def _main(argv: Sequence[str] | None) -> int:
    if argv is None:
        reexec_pinned()
    args = parse_options(argv)
    if args.ranks_sweep:
        if rank_size()[1] > 1:
            raise UsageError("--ranks-sweep launches mpirun itself: run it without mpirun")
        result = run_sweep(args)
        _emit(result, args, format_sweep(result))
        return 0
    from mpi4py import MPI

    result = run_bench(MPI.COMM_WORLD, args)
    if result is not None:
        _emit(result, args, format_table(result))
    return 0


main = entry(PROG, _main)
