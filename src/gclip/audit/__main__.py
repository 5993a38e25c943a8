"""``python -m gclip.audit [options] SCRIPT [ARGS...]``: see :mod:`gclip.audit`."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

USAGE = (
    "torchrun --nproc-per-node N -m gclip.audit [--max-norm X | --adaptive CLIPPER] [--steps K] "
    "[--json FILE] SCRIPT [ARGS...]"
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gclip.audit",
        usage=USAGE,
        description="Run a training script unmodified and audit the clip of every optimizer step.",
    )
    parser.add_argument(
        "--max-norm",
        type=float,
        default=None,
        help="the limit the script clips to "
        "(default: the max_norm its clip function is called with, else inferred)",
    )
    parser.add_argument(
        "--adaptive",
        default=None,
        metavar="CLIPPER",
        help="the script clips adaptively: zclip or autoclip, with options "
        "(zclip:warmup_steps=10,max_grad_norm=2); each step's limit is the rule's on the true "
        "global norm, and the bugs of adaptive limits are candidates",
    )
    parser.add_argument("--steps", type=int, default=None, help="audit the first K steps only")
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write one JSON object per step (rank 0's report), one per line",
    )
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--replicated",
        action="store_true",
        help="plain (non-DTensor, non-DDP) gradients are copies on every rank",
    )
    layout.add_argument(
        "--sharded", action="store_true", help="plain (non-DTensor, non-DDP) gradients are this rank's own"
    )
    parser.add_argument("--quiet", action="store_true", help="print the summary only, not every step")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    if ns.max_norm is not None and not ns.max_norm >= 0:
        parser.error(f"--max-norm must be >= 0, got {ns.max_norm}")
    if ns.steps is not None and ns.steps < 1:
        parser.error(f"--steps must be >= 1, got {ns.steps}")
    if ns.adaptive is not None:
        if ns.max_norm is not None:
            parser.error("--adaptive takes the limit from the clipper's rule: drop --max-norm")
        from ..conformance.limits import threshold

        try:
            threshold(ns.adaptive)
        except (ValueError, TypeError) as exc:
            parser.error(f"--adaptive {ns.adaptive}: {exc}")
    if not os.path.isfile(ns.script):
        parser.error(f"no such script: {ns.script}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    from .auditor import Auditor
    from .report import Summary

    plain = "replicated" if ns.replicated else "sharded" if ns.sharded else "auto"
    summary = Summary(ns.json, quiet=ns.quiet)
    auditor = Auditor(
        max_norm=ns.max_norm, steps=ns.steps, plain=plain, report=summary.add, adaptive=ns.adaptive
    )
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    code: Any = 0
    with auditor:
        try:
            runpy.run_path(ns.script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code
    status = summary.close()
    if code not in (0, None):
        return code if isinstance(code, int) else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
