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
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


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

    if size > 1:
        MPI.COMM_WORLD.Abort(code)
    sys.exit(code)
