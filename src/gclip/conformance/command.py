"""The judge's command: ``python -m gclip.conformance TARGET [--ranks R [--torch] | --layout L] ...``.

Without ``--ranks`` it judges a single-process ``(shards, limit)`` function;
with it, a distributed ``(grads, max_norm, comm)`` function on a job of R
ranks that the judge starts and watches itself (``--torch``: parameters and
a gloo group; ``--layout``: the lab's model over a mesh).

Exit status: 0 pass, 1 fail (a near miss too), 2 usage error, 3 the judge's
own fault. The judge is one process (no MPI job to abort) and its exit 1
means "fails the contract", so its own faults exit 3, in one line
(``internal_error``). Started as several processes (under mpirun) it
refuses, in one line, before doing anything: it starts its own job.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from .. import drivers
from .._lab.cli import ArgParser, UsageError, closed_pipe, entry, in_range, internal_error
from .._lab.jsonout import dumps
from . import dist_report
from .families import DTYPES, Family
from .report import as_json, report
from .target import LoadError, parse_target
from .verdict import judge

__all__ = [
    "DEFAULT_RANDOM",
    "DEFAULT_RANDOM_LAYOUT",
    "DESCRIPTION",
    "MAX_RANDOM",
    "MAX_RANKS",
    "MAX_TIMEOUT",
    "PROG",
    "main",
]

PROG = "gclip.conformance"
DESCRIPTION = (
    "The conformance judge: does your gradient clipping keep the contract? A single-process "
    "(shards, limit) function, or with --ranks a distributed (grads, max_norm, comm) one."
)
MAX_RANDOM = 100_000
MAX_TIMEOUT = 3600.0
MAX_RANKS = 64
DEFAULT_RANDOM = 200
DEFAULT_RANDOM_LAYOUT = 20  # each layout case is the whole model, on every rank


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=DESCRIPTION)
    p.add_argument(
        "target",
        help="FILE.py:FUNC or package.module:func: (shards, limit) -> shards, or with --ranks "
        "(grads, max_norm, comm) -> clipped list or None",
    )
    p.add_argument(
        "--random",
        type=in_range(int, 0, MAX_RANDOM, f"count (0..{MAX_RANDOM})"),
        default=None,
        help=f"random layouts to try (default {DEFAULT_RANDOM}; {DEFAULT_RANDOM_LAYOUT} with --layout)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random layouts (default 0)")
    p.add_argument(
        "--timeout",
        type=in_range(float, 0, MAX_TIMEOUT, "timeout (seconds, > 0)", above=True),
        default=5.0,
        help="seconds per call or case (default 5)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text verdict")
    p.add_argument(
        "--ranks",
        type=in_range(int, 2, MAX_RANKS, f"rank count (2..{MAX_RANKS})"),
        help="judge a distributed function on a job of R >= 2 ranks",
    )
    p.add_argument(
        "--torch",
        action="store_true",
        help="FUNC(parameters, max_norm, group) on a torch.distributed gloo group",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="with --ranks or --layout: every array in this dtype (real code may assert one, e.g. float32)",
    )
    p.add_argument(
        "--nonempty-ranks",
        action="store_true",
        help="with --ranks or --layout: only cases where every rank holds values",
    )
    p.add_argument(
        "--positive-max-norm",
        action="store_true",
        help="with --ranks or --layout: only cases with max_norm > 0 (code that reads 0 as 'clipping off')",
    )
    p.add_argument(
        "--layout",
        help="e.g. pp=2,dp=2,tp=2: FUNC(grads, max_norm, comm, mesh, replicated) on the lab's model "
        "(with --torch: FUNC(parameters, max_norm, layout), torch groups on the layout)",
    )
    return p


def _refuse_launcher(args: Any, argv: Sequence[str] | None) -> None:
    """Under mpirun every rank would judge and print: the judge is one process (it launches its
    own MPI job when it needs one). The advice is the user's own command without mpirun, with
    ``--ranks N`` (N: mpirun's size) added only for a function that takes a communicator."""
    launched = drivers.launched_size()
    if launched is None:
        return
    n, why = launched
    words = list(sys.argv[1:] if argv is None else argv)
    own = f"python -m {PROG} {shlex.join(words)}"
    first = f"started as one of {n} processes ({why}): the judge launches its own MPI job when it needs one"
    if args.ranks is not None or args.torch or args.layout is not None:
        raise UsageError(f"{first}; run it as one process, without mpirun: {own}")
    dist = f"{own} --ranks {max(n, 2)}"
    kind = _signature_kind(args.target)
    if kind == "single":
        raise UsageError(
            f"{first}; a (shards, limit) function is judged in one process, without mpirun: {own}"
        )
    if kind == "distributed":
        raise UsageError(
            f"{first}; a (grads, max_norm, comm) function is judged on ranks the judge starts, "
            f"without mpirun: {dist}"
        )
    raise UsageError(
        f"{first}; run it as one process, without mpirun: {own} for a (shards, limit) function, "
        f"or {dist} for a distributed (grads, max_norm, comm) one"
    )


def _signature_kind(spec: str) -> str | None:
    """The kind of the target's function: "single" for two positional parameters (shards, limit),
    "distributed" for three or more (grads, max_norm, comm), None when unknown. Read from the source
    (never run: under mpirun every rank would run it), for a function defined at the top level
    of the file or module."""
    try:
        target = parse_target(spec)
        path = target.where
        if target.kind == "module":
            found = importlib.util.find_spec(target.where)
            path = found.origin if found is not None and found.origin else ""
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (UsageError, ImportError, ValueError, OSError, SyntaxError):
        return None
    defs = [
        node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == target.func
    ]
    if len(defs) != 1 or defs[0].args.vararg is not None:
        return None
    params = [a.arg for a in defs[0].args.posonlyargs + defs[0].args.args]
    if len(params) == 2:
        return "single"
    if len(params) >= 3:
        return "distributed"
    return None


def _distributed(args: Any) -> tuple[bool, str]:
    from .distributed import judge_distributed
    from .layout_cases import parse_layout

    layout = None
    if args.layout is not None:
        layout = parse_layout(args.layout)
        size = math.prod(layout.values())
        if args.ranks is not None and args.ranks != size:
            raise UsageError(f"--layout {args.layout} is {size} ranks, but --ranks says {args.ranks}")
        if size < 2:
            raise UsageError(f"--layout {args.layout} is one rank: a distributed judge needs 2 or more")
    elif args.ranks is None:
        raise UsageError("--torch needs --ranks R (R >= 2)")
    target = parse_target(args.target)
    size = args.ranks or math.prod((layout or {}).values())
    if args.torch:
        try:
            import torch.distributed  # noqa: F401 - only to say so now, not on every rank
        except ImportError:
            raise UsageError("--torch needs PyTorch (pip install torch)") from None
    family = Family(args.dtype, args.nonempty_ranks, args.positive_max_norm)
    verdict = judge_distributed(
        target,
        size,
        count=args.random,
        seed=args.seed,
        timeout=args.timeout,
        torch=args.torch,
        layout=layout,
        family=family,
    )
    mode = ("torch-layout" if args.torch else "layout") if layout else "torch" if args.torch else "numpy"
    if args.json:
        data = dist_report.as_json(
            verdict, mode=mode, layout=layout, count=args.random, seed=args.seed, timeout=args.timeout
        )
        return verdict.passed, dumps(data)
    return verdict.passed, "\n".join(dist_report.report(verdict, mode=mode, layout=layout, seed=args.seed))


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    _refuse_launcher(args, argv)
    if args.random is None:
        args.random = DEFAULT_RANDOM_LAYOUT if args.layout is not None else DEFAULT_RANDOM
    if args.ranks is None and args.layout is None and not args.torch:
        if args.dtype or args.nonempty_ranks or args.positive_max_norm:
            raise UsageError("--dtype, --nonempty-ranks and --positive-max-norm need --ranks R or --layout L")
    try:
        if args.ranks is not None or args.torch or args.layout is not None:
            passed, text = _distributed(args)
        else:
            target = parse_target(args.target)
            verdict = judge(target, args.random, args.seed, args.timeout)
            passed = verdict.passed
            if args.json:
                text = dumps(as_json(verdict, args.random, args.seed, args.timeout))
            else:
                text = "\n".join(report(verdict, args.random, args.seed))
    except LoadError as exc:  # still exit 2, with its line; a --json reader gets an object too
        if args.json:
            print(dumps({"target": args.target, "passed": False, "error": str(exc)}), flush=True)
        raise
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`: the reader has all it wanted; the verdict stands
        closed_pipe()
    return 0 if passed else 1


main = entry(PROG, _main, on_fault=internal_error)
