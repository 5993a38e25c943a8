"""The judge's command: ``python -m gclip.conformance TARGET [--random N] [--seed S] [--timeout T] [--json]``.

Exit status: 0 pass, 1 fail, 2 usage error, 3 the judge's own fault. The
judge is one process (no MPI job to abort) and its exit 1 means "fails the
contract", so its own faults exit 3, in one line (``internal_error``).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

from .._lab.cli import ArgParser, entry, internal_error
from .._lab.jsonout import dumps
from .report import as_json, report
from .target import parse_target
from .verdict import judge

__all__ = ["DESCRIPTION", "MAX_RANDOM", "MAX_TIMEOUT", "PROG", "main"]

PROG = "gclip.conformance"
DESCRIPTION = (
    "The conformance judge: does a third-party ``(shards, limit) -> shards`` keep the seed contract?"
)
MAX_RANDOM = 100_000
MAX_TIMEOUT = 3600.0


def _nonneg_int(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_RANDOM:
        raise ValueError(text)
    return value


_nonneg_int.__name__ = "count (0..100000)"  # argparse names the type in its message


def _timeout(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise ValueError(text)
    return value


_timeout.__name__ = "timeout (seconds, > 0)"


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("target", help="FILE.py:FUNC or package.module:func, a function (shards, limit) -> shards")
    p.add_argument("--random", type=_nonneg_int, default=200, help="random layouts to try (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random layouts (default 0)")
    p.add_argument("--timeout", type=_timeout, default=5.0, help="seconds per call (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text verdict")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    target = parse_target(args.target)
    verdict = judge(target, args.random, args.seed, args.timeout)
    if args.json:
        text = dumps(as_json(verdict, args.random, args.seed, args.timeout))
    else:
        text = "\n".join(report(verdict, args.random, args.seed))
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if verdict.passed else 1


main = entry(PROG, _main, on_fault=internal_error)
