"""``python -m gclip.audit [options] SCRIPT [ARGS...]``: see :mod:`gclip.audit`."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

USAGE = (
    "torchrun --nproc-per-node N -m gclip.audit [--max-norm X | --adaptive CLIPPER | --max-norms X,Y "
    "| --agc] [--steps K] "
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
    parser.add_argument(
        "--max-norms",
        default=None,
        metavar="X,Y,...",
        help="the script clips each optimizer parameter group by its own limit, one per group "
        "(none: not clipped; Muon's groups, say): every group's scale is graded against its own "
        "rule, one clip over every group is a candidate (muon-global-clip)",
    )
    parser.add_argument(
        "--agc",
        action="store_true",
        help="the script clips unit-wise (AGC: rows of a matrix, output channels): every unit's "
        "factor is graded against the rule on the unit's whole norms, each shard's own part of "
        "them is a candidate (agc-shard-units)",
    )
    parser.add_argument("--agc-clipping", type=float, default=0.01, metavar="X", help="AGC's clipping (0.01)")
    parser.add_argument("--agc-eps", type=float, default=1e-3, metavar="Y", help="AGC's eps (0.001)")
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
    given = [
        f
        for f, v in (
            ("--max-norm", ns.max_norm),
            ("--adaptive", ns.adaptive),
            ("--max-norms", ns.max_norms),
            ("--agc", ns.agc or None),
        )
        if v is not None
    ]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} name different limits: give one")
    if ns.max_norms is not None:
        from .limits import max_norms

        try:
            ns.max_norms = max_norms(ns.max_norms)
        except ValueError as exc:
            parser.error(f"--max-norms {ns.max_norms}: {exc}")
    if ns.agc:
        if not ns.agc_clipping > 0 or not ns.agc_eps >= 0:
            parser.error(
                f"--agc: clipping must be > 0 and eps >= 0, got {ns.agc_clipping:g} and {ns.agc_eps:g}"
            )
        ns.agc = (ns.agc_clipping, ns.agc_eps)
    else:
        ns.agc = None
    if ns.adaptive is not None:
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
    from .limits import AuditError
    from .report import Summary

    plain = "replicated" if ns.replicated else "sharded" if ns.sharded else "auto"
    summary = Summary(ns.json, quiet=ns.quiet)
    auditor = Auditor(
        max_norm=ns.max_norm,
        steps=ns.steps,
        plain=plain,
        report=summary.add,
        adaptive=ns.adaptive,
        max_norms=ns.max_norms,
        agc=ns.agc,
    )
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    code: Any = 0
    with auditor:
        try:
            runpy.run_path(ns.script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code
        except AuditError as exc:  # graded from the same rows on every rank: raised on every rank
            print(f"gclip.audit: {exc}", file=sys.stderr, flush=True)
            _wait_for_the_others()
            return 2
    status = summary.close()
    if code not in (0, None):
        return code if isinstance(code, int) else 1
    return status


def _wait_for_the_others() -> None:
    """Every rank has its line out before any exits (torchrun ends the others at the first exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
