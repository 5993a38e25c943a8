"""What every lab command shares: flags, one-line errors, the entry point.

- Usage errors (bad flags, bad data) are found by every rank from the same
  argv, so every rank exits 2 together: no collective is needed to agree, and
  rank 0 alone prints the one-line message.
- Errors gclip raised on purpose (``GclipError``) are agreed on by all ranks
  already: same exit 2, same one line.
- Anything else is a fault. Under MPI (``abort_job``, the default) that rank
  prints one line naming itself and aborts the whole job (``MPI_Abort``), so
  no rank is left waiting in a collective: what ``python -m mpi4py`` does,
  with one line instead of a traceback. A single process whose exit 1 means
  something else (the judge: "fails") maps its own faults to exit 3 instead
  (``internal_error``).
- MPI is loaded only when real ranks are needed: ``--help``, ``--list-bugs``
  and ``--ranks R`` (simulated ranks) work where mpi4py cannot be imported
  (no MPI library on the machine); a run that needs MPI there says so in one
  line (``mpi_world``) and suggests ``--ranks R``; so does a tool that finds
  no mpirun to start (``internal_error``: the judge's own job), in the same
  words (``without_mpi``).
"""

from __future__ import annotations

import argparse
import math
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import engine
from ..errors import GclipError
from .lines import exception_line
from .mpirun import MpirunNotFound

__all__ = [
    "INTERRUPTED",
    "ArgParser",
    "Fault",
    "UsageError",
    "abort_job",
    "check_writable",
    "closed_pipe",
    "color",
    "entry",
    "in_range",
    "internal_error",
    "mpi_world",
    "parse_max_norm",
    "rank_size",
    "say",
    "without_mpi",
]

INTERRUPTED = 130  # the shell's code for Ctrl-C (128 + SIGINT)


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


# ---------------------------------------------------------------------------
# checks of flag values


def parse_max_norm(text: str, flag: str = "--max-norm") -> float:
    """The clipping limit from its flag's text: the library's own check, as a usage error."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise UsageError(f"{flag} must be a number, got {shown!a}") from None
    try:
        return engine.max_norm(value, flag)
    except GclipError as exc:
        raise UsageError(str(exc)) from None


def check_writable(flag: str, path: str) -> None:
    """Before any work: a result that cannot be saved is a usage error, not a lost run."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}: cannot write {path!r}: no such writable folder")


# ---------------------------------------------------------------------------
# the entry point


Fault = Callable[[str, BaseException], int]
ABORT_GRACE = 0.2  # seconds between a fault's line and the abort


def abort_job(prog: str, exc: BaseException) -> NoReturn:
    """A fault on this rank of an MPI job: one line naming the rank, then end every rank."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    message = "interrupted" if interrupted else exception_line(exc)
    code = INTERRUPTED if interrupted else 1
    rank, size = rank_size()
    print(f"{prog}: rank {rank} of {size}: {message}; aborting the job", file=sys.stderr, flush=True)
    mpi = sys.modules.get("mpi4py.MPI")  # never imported here: the fault may be that it cannot be
    if size > 1 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # the launcher forwards a rank's output on its own time and the abort tears that down:
        # under load the line was lost (CI); a moment first lets it through
        time.sleep(ABORT_GRACE)
        mpi.COMM_WORLD.Abort(code)  # ends every rank of the job, wherever it waits
    sys.exit(code)


SIMULATED_HINT = 4  # the rank count the no-MPI error suggests


def without_mpi(prog: str) -> str:
    """The one hint every lab command gives where MPI cannot be loaded or mpirun is missing."""
    if prog == "gclip.conformance":  # the judge's --ranks starts real ranks: judge in one process
        return (
            "without MPI, judge a single-process function (no --ranks), e.g. "
            "python -m gclip.conformance lab/my_clip.py:clip_shards"
        )
    return (
        f"without MPI, simulate the ranks in this one process: python -m {prog} ... --ranks {SIMULATED_HINT}"
    )


def mpi_world(prog: str) -> Any:
    """MPI's COMM_WORLD, or a one-line UsageError when MPI cannot be loaded.

    mpi4py (and the MPI library under it) is imported here, only when real
    ranks are needed. Where it cannot be (mpi4py missing: ImportError; no MPI
    library, as on Windows without MPI: mpi4py's RuntimeError "cannot load MPI
    library"), the error says what failed and how to run without MPI.
    """
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:
        raise UsageError(f"MPI cannot be loaded ({exception_line(exc)}); {without_mpi(prog)}") from None
    return MPI.COMM_WORLD


def internal_error(prog: str, exc: BaseException) -> int:
    """A fault of a single-process tool whose exit 1 has a meaning of its own: exit 3.

    No launcher (mpirun missing) is no fault of the tool: one line with the way
    without MPI, exit 2, as for a usage error.
    """
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    if isinstance(exc, MpirunNotFound):
        print(f"{prog}: error: {exc}; {without_mpi(prog)}", file=sys.stderr, flush=True)
        return 2
    print(f"{prog}: internal error: {exception_line(exc)}", file=sys.stderr, flush=True)
    return 3


def entry(
    prog: str, main: Callable[..., int | None], *, on_fault: Fault = abort_job
) -> Callable[..., NoReturn]:
    """Wrap ``main(argv)`` into a process entry point with the rules above."""

    def run(argv: Sequence[str] | None = None) -> NoReturn:
        code = 1
        try:
            code = main(argv) or 0
            sys.stdout.flush()
        except BrokenPipeError as exc:  # stdout's reader went away (``| head``): stop quietly
            code = closed_pipe() if stdout_closed() else on_fault(prog, exc)
        except (UsageError, GclipError) as exc:
            if rank_size()[0] == 0:
                print(f"{prog}: error: {exception_line(exc, with_type=False)}", file=sys.stderr, flush=True)
            code = 2
        except SystemExit as exc:  # --help, or an explicit exit
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C or a fault: on_fault decides
            code = on_fault(prog, exc)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            code = closed_pipe()
        sys.exit(code)

    return run


CLOSED_PIPE = 141  # what a shell reports for a tool ended by SIGPIPE (128 + 13)


def stdout_closed() -> bool:
    """Whether stdout is a pipe nobody reads any more (another pipe of the tool's own breaking
    is a fault, not a reader's choice)."""
    if not hasattr(select, "poll"):  # Windows: no poll; take it to be stdout's
        return True
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def closed_pipe() -> int:
    """Stdout's reader has gone: what is still buffered goes nowhere (Python would otherwise
    print a second BrokenPipeError as it exits), and in a job of several ranks every rank ends
    now (the others could be waiting in a collective for this one)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    mpi = sys.modules.get("mpi4py.MPI")
    if rank_size()[1] > 1 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(CLOSED_PIPE)
    return CLOSED_PIPE


def in_range(kind: type, lo: float, hi: float, what: str, *, above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a whole number (``int``) or a finite ``float`` in [lo, hi]
    (above lo with ``above=True``). argparse names ``what`` when it refuses a value:
    "argument --steps: invalid steps (1..100000) value: 'x'"."""

    def convert(text: str) -> Any:
        value = kind(text)
        if kind is float and not math.isfinite(value):
            raise ValueError(text)
        if not ((value > lo if above else value >= lo) and value <= hi):
            raise ValueError(text)
        return value

    convert.__name__ = what
    return convert
