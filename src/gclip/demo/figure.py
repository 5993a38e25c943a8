"""The demo's figure: local norms vs the limit, the scale on each rank, the clipped norm as ranks grow."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._lab import plots
from .._lab.cli import UsageError, check_writable
from .._lab.vectors import vector_norm
from ..gallery import GLOBAL, clip_simulated
from .options import Options
from .ranks import grads_for, shard_for, whole
from .text import num, pname

__all__ = ["SWEEP_RANKS", "check_plot", "norms_panel", "render_layout_plot", "render_plot", "sweep"]

SWEEP_RANKS = 16  # the third panel simulates R = 1..SWEEP_RANKS ranks


def sweep(opts: Options, modes: Sequence[str], max_ranks: int = SWEEP_RANKS) -> dict[str, list[float]]:
    """The clipped global norm for R = 1..max_ranks simulated ranks, per mode.

    Rank r holds the shard it would hold in the demo (the given shards repeat).
    """
    out: dict[str, list[float]] = {m: [] for m in modes}
    for n in range(1, max_ranks + 1):
        ranks = [grads_for(opts, shard_for(opts, r)) for r in range(n)]
        flags = ranks[0][1]
        for m in modes:
            res = clip_simulated(
                [g for g, _ in ranks],
                opts.limit,
                norm_type=opts.p,
                mode=m,
                reproducible=opts.reproducible,
                replicated=flags,
            )
            out[m].append(vector_norm(whole([list(r.grads) for r in res]), opts.p))
    return out


def norms_panel(report: dict, opts: Options) -> dict[str, list[float]]:
    """Panel 1's bars, per rank: the local norm (what the rank counts: the bias on rank 0
    only) and, beside a bug, the norm the bug's scale was computed from on that rank
    (per-rank: its own shard and its own copy of the bias)."""
    c = report.get("correct", report)
    series = {"local norm (counted once)": [row["local_norm"] for row in c["per_rank"]]}
    if "correct" in report:
        series[f"norm used by the bug ({opts.bug_label})"] = [row["norm"] for row in report["per_rank"]]
    return series


def render_plot(report: dict, opts: Options, path: str) -> int:
    """The slide: the norms each rank used vs the limit, per-rank scales, the clipped norm as ranks grow."""
    col = plots.COLORS
    bug = opts.bug_label if opts.bug else None
    c = report.get("correct", report)
    fig, (a1, a2, a3) = plots.figure(3, title=_plot_title(report, opts))
    labels = [f"rank {row['rank']}" for row in report["per_rank"]]
    norms = norms_panel(report, opts)
    names = list(norms)
    plots.bars(
        a1,
        labels,
        norms,
        title="1. Each rank's own norm, and the norm it used"
        if bug
        else "1. Each rank sees only its own norm",
        ylabel=f"{pname(opts.p)} norm (log)",
        colors={names[0]: col["neutral"], **({names[1]: col["bug"]} if bug else {})},
        hlines={
            f"true global norm {num(c['global_norm'], 4)}": (c["global_norm"], col["correct"]),
            f"limit {num(opts.limit)}": (opts.limit, col["limit"]),
        },
        log=True,
    )
    scales = {"correct (global)": [r["scale"] for r in c["per_rank"]]}
    if bug:
        scales[f"bug ({bug})"] = [r["scale"] for r in report["per_rank"]]
    plots.bars(
        a2,
        labels,
        scales,
        title="2. The scale each rank applies",
        ylabel="scale = min(1, limit / norm used)",
        colors={"correct (global)": col["correct"], f"bug ({bug})": col["bug"]},
    )
    # the per-rank curve is the reference, unless it would name a mystery (or is the bug itself)
    reference = [] if opts.mystery or opts.bug == "per-rank" else ["per-rank"]
    modes = [GLOBAL.name, *reference] + ([opts.bug] if opts.bug else [])
    curves = sweep(opts, modes)
    xs = list(range(1, SWEEP_RANKS + 1))
    series = {"correct (global)": curves[GLOBAL.name]}
    colors = {"correct (global)": col["correct"]}
    if reference:
        series["per-rank"] = curves["per-rank"]
        colors["per-rank"] = col["other"]
    if opts.bug:
        series[f"bug ({bug})"] = curves[opts.bug]
        colors[f"bug ({bug})"] = col["bug"]
    series["sqrt(R) x limit"] = [math.sqrt(n) * opts.limit for n in xs]
    colors["sqrt(R) x limit"] = col["bound"]
    finite = [v for ys in series.values() for v in ys if math.isfinite(v) and v > 0]
    spread = max(finite) / min(finite) if finite else 1.0
    plots.lines(
        a3,
        xs,
        series,
        title="3. Clipped global norm as the ranks grow",
        xlabel="ranks R (simulated)",
        ylabel=f"{pname(opts.p)} norm after clipping",
        colors=colors,
        dashed=["sqrt(R) x limit"],
        log=spread > 30,
    )
    a3.axhline(opts.limit, color=col["limit"], linestyle="--", linewidth=1, label=f"limit {num(opts.limit)}")
    a3.legend(fontsize=8, loc="upper left")
    return plots.save(fig, path)


def _plot_title(report: dict, opts: Options) -> str:
    r = report["ranks"]
    what = f"the {opts.bug_label} bug vs the correct clip" if opts.bug else "clipping by the global norm"
    return f"gclip: {what} ({r} rank{'s' * (r != 1)}, limit {num(opts.limit)})"


def check_plot(opts: Options, comm: Any) -> None:
    """Rank 0 checks that the plot can be made; every rank learns the verdict before any clip.

    ``comm`` None: one process (``--ranks``), no MPI."""
    problem = None
    if comm is None or comm.Get_rank() == 0:
        try:
            plots.require()
            check_writable("--plot", opts.plot or "")
        except UsageError as exc:
            problem = str(exc)
    if comm is not None:
        problem = comm.bcast(problem, root=0)
    if problem:
        raise UsageError(problem)


# the colour of each kind of tensor in the layout figure
KIND_COLORS = {
    "tied embedding": "#e9c46a",
    "embedding (tied to the head)": "#e9c46a",
    "tp-shard": "#8ecae6",
    "tp-duplicate": "#2a9d8f",
    "expert": "#b5838d",
}


def render_layout_plot(report: dict, opts: Options, path: str) -> int:
    """The layout's slide: who holds what, who counts what (by kind of tensor, per rank), and the
    norm each rank clipped by, correct against the bug's, next to the model's norm."""
    col = plots.COLORS
    fig, (a1, a2, a3) = plots.figure(3, title=_layout_title(report, opts), width=5.6)
    holdings = report["holdings"]
    ranks = [str(h["rank"]) for h in holdings]
    kinds = list(dict.fromkeys(k for h in holdings for k in h["held"]))
    finite = math.isfinite(report["norm_type"])
    what = "sum of squares" if report["norm_type"] == 2 else f"sum of |x|^{num(report['norm_type'])}"
    for ax, which, title, ylabel, scale in (
        (a1, "held", "1. Who holds what", "values held", 1.0),
        (
            a2,
            "counted_share",
            f"2. Who counts what: the {what} each rank adds",
            f"% of the model's {what}",
            100.0,
        )
        if finite
        else (a2, "counted", "2. Who counts what", "values counted", 1.0),
    ):
        bottom = [0.0] * len(holdings)
        for kind in kinds:
            heights = [h[which].get(kind, 0) * scale for h in holdings]
            ax.bar(ranks, heights, 0.7, bottom=bottom, label=kind, color=KIND_COLORS.get(kind))
            bottom = [b + v for b, v in zip(bottom, heights)]
        ax.set_xlabel("rank")
        ax.set_ylim(0, max(max(bottom), 1e-300) * 1.3)
        plots.finish(ax, title, ylabel)
    c = report["correct"]
    series = {"correct": [r["norm"] for r in c["per_rank"]]}
    colors = {"correct": col["correct"]}
    if "bug_run" in report and not report["bug_run"]["note"]:
        label = f"mystery {opts.mystery}" if opts.mystery else report["bug"]["name"]
        series[label] = [r["norm"] for r in report["bug_run"]["per_rank"]]
        colors[label] = col["bug"]
        factor = report["bug_run"]["clipped_norm"] / opts.limit if opts.limit > 0 else math.nan
        title = f"3. The norm each rank clipped by\n(the update: {num(factor, 4)} x the limit)"
    elif "bug_run" in report:  # the hang: no rank got a norm from the bug's all-reduce
        title = "3. The norm each rank clipped by\n(the bug: none, its all-reduce never completed)"
    else:
        title = "3. The norm each rank clipped by"
    plots.bars(
        a3,
        ranks,
        series,
        title=title,
        ylabel=f"{pname(report['norm_type'])} norm",
        colors=colors,
        hlines={f"the model's norm {num(report['model_norm'], 6)}": (report["model_norm"], col["limit"])},
        annotate=False,
    )
    a3.set_xlabel("rank")
    return plots.save(fig, path)


def _layout_title(report: dict, opts: Options) -> str:
    what = f"the {opts.bug_label} bug vs the correct clip" if opts.bug else "clipping by the global norm"
    sim = ", simulated" if report["simulated"] else ""
    return f"gclip: {what}, layout {report['layout']} ({report['ranks']} ranks{sim})"
