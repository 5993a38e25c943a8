"""What every entry point run under mpirun shares.

- Usage errors (bad flags, bad data) are found by every rank from the same
  argv, so every rank exits 2 together: no collective is needed to agree, and
  rank 0 alone prints the one-line message.
- Errors gclip raised on purpose (``GclipError``) are agreed on by all ranks
  already: same exit 2, same one line.
- Anything else is a bug or a fault on one rank: that rank prints one line
  naming itself and aborts the whole job (``MPI_Abort``), so no rank is left
  waiting in a collective. This is what ``python -m mpi4py`` does, with a
  one-line message instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .errors import GclipError

__all__ = ["ArgParser", "UsageError", "color", "entry", "rank_size", "say"]


class UsageError(Exception):
    """Bad command-line input: a one-line message and exit 2 on every rank."""


class ArgParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing usage text."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def print_help(self, file: Any = None) -> None:
        if rank_size()[0] == 0:
            super().print_help(file)


def rank_size() -> tuple[int, int]:
    """This process's rank and the job's size, without starting MPI just to ask.

    Before MPI is up (or in a tool that never starts it, like the judge) the
    launcher's environment says it: Hydra sets PMI_RANK, Open MPI its own.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    for rank_var, size_var in _LAUNCHER_ENV:
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ.get(size_var, "1"))
    return 0, 1


_LAUNCHER_ENV = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMI_SIZE"),
)


def say(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only, flushed (output of ranks interleaves otherwise)."""
    if rank_size()[0] == 0:
        print(*args, **kwargs, flush=True)


def color(text: str, code: str, stream: Any = None) -> str:
    """ANSI colour on a TTY only (logs and pipes get plain text); NO_COLOR wins."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    return f"\033[{code}m{text}\033[0m"


def entry(prog: str, main: Callable[[Sequence[str] | None], int | None]) -> Callable[..., NoReturn]:
    """Wrap ``main(argv)`` into a process entry point with the rules above."""

    def run(argv: Sequence[str] | None = None) -> NoReturn:
        code = 1
        try:
            code = main(argv) or 0
        except (UsageError, GclipError) as exc:
            if rank_size()[0] == 0:
                print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr, flush=True)
            code = 2
        except SystemExit as exc:  # --help, or an explicit exit
            code = exc.code if isinstance(exc.code, int) else 0
        except KeyboardInterrupt:
            _abort(prog, "interrupted", 130)
        except BaseException as exc:  # noqa: BLE001 - a fault on this rank: end the job
            _abort(prog, f"{type(exc).__name__}: {_one_line(exc)}", 1)
        sys.stdout.flush()
        sys.exit(code)

    return run


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _abort(prog: str, message: str, code: int) -> NoReturn:
    rank, size = rank_size()
    print(f"{prog}: rank {rank} of {size}: {message}; aborting the job", file=sys.stderr, flush=True)
    from mpi4py import MPI

    if size > 1 and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)  # ends every rank of the job, wherever it waits
    sys.exit(code)
