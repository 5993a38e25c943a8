"""The demo's text report: the three phases of the clip, then what happened and why."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lab.cli import color
from .._lab.vectors import vector_norm
from ..gallery import STRATEGIES
from .options import Options
from .ranks import shard_for

__all__ = ["ansi_pad", "bold", "green", "num", "pname", "red", "render_text", "wrap"]

_SHOW_VALUES = 8  # print the values themselves when every shard is at most this long


def num(x: float | None, digits: int = 6) -> str:
    if x is None:
        return "undefined"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def pname(p: float) -> str:
    return "L2" if p == 2.0 else ("inf" if math.isinf(p) else f"L{p:g}")


def _powname(p: float) -> str:
    return "sum of squares" if p == 2.0 else ("max |x|" if math.isinf(p) else f"sum |x|^{p:g}")


def _root(p: float, s: str) -> str:
    return f"sqrt({s})" if p == 2.0 else (s if math.isinf(p) else f"({s})^(1/{p:g})")


def bold(text: str) -> str:
    return color(text, "1")


def green(text: str) -> str:
    return color(text, "32")


def red(text: str) -> str:
    return color(text, "31")


def render_text(report: dict, opts: Options) -> str:
    """The learner's report: the three phases, then what happened and why."""
    return "\n".join(_text_correct(report, opts) if opts.bug is None else _text_buggy(report, opts))


HINT_RANKS = 4  # the rank count the one-rank hint suggests


def _header(opts: Options, title: str, ranks: int) -> list[str]:
    lines = [bold("gclip demo: " + title)]
    if opts.simulate:
        lines += wrap(
            f"ranks: {ranks} simulated in this one process (--ranks {ranks}): the same clip engine as "
            "under mpirun; the all-reduce is a sum over a list",
            "  ",
        )
    elif ranks == 1 and opts.shards is None:
        lines += [
            "  note: this ran on 1 rank, so there was nothing to combine. Start it on several ranks:",
            f"        mpirun -n {HINT_RANKS} python -m gclip.demo ...   "
            f"or, without MPI, add --ranks {HINT_RANKS} to simulate {HINT_RANKS} ranks",
        ]
    if opts.shards is None:
        data = f"--seed {opts.seed}: {opts.size} random values per rank; the shards' norms differ on purpose"
    else:
        data = "--shards: your values, one list per rank"
    lines.append(f"  data: {data}")
    if opts.replicated:
        lines.append(
            f"        + a {len(opts.replicated)}-value bias replicated on every rank "
            f"(norm {num(vector_norm(np.asarray(opts.replicated), opts.p))}): it must count once, on rank 0"
        )
    return lines


def _local_table(report: dict, opts: Options) -> list[str]:
    p = report["norm_type"]
    rows = report.get("correct", report)["per_rank"]  # the correct run's: the input as it is
    lines = [
        bold(f"1. local: each rank reduces its own shard to one number, its {_powname(p)}"),
        f"   {'rank':>4}  {'host':<10} {'values':>7}  {_powname(p):>15}  {'local norm':>11}",
    ]
    for row, n in zip(rows, report["values_per_rank"]):
        bias = opts.replicated and row["rank"] == 0
        count = f"{n}+{len(opts.replicated)}" if bias else str(n)
        note = "  (+ the bias)" if bias else ""
        lines.append(
            f"   {row['rank']:>4}  {row['host'][:10]:<10} {count:>7}  {num(row['local_sumsq']):>15}  "
            f"{num(row['local_norm']):>11}{note}"
        )
    return lines


def _values_lines(report: dict, opts: Options) -> list[str]:
    """The values themselves, when the shards are short enough to read."""
    if any(len(s) > _SHOW_VALUES for s in report["clipped"]) or report["ranks"] > 8:
        return []
    runs = [("clipped", report["clipped"])]
    if opts.bug:
        runs = [("correct", report["correct"]["clipped"]), ("bug", report["clipped"])]
    lines = [f"   values (the shards; {'the bias is not shown' if opts.replicated else 'no bias'}):"]
    for rank in range(report["ranks"]):
        parts = [f"input {_list(shard_for(opts, rank))}"] + [f"{k} {_list(v[rank])}" for k, v in runs]
        lines.append(f"     rank {rank}:  " + "   ".join(parts))
    return lines


def _list(a: Any) -> str:
    return "[" + ", ".join(num(float(v)) for v in np.ravel(a)) + "]"


def _text_correct(report: dict, opts: Options) -> list[str]:
    p, limit = report["norm_type"], opts.limit
    norm, scale = report["global_norm"], report["scale"]
    sums = [row["local_sumsq"] for row in report["per_rank"]]
    r = report["ranks"]
    title = f"one gradient sharded over {r} rank{'s' * (r != 1)}, clipped to a global {pname(p)} norm"
    lines = _header(opts, f"{title} of at most {num(limit)}", r)
    lines += ["", *_local_table(report, opts)]
    op = "MAX" if math.isinf(p) else "SUM"
    total = max(sums) if math.isinf(p) else math.fsum(sums)
    verb = "takes the largest of" if math.isinf(p) else "adds"
    if r == 1:
        combine = f"one MPI_Allreduce({op}) over 1 rank: the result is rank 0's own number"
    elif opts.simulate:
        combine = f"the {r} numbers combined ({op}) as MPI_Allreduce would; every rank gets the result"
    else:
        combine = f"one MPI_Allreduce({op}) {verb} the {r} numbers; every rank gets the result"
    every = "rank 0 computes" if r == 1 else "every rank computes"
    who = "each rank multiplies its" if r > 1 else "rank 0 multiplies the"
    same = "" if r == 1 else f", the same on all {r} ranks"
    lines += [
        bold(f"2. all-reduce: {combine}"),
        f"   global {_powname(p)} {num(total)}  ->  global norm = "
        + ("" if math.isinf(p) else f"{_root(p, num(total))} = ")
        + bold(num(norm)),
        bold(f"3. scale: {every} scale = min(1, limit / global norm){same}"),
        f"   scale = {_scale_formula(limit, norm, scale)}; {who} shard"
        + (" (and its bias copy)" if opts.replicated else "")
        + " by it",
        f"   clipped global norm: {green(num(report['clipped_norm'], 10))} (limit {num(limit)});  "
        f"cosine with the original: {_cos(report['cosine'])}",
    ]
    lines += _values_lines(report, opts)
    lines += ["", bold("What happened:"), *wrap(" ".join(_happened_correct(report, opts)), "  ")]
    lines += [
        "Next: --buggy (each rank clips by its own norm), --buggy NAME (see --list-bugs),",
        "      --plot demo.png, --json, --shards '[[3,0],[0,4]]' --max-norm 2",
    ]
    return lines


def _scale_formula(limit: float, norm: float, scale: float) -> str:
    if norm == 0.0:
        return "1 (a zero norm: nothing to scale)"
    if not math.isfinite(norm):
        return f"1 (the norm is {norm}: gradient left untouched)"
    return f"min(1, {num(limit)} / {num(norm)}) = {num(scale)}"


def _happened_correct(report: dict, opts: Options) -> list[str]:
    norm, limit, scale, r = report["global_norm"], opts.limit, report["scale"], report["ranks"]
    if not math.isfinite(norm):
        return [
            f"  The global norm is {norm}: some value is inf or NaN. gclip leaves the gradient untouched",
            "  (scale 1, finite=False) so the caller can skip this step instead of wiping it out.",
        ]
    if norm == 0.0:
        return ["  The gradient is all zeros: its norm is 0, the scale is 1 and nothing changes."]
    if scale >= 1.0:
        return [f"  The global norm {num(norm)} is within the limit {num(limit)}: scale 1, nothing changes."]
    largest = max(report["per_rank"], key=lambda row: row["local_norm"])
    lines = [
        f"  The global norm {num(norm)} is above the limit {num(limit)}, so every shard was scaled",
        f"  by the same {num(scale)}: the whole gradient now has norm {num(report['clipped_norm'])}"
        " and points the same way.",
    ]
    if r > 1:
        lines += [
            f"  No rank can see that norm alone (the largest shard, on rank {largest['rank']}, has norm "
            f"{num(largest['local_norm'])}):",
            "  clipping each shard by its own norm breaks the limit and the direction (see --buggy).",
        ]
    return lines


def _text_buggy(report: dict, opts: Options) -> list[str]:
    bug = STRATEGIES[opts.bug or ""]
    hidden = opts.mystery is not None
    label = opts.bug_label
    c, limit = report["correct"], opts.limit
    r = report["ranks"]
    what = f"{label}, a bug of the gallery," if hidden else f"the {bug.name} bug"
    title = f"{what} next to the correct clip, {r} rank{'s' * (r != 1)}, limit {num(limit)}"
    lines = _header(opts, f"{title} ({pname(report['norm_type'])} norm)", r)
    if not hidden:
        lines += [f"  bug: {bug.summary}", f"  seen in: {bug.incident}"]
    lines += ["", *_local_table(report, opts)]
    pairs = []
    for row, good in zip(report["per_rank"], c["scales"]):
        # a scale that differs only past 6 digits (epsilon) is shown with 12 on both sides
        d = 12 if row["scale"] != good and num(row["scale"]) == num(good) else 6
        pairs.append(
            (
                f"{num(c['global_norm'])} -> {num(good, d)}",
                f"{num(row['norm'])} -> {num(row['scale'], d)}",
            )
        )
    w = max([26] + [len(left) + 2 for left, _ in pairs])
    lines += [
        bold("2-3. combine and scale: norm used -> scale, on each rank"),
        f"   {'':<26}{green('correct (global)'):<{w + ansi_pad(green(''))}}{red('bug (' + label + ')')}",
    ]
    for row, (left, right) in zip(report["per_rank"], pairs):
        lines.append(f"   {'rank ' + str(row['rank']):<26}{left:<{w}}{right}")
    good_norm, bad_norm = c["clipped_norm"], report["clipped_norm"]
    rows = [
        ("clipped global norm", _vs_limit(good_norm, limit), _vs_limit(bad_norm, limit)),
        ("cosine with the original", _cos(c["cosine"]), _cos(report["cosine"])),
        ("max |error| vs correct", "0", num(report["max_abs_error"], 3)),
    ]
    lines += [f"   {name:<26}{left:<{w}}{right}" for name, left, right in rows]
    lines.append(
        f"   the true global norm is {num(report['true_global_norm'])}: the norm every rank should have used"
    )
    if bug.name == "per-rank" and opts.replicated and not hidden:
        lines.append("   (per-rank: each rank's own norm includes its own copy of the bias)")
    lines += _values_lines(report, opts)
    lines += ["", bold("What happened:"), *wrap(" ".join(_happened_buggy(report, opts)), "  ")]
    if hidden:
        lines += [
            bold("Your turn:"),
            *wrap(
                f"Which bug of the gallery is {label}? Compare the norm each rank used with the local "
                "norms (table 1), their sum, mean and largest, the true global norm, and the number of "
                "values; python -m gclip.demo --list-bugs lists the candidates.",
                "  ",
            ),
        ]
        return lines
    lines += [bold("Why:"), *wrap(bug.explanation, "  ")]
    lines.append("Other bugs: --list-bugs; the picture: --plot demo.png")
    return lines


def _vs_limit(x: float, limit: float) -> str:
    if limit > 0 and math.isfinite(x) and x > 0:
        return f"{num(x, 10)} ({num(x / limit, 4)} x limit)"
    return num(x, 10)


def _cos(c: float | None) -> str:
    return "undefined" if c is None else f"{c:.6f}"


def ansi_pad(colored_empty: str) -> int:
    return len(colored_empty)  # ANSI codes take room in the format width but not on screen


def _happened_buggy(report: dict, opts: Options) -> list[str]:
    c, limit, bug = report["correct"], opts.limit, opts.bug
    got, want = report["clipped_norm"], c["clipped_norm"]
    if report["max_abs_error"] == 0.0:
        return ["On this data the bug gives exactly the correct result: it needs other data or more ranks."]
    out = []
    if not math.isfinite(c["global_norm"]):
        out.append(
            f"The correct global norm is {c['global_norm']}: gclip leaves the gradient untouched "
            "(finite=False) so the caller can skip the step."
        )
    if all(math.isnan(s) for s in report["scales"]):
        out.append(
            red("  Every rank's scale is NaN, so every value is now NaN (the step is lost):")
            + f" the norm used was {report['norms_used'][0]}, the correct one {num(c['global_norm'])}."
        )
    elif not report["same_on_all_ranks"]:
        out.append("  The ranks used different norms and scales: there was no global norm at all.")
    if got == 0.0 and want > 0.0:
        out.append(red("  The gradient was wiped out: every value is now 0 (the step is lost)."))
    elif math.isfinite(got) and math.isfinite(want) and want > 0:
        rel = got / want
        if abs(rel - 1) < 1e-6:
            out.append(
                f"  The clipped norm {num(got, 10)} is off by only {num(abs(rel - 1), 2)} (relative), but "
                f"values differ by up to {num(report['max_abs_error'], 2)}: not the exact contract."
            )
        elif rel > 1 + 1e-9:
            out.append(
                f"  The clipped gradient has norm {num(got)}, {num(rel, 4)} x what the limit allows: "
                + red("clipped too little.")
            )
        elif rel < 1 - 1e-9:
            out.append(
                f"  The clipped gradient has norm {num(got)}, {num(rel, 4)} x the correct {num(want)}: "
                + red("clipped too hard.")
            )
    cos = report["cosine"]
    if cos is not None and cos < 1 - 1e-9:
        out.append(
            f"  Cosine {num(cos, 6)} with the original: " + red("the gradient's direction changed") + ","
        )
        out.append("  not just its length: no optimizer step size can undo that.")
    elif cos is not None:
        out.append("  The direction is unchanged (same scale on every rank); only the length is wrong.")
    if bug == "per-rank" and limit > 0 and opts.mystery is None:
        r = report["ranks"]
        out.append(
            f"  Per-rank clipping bounds each shard by the limit, so the whole gradient only by "
            f"sqrt({r}) x {num(limit)} = {num(math.sqrt(r) * limit)}."
        )
    return out


def wrap(text: str, indent: str, width: int = 100) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width - len(indent):
            lines.append(indent + line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    if line:
        lines.append(indent + line)
    return lines
