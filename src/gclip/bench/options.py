"""The bench's flags, and the BLAS/OpenMP threads it pins before numpy starts its pool."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._lab import plots
from .._lab.cli import ArgParser, UsageError, check_writable
from .step import STEP_LISTS
from .workloads import (
    DEFAULT_DTYPES,
    DEFAULT_LISTS,
    DEFAULT_RANKS,
    DEFAULT_SIZES,
    DTYPES,
    LISTS,
    MAX_ELEMENTS,
    MAX_RANKS,
    OVERHEAD_LISTS,
    QUICK_REPEAT,
    QUICK_SIZES,
    SWEEP_TIMEOUT,
    TORCH_LISTS,
)

__all__ = [
    "PINNED",
    "PROG",
    "THREAD_VARS",
    "parse_dtypes",
    "parse_lists",
    "parse_options",
    "parse_ranks",
    "parse_sizes",
    "pin_threads",
    "reexec_pinned",
    "threads",
]

PROG = "gclip.bench"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PINNED = "_GCLIP_BENCH_PINNED"  # set before the re-exec, so it happens once


def parse_sizes(text: str) -> list[int]:
    """'1e3,1e4,10000' -> [1000, 10000, 10000]: whole numbers of elements per rank."""
    sizes = []
    for tok in text.split(","):
        tok = tok.strip().replace("_", "")
        try:
            value = float(tok)
        except ValueError:
            raise UsageError(f"--sizes: {tok!r} is not a number (e.g. 1e3,1e4,1e5)") from None
        if not (math.isfinite(value) and value.is_integer() and 1 <= value <= MAX_ELEMENTS):
            raise UsageError(f"--sizes: {tok!r} is not a whole number of elements in 1..{MAX_ELEMENTS:.0e}")
        sizes.append(int(value))
    return sizes


def parse_dtypes(text: str) -> list[str]:
    """'float32,float64' -> names; gclip's bench covers the two training dtypes."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in DTYPES:
            raise UsageError(f"--dtypes: {name!r} is not float32 or float64")
    if not names:
        raise UsageError("--dtypes: give float32, float64 or both")
    return names


def parse_lists(text: str) -> list[str]:
    """'gpt2-small,tiny' -> names of list workloads; 'none' or '' -> []; 'overhead': the three
    one-process rows of gclip.torch against torch's clip."""
    names = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
    overhead = [w.name for w in OVERHEAD_LISTS]
    names = [n for name in names for n in (overhead if name == "overhead" else [name])]
    known = [w.name for w in (*LISTS, *TORCH_LISTS, *STEP_LISTS, *OVERHEAD_LISTS)]
    for name in names:
        if name not in known:
            raise UsageError(f"--lists: {name!r} is not one of {', '.join(known)} (or none)")
    return names


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(t) for t in text.split(",")]
    except ValueError:
        raise UsageError(f"--ranks: {text!r} is not a list of whole numbers (e.g. 1,2,4)") from None
    if not ranks or any(r < 1 or r > MAX_RANKS for r in ranks):
        raise UsageError(f"--ranks: each rank count must be in 1..{MAX_RANKS}")
    return ranks


def _positive(name: str) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{name}: {text!r} is not a whole number") from None
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
        return value

    return convert


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, description="Time the clip step against its floor and torch.")
    p.add_argument("--sizes", help=f"elements per rank, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--dtypes", default=DEFAULT_DTYPES, help="float32, float64 or both")
    p.add_argument("--repeat", type=_positive("--repeat"), help="timed reps per case (default: by size)")
    p.add_argument("--threads", type=_positive("--threads"), help="BLAS/OpenMP/torch threads per rank")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write results as JSON (- : stdout)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed comparison")
    p.add_argument(
        "--lists",
        default=None,
        help=f"list workloads, comma-separated, or none (default {DEFAULT_LISTS}; --quick: tiny; "
        "optimizer steps: gpt2-small-step, gpt2-small-step-bf16; overhead: gclip.torch against "
        "torch's clip in one process, on 1, 2000 x 64 and GPT-2 small's 148 tensors)",
    )
    p.add_argument("--cold", action="store_true", help="evict L1/L2 before each timed call (default: warm)")
    p.add_argument(
        "--quick", action="store_true", help=f"sizes {QUICK_SIZES}, {QUICK_REPEAT} reps: a smoke run"
    )
    p.add_argument("--ranks-sweep", action="store_true", help="run under mpirun -n R for each --ranks")
    p.add_argument(
        "--ranks", default=DEFAULT_RANKS, help=f"rank counts of --ranks-sweep (default {DEFAULT_RANKS})"
    )
    p.add_argument(
        "--timeout", type=_positive("--timeout"), default=SWEEP_TIMEOUT, help="seconds per sweep run"
    )
    return p


def parse_options(argv: Sequence[str] | None) -> Any:
    """The parsed flags, checked (sizes, dtypes, ranks as lists; output paths writable)."""
    args = _parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.dtypes = parse_dtypes(args.dtypes)
    args.ranks = parse_ranks(args.ranks)
    args.lists = parse_lists(
        args.lists if args.lists is not None else ("tiny" if args.quick else DEFAULT_LISTS)
    )
    if args.repeat is None and args.quick:
        args.repeat = QUICK_REPEAT
    if args.plot:
        plots.require()
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-":  # checked on every rank, before the run
            check_writable(flag, path)
    return args


# ---------------------------------------------------------------------------
# threads: fixed before numpy's BLAS starts its pool, so by re-exec


def _wanted_threads(argv: Sequence[str]) -> str | None:
    """The --threads value from raw argv (before argparse, before numpy matters)."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return None


def pin_threads(argv: Sequence[str], env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-exec with, or None if the threads are as wanted.

    Unset thread variables become 1 (the ranks already fill the cores);
    ``--threads N`` overrides whatever is set.
    """
    if env.get(PINNED):
        return None
    wanted = _wanted_threads(argv)
    if wanted is not None and not (wanted.isdigit() and int(wanted) >= 1):
        return None  # argparse will report it
    new = dict(env)
    for var in THREAD_VARS:
        if wanted is not None:
            new[var] = wanted
        else:
            new.setdefault(var, "1")
    if all(new.get(v) == env.get(v) for v in THREAD_VARS):
        return None
    new[PINNED] = "1"
    return new


def reexec_pinned() -> None:
    """numpy (and its BLAS thread pool) is loaded with the gclip package, so the
    thread variables only take effect in a fresh interpreter: exec one, once,
    before MPI starts."""
    env = pin_threads(sys.argv[1:], dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", PROG, *sys.argv[1:]], env)


def threads() -> int:
    """The threads each rank uses (OMP_NUM_THREADS, as pinned)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "0")))
    except ValueError:
        return 1
