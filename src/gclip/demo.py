"""The teaching demo: one gradient sharded over the MPI ranks, clipped by its global norm.

Each rank holds one shard of a gradient (seeded random values, of a different
magnitude on each rank, or ``--shards``), plus a small tensor replicated on every
rank, like a bias. Rank 0 prints the three phases of a correct clip, on every
rank: local (each rank's sum of squares) -> all-reduce (the global norm) ->
scale (the same factor everywhere). ``--buggy NAME`` runs a bug of the gallery
on the same data next to the correct clip and shows what it breaks.

usage:: mpiexec -n 4 python -m gclip.demo [--buggy [NAME]] [--shards JSON] [--limit X]
                                          [--json] [--plot FILE.png] [--list-bugs]

The default data makes every bug of the gallery visible on 4 ranks: the
ranks' shards differ by up to 8x in norm (so per-rank, rank-0, mean and max
norms all differ), rank 1's sum of squares (160000) overflows float16, every
value is far above the default limit 1 (so the inf-norm bug shows too), and
the replicated bias (norm 50) is counted once.

``--json`` prints one JSON object on one line (rank 0). Non-finite floats are
written as the strings "inf", "-inf" and "nan" (strict JSON has no such
numbers; Python's ``float()`` reads them back). ``global_norm`` and ``scale``
are the values rank 0 used; ``same_on_all_ranks`` says whether every rank
used the same (the per-rank bug does not), and ``per_rank`` lists them all.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._lab import cli as _cli
from ._lab.cli import UsageError
from ._validate import max_norm as validate_limit
from .clip import clip_by_global_norm, clip_simulated
from .contract import rounded
from .errors import GclipError
from .strategies import BUGS, GLOBAL, STRATEGIES

__all__ = ["Options", "main", "parse_args", "random_shard", "run", "sweep"]

PROG = "gclip.demo"
DEFAULT_SIZE = 1000
DEFAULT_LIMIT = 1.0
DEFAULT_REPLICATED = (30.0, -40.0)
TOP_NORM = 400.0  # the largest shard's norm; rank r's is TOP_NORM / 2**_PATTERN[r % 4]
_PATTERN = (2, 0, 3, 1)  # 4 ranks: norms 100, 400, 50, 200 (the largest is not on rank 0)
MAX_SIZE = 10**6  # a demo gathers everything on rank 0
SWEEP_RANKS = 16
_SHOW_VALUES = 8  # print the values themselves when every shard is at most this long


@dataclass(frozen=True)
class Options:
    shards: list[list[float]] | None  # None: seeded random shards
    replicated: list[float]
    limit: float
    norm_type: float | None  # None: 2, or the bug's own (inf-pow: inf)
    seed: int
    size: int
    bug: str | None
    reproducible: bool
    json: bool
    plot: str | None
    list_bugs: bool

    @property
    def mode(self) -> str:
        return self.bug or GLOBAL.name

    @property
    def p(self) -> float:
        if self.norm_type is not None:
            return self.norm_type
        if self.bug and STRATEGIES[self.bug].norm_type is not None:
            return float(STRATEGIES[self.bug].norm_type)  # type: ignore[arg-type]
        return 2.0


# ---------------------------------------------------------------------------
# arguments: every rank parses the same argv, so every rank fails together


def _parser() -> _cli.ArgParser:
    names = [b.name for b in BUGS]
    p = _cli.ArgParser(
        prog="mpiexec -n 4 python -m gclip.demo",
        description="Clip one gradient sharded over the MPI ranks by its global norm, phase by phase.",
    )
    p.add_argument(
        "--buggy",
        nargs="?",
        const="per-rank",
        choices=names,
        metavar="NAME",
        help="also run a gallery bug on the same data, side by side (alone: per-rank; see --list-bugs)",
    )
    p.add_argument("--shards", metavar="JSON", help="one list of numbers per rank, e.g. '[[3,0],[0,4]]'")
    p.add_argument("--limit", default=str(DEFAULT_LIMIT), metavar="X", help="the max norm (default 1)")
    p.add_argument("--norm-type", metavar="P", help="p > 0 or inf (default 2; inf-pow: inf)")
    p.add_argument(
        "--replicated",
        metavar="JSON",
        help="values of a tensor replicated on every rank, counted once "
        f"(default {list(DEFAULT_REPLICATED)}; [] with --shards)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random shards (default 0)")
    p.add_argument("--size", type=int, default=DEFAULT_SIZE, help="values per rank (default 1000)")
    p.add_argument("--reproducible", action="store_true", help="exact binned sums: same bits for any layout")
    p.add_argument("--json", action="store_true", help="one JSON object on one line instead of the report")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figure (needs matplotlib)")
    p.add_argument("--list-bugs", action="store_true", help="list the bug gallery and exit")
    return p


def parse_args(argv: Sequence[str] | None, ranks: int | None) -> Options:
    """Options from argv, validated; bad input raises a one-line UsageError.

    ``ranks`` is the number of ranks ``--shards`` must match (None: not checked).
    """
    ns = _parser().parse_args(argv)
    if ns.list_bugs:
        return Options(None, [], DEFAULT_LIMIT, None, 0, 0, None, False, ns.json, None, True)
    if ns.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {ns.seed}")
    if not 0 <= ns.size <= MAX_SIZE:
        raise UsageError(f"--size must be between 0 and {MAX_SIZE}, got {ns.size}")
    if ns.plot is not None and not ns.plot.strip():
        raise UsageError("--plot needs a file name")
    shards, limit, replicated, p = parse_data(ns.shards, ns.limit, ns.replicated, ns.norm_type, ranks)
    return Options(
        shards, replicated, limit, p, ns.seed, ns.size, ns.buggy, ns.reproducible, ns.json, ns.plot, False
    )


def parse_data(
    shards: str | None,
    limit: str,
    replicated: str | None = None,
    norm_type: str | None = None,
    ranks: int | None = None,
) -> tuple[list[list[float]] | None, float, list[float], float | None]:
    """(shards, limit, replicated, norm_type) from the command-line texts: JSON only, never eval.

    Values must be finite real numbers (not booleans); ``shards`` is a list
    with one flat list per rank. Anything else is a one-line UsageError.
    """
    values = None
    if shards is not None:
        data = _json(shards, "--shards")
        if not isinstance(data, list) or not all(isinstance(s, list) for s in data):
            raise UsageError(f"--shards must be a list of lists of numbers (one per rank), got {_kind(data)}")
        if ranks is not None and len(data) != ranks:
            raise UsageError(
                f"--shards has {len(data)} shard{'s' * (len(data) != 1)} for {ranks} "
                f"rank{'s' * (ranks != 1)}: give one list per rank (mpiexec -n {len(data)})"
            )
        values = [_numbers(s, f"--shards[{i}]") for i, s in enumerate(data)]
    if replicated is None:
        reps = [] if values is not None else list(DEFAULT_REPLICATED)
    else:
        reps = _numbers(_json(replicated, "--replicated"), "--replicated")
    return values, _limit(limit), reps, _norm_type(norm_type)


def _json(text: str, flag: str) -> Any:
    def constant(name: str) -> None:
        raise UsageError(f"{flag}: {name} is not allowed, values must be finite numbers")

    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise UsageError(f"{flag}: the JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, too many digits
        raise UsageError(f"{flag}: not valid JSON ({exc})") from None


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object"


def _numbers(items: Any, where: str) -> list[float]:
    if not isinstance(items, list):
        raise UsageError(f"{where} must be a list of numbers, got {_kind(items)}")
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UsageError(f"{where} item {i} must be a number, got {_kind(v)}")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise UsageError(f"{where} item {i} is too large: values must be finite numbers")
        out.append(f)
    return out


def _limit(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"--limit must be a number, got {_show(text)}") from None
    try:
        return validate_limit(value, "--limit")
    except GclipError as exc:
        raise UsageError(str(exc)) from None


def _norm_type(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        p = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"--norm-type must be a number > 0 or inf, got {_show(text)}") from None
    if math.isnan(p) or p <= 0:
        raise UsageError(f"--norm-type must be a number > 0 or inf, got {_show(text)}")
    return p


def _show(text: str, width: int = 40) -> str:
    return ascii(text if len(text) <= width else text[:width] + "...")


# ---------------------------------------------------------------------------
# the data


def random_shard(seed: int, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s seeded random shard: a random direction scaled to a round norm.

    The norms cycle through 100, 400, 50, 200 (x TOP_NORM / 400) over the ranks.
    """
    x = np.random.default_rng([seed, rank]).standard_normal(size)
    n = float(np.linalg.norm(x))
    return x * (TOP_NORM / 2.0 ** _PATTERN[rank % len(_PATTERN)] / n) if n > 0 else x


def shard_for(opts: Options, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard (the given shards repeat when ``rank`` is past them)."""
    if opts.shards is not None:
        return np.asarray(opts.shards[rank % len(opts.shards)], dtype=np.float64)
    return random_shard(opts.seed, rank, opts.size)


def _grads(opts: Options, shard: np.ndarray) -> tuple[list[np.ndarray], list[bool]]:
    if not opts.replicated:
        return [shard], [False]
    return [shard, np.asarray(opts.replicated, dtype=np.float64)], [False, True]


# ---------------------------------------------------------------------------
# running on the ranks


def run(opts: Options, comm: Any) -> dict | None:
    """Clip on every rank of ``comm`` (correct, and the bug if any); rank 0 gets the report."""
    rank = comm.Get_rank()
    shard = shard_for(opts, rank)
    grads, flags = _grads(opts, shard)
    mine: dict[str, Any] = {"rank": rank, "host": _host(), "grads": grads, "runs": {}}
    for mode in dict.fromkeys([GLOBAL.name, opts.mode]):
        res = clip_by_global_norm(
            grads,
            opts.limit,
            comm=comm,
            norm_type=opts.p,
            mode=mode,
            reproducible=opts.reproducible,
            replicated=flags,
        )
        mine["runs"][mode] = {
            "local_sumsq": float(res.local_power),
            "local_norm": float(res.local_norm),
            "norm": float(res.total_norm),
            "scale": float(res.scale),
            "finite": bool(res.finite),
            "grads": res.grads,
        }
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    return build_report(opts, gathered)


def _host() -> str:
    from mpi4py import MPI

    return MPI.Get_processor_name()


def build_report(opts: Options, gathered: list[dict]) -> dict:
    """The whole story on rank 0, from what every rank sent (pure; JSON-ready but for arrays)."""
    p = opts.p
    original = _whole([g["grads"] for g in gathered])
    report: dict[str, Any] = {
        "mode": opts.mode,
        "ranks": len(gathered),
        "limit": opts.limit,
        "norm_type": p,
        "reproducible": opts.reproducible,
        "data": _data_info(opts),
        "values": [int(g["grads"][0].size) for g in gathered],
        "replicated": list(opts.replicated),
        "input_norm": _pnorm(original, p),
    }
    correct = _summary(gathered, GLOBAL.name, p, original)
    report.update(correct if opts.bug is None else _summary(gathered, opts.bug, p, original))
    if opts.bug is None:
        report["max_abs_error"] = 0.0
        return report
    keep = ("global_norm", "scale", "clipped", "clipped_replicated", "clipped_norm", "cosine", "per_rank")
    report["correct"] = {k: correct[k] for k in keep}
    report["correct"]["scales"] = [r["scale"] for r in correct["per_rank"]]
    report["max_abs_error"] = _max_error(gathered, opts.bug, GLOBAL.name)
    report["bug"] = STRATEGIES[opts.bug].as_dict()
    return report


def _data_info(opts: Options) -> dict:
    if opts.shards is not None:
        return {"source": "shards"}
    return {"source": "seed", "seed": opts.seed, "size": opts.size}


def _whole(per_rank_grads: list[list[np.ndarray]]) -> np.ndarray:
    """The gradient as one vector: every shard, and the replicated tensor once (rank 0's copy)."""
    parts = [g[0] for g in per_rank_grads]
    if per_rank_grads and len(per_rank_grads[0]) > 1:
        parts.append(per_rank_grads[0][1])
    return np.concatenate([np.ravel(a) for a in parts]) if parts else np.zeros(0)


def _summary(gathered: list[dict], mode: str, p: float, original: np.ndarray) -> dict:
    runs = [g["runs"][mode] for g in gathered]
    clipped = _whole([r["grads"] for r in runs])
    first = runs[0]
    return {
        "global_norm": first["norm"],
        "scale": first["scale"],
        "same_on_all_ranks": all(r["norm"] == first["norm"] and r["scale"] == first["scale"] for r in runs),
        "finite": all(r["finite"] for r in runs),
        "clipped": [r["grads"][0] for r in runs],
        "clipped_replicated": [r["grads"][1] for r in runs] if len(first["grads"]) > 1 else [],
        "clipped_norm": _pnorm(clipped, p),
        "cosine": _cosine(clipped, original),
        "per_rank": [
            {
                "rank": g["rank"],
                "host": g["host"],
                "local_sumsq": r["local_sumsq"],
                "local_norm": r["local_norm"],
                "norm": r["norm"],
                "scale": r["scale"],
            }
            for g, r in zip(gathered, runs)
        ],
    }


def _max_error(gathered: list[dict], mode: str, reference: str) -> float:
    worst = 0.0
    for g in gathered:
        for a, b in zip(g["runs"][mode]["grads"], g["runs"][reference]["grads"]):
            if a.size:
                with np.errstate(invalid="ignore", over="ignore"):
                    d = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                worst = d if math.isnan(d) else max(worst, d)
    return worst


def _pnorm(x: np.ndarray, p: float) -> float:
    """The p-norm of a vector, scaled first so that huge or tiny values neither overflow nor vanish."""
    if x.size == 0:
        return 0.0
    a = np.abs(x.astype(np.float64))
    m = float(np.max(a))
    if m == 0.0 or not math.isfinite(m):
        return m
    if math.isinf(p):
        return m
    return m * float(np.sum((a / m) ** p)) ** (1.0 / p)


def _cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    """cos of the angle between two vectors; None if either is zero or not finite."""
    if a.size == 0 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    ma, mb = float(np.max(np.abs(a))), float(np.max(np.abs(b)))
    if ma == 0.0 or mb == 0.0:
        return None
    u, v = a / ma, b / mb
    c = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
    return max(-1.0, min(1.0, c))


# ---------------------------------------------------------------------------
# JSON


def to_json(report: dict) -> str:
    """One line of strict JSON; clipped values rounded to 12 decimals as the seed contract."""
    out = dict(report)
    out["norm_type"] = _jfloat(report["norm_type"])
    out["clipped"] = [rounded(s) for s in report["clipped"]]
    out["clipped_replicated"] = [rounded(s) for s in report["clipped_replicated"]]
    if "correct" in report:
        c = dict(report["correct"])
        c["clipped"] = [rounded(s) for s in c["clipped"]]
        c["clipped_replicated"] = [rounded(s) for s in c["clipped_replicated"]]
        out["correct"] = c
    return json.dumps(_jsonable(out), allow_nan=False, separators=(",", ":"))


def _jfloat(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (float, np.floating)):
        return _jfloat(float(x))
    return x


# ---------------------------------------------------------------------------
# the text report


def _num(x: float | None, digits: int = 6) -> str:
    if x is None:
        return "undefined"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def _pname(p: float) -> str:
    return "L2" if p == 2.0 else ("inf" if math.isinf(p) else f"L{p:g}")


def _powname(p: float) -> str:
    return "sum of squares" if p == 2.0 else ("max |x|" if math.isinf(p) else f"sum |x|^{p:g}")


def _root(p: float, s: str) -> str:
    return f"sqrt({s})" if p == 2.0 else (s if math.isinf(p) else f"({s})^(1/{p:g})")


def _b(text: str) -> str:
    return _cli.color(text, "1")


def _ok(text: str) -> str:
    return _cli.color(text, "32")


def _bad(text: str) -> str:
    return _cli.color(text, "31")


def render_text(report: dict, opts: Options) -> str:
    """The learner's report: the three phases, then what happened and why."""
    return "\n".join(_text_correct(report, opts) if opts.bug is None else _text_buggy(report, opts))


def _header(opts: Options, title: str) -> list[str]:
    lines = [_b("gclip demo: " + title)]
    if opts.shards is None:
        data = f"--seed {opts.seed}: {opts.size} random values per rank; the shards' norms differ on purpose"
    else:
        data = "--shards: your values, one list per rank"
    lines.append(f"  data: {data}")
    if opts.replicated:
        lines.append(
            f"        + a {len(opts.replicated)}-value bias replicated on every rank "
            f"(norm {_num(_pnorm(np.asarray(opts.replicated), opts.p))}): it must count once, on rank 0"
        )
    return lines


def _local_table(report: dict, opts: Options) -> list[str]:
    p = report["norm_type"]
    rows = report.get("correct", report)["per_rank"]  # the correct run's: the input as it is
    lines = [
        _b(f"1. local: each rank reduces its own shard to one number, its {_powname(p)}"),
        f"   {'rank':>4}  {'host':<10} {'values':>7}  {_powname(p):>15}  {'local norm':>11}",
    ]
    for row, n in zip(rows, report["values"]):
        bias = opts.replicated and row["rank"] == 0
        count = f"{n}+{len(opts.replicated)}" if bias else str(n)
        note = "  (+ the bias)" if bias else ""
        lines.append(
            f"   {row['rank']:>4}  {row['host'][:10]:<10} {count:>7}  {_num(row['local_sumsq']):>15}  "
            f"{_num(row['local_norm']):>11}{note}"
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
    return "[" + ", ".join(_num(float(v)) for v in np.ravel(a)) + "]"


def _text_correct(report: dict, opts: Options) -> list[str]:
    p, limit = report["norm_type"], opts.limit
    norm, scale = report["global_norm"], report["scale"]
    sums = [row["local_sumsq"] for row in report["per_rank"]]
    r = report["ranks"]
    title = f"one gradient sharded over {r} rank{'s' * (r != 1)}, clipped to a global {_pname(p)} norm"
    lines = _header(opts, f"{title} of at most {_num(limit)}")
    lines += ["", *_local_table(report, opts)]
    op = "MAX" if math.isinf(p) else "SUM"
    total = max(sums) if math.isinf(p) else math.fsum(sums)
    verb = "takes the largest of" if math.isinf(p) else "adds"
    lines += [
        _b(f"2. all-reduce: one MPI_Allreduce({op}) {verb} the {r} numbers; every rank gets the result"),
        f"   global {_powname(p)} {_num(total)}  ->  global norm = "
        + ("" if math.isinf(p) else f"{_root(p, _num(total))} = ")
        + _b(_num(norm)),
        _b(f"3. scale: every rank computes scale = min(1, limit / global norm), the same on all {r} ranks"),
        f"   scale = {_scale_formula(limit, norm, scale)}; each rank multiplies its shard"
        + (" (and its bias copy)" if opts.replicated else "")
        + " by it",
        f"   clipped global norm: {_ok(_num(report['clipped_norm'], 10))} (limit {_num(limit)});  "
        f"cosine with the original: {_cos(report['cosine'])}",
    ]
    lines += _values_lines(report, opts)
    lines += ["", _b("What happened:"), *_wrap(" ".join(_happened_correct(report, opts)), "  ")]
    lines += [
        "Next: --buggy (each rank clips by its own norm), --buggy NAME (see --list-bugs),",
        "      --plot demo.png, --json, --shards '[[3,0],[0,4]]' --limit 2",
    ]
    return lines


def _scale_formula(limit: float, norm: float, scale: float) -> str:
    if norm == 0.0:
        return "1 (a zero norm: nothing to scale)"
    if not math.isfinite(norm):
        return f"1 (the norm is {norm}: gradient left untouched)"
    return f"min(1, {_num(limit)} / {_num(norm)}) = {_num(scale)}"


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
        return [
            f"  The global norm {_num(norm)} is within the limit {_num(limit)}: scale 1, nothing changes."
        ]
    largest = max(report["per_rank"], key=lambda row: row["local_norm"])
    lines = [
        f"  The global norm {_num(norm)} is above the limit {_num(limit)}, so every shard was scaled",
        f"  by the same {_num(scale)}: the whole gradient now has norm {_num(report['clipped_norm'])}"
        " and points the same way.",
    ]
    if r > 1:
        lines += [
            f"  No rank can see that norm alone (the largest shard, on rank {largest['rank']}, has norm "
            f"{_num(largest['local_norm'])}):",
            "  clipping each shard by its own norm breaks the limit and the direction (see --buggy).",
        ]
    return lines


def _text_buggy(report: dict, opts: Options) -> list[str]:
    bug = STRATEGIES[opts.bug or ""]
    c, limit = report["correct"], opts.limit
    r = report["ranks"]
    title = f"the {bug.name} bug next to the correct clip, {r} rank{'s' * (r != 1)}, limit {_num(limit)}"
    lines = _header(opts, f"{title} ({_pname(report['norm_type'])} norm)")
    lines += [f"  bug: {bug.summary}", f"  seen in: {bug.incident}", ""]
    lines += _local_table(report, opts)
    w = 26
    lines += [
        _b("2-3. combine and scale: norm used -> scale, on each rank"),
        f"   {'':<26}{_ok('correct (global)'):<{w + _pad(_ok(''))}}{_bad('bug (' + bug.name + ')')}",
    ]
    for row, good in zip(report["per_rank"], c["scales"]):
        left = f"{_num(c['global_norm'])} -> {_num(good)}"
        right = f"{_num(row['norm'])} -> {_num(row['scale'])}"
        lines.append(f"   {'rank ' + str(row['rank']):<26}{left:<{w}}{right}")
    good_norm, bad_norm = c["clipped_norm"], report["clipped_norm"]
    rows = [
        ("clipped global norm", _vs_limit(good_norm, limit), _vs_limit(bad_norm, limit)),
        ("cosine with the original", _cos(c["cosine"]), _cos(report["cosine"])),
        ("max |error| vs correct", "0", _num(report["max_abs_error"], 3)),
    ]
    lines += [f"   {name:<26}{left:<{w}}{right}" for name, left, right in rows]
    if bug.name == "per-rank" and opts.replicated:
        lines.append("   (per-rank: each rank's own norm includes its own copy of the bias)")
    lines += _values_lines(report, opts)
    lines += ["", _b("What happened:"), *_wrap(" ".join(_happened_buggy(report, opts)), "  ")]
    lines += [_b("Why:"), *_wrap(bug.explanation, "  ")]
    lines.append("Other bugs: --list-bugs; the picture: --plot demo.png")
    return lines


def _vs_limit(x: float, limit: float) -> str:
    if limit > 0 and math.isfinite(x) and x > 0:
        return f"{_num(x, 10)} ({_num(x / limit, 4)} x limit)"
    return _num(x, 10)


def _cos(c: float | None) -> str:
    return "undefined" if c is None else f"{c:.6f}"


def _pad(colored_empty: str) -> int:
    return len(colored_empty)  # ANSI codes take room in the format width but not on screen


def _happened_buggy(report: dict, opts: Options) -> list[str]:
    c, limit, bug = report["correct"], opts.limit, report["bug"]["name"]
    got, want = report["clipped_norm"], c["clipped_norm"]
    if report["max_abs_error"] == 0.0:
        return ["On this data the bug gives exactly the correct result: it needs other data or more ranks."]
    out = []
    if not math.isfinite(c["global_norm"]):
        out.append(
            f"The correct global norm is {c['global_norm']}: gclip leaves the gradient untouched "
            "(finite=False) so the caller can skip the step."
        )
    if not report["same_on_all_ranks"]:
        out.append("  The ranks used different norms and scales: there was no global norm at all.")
    if got == 0.0 and want > 0.0:
        out.append(_bad("  The gradient was wiped out: every value is now 0 (the step is lost)."))
    elif math.isfinite(got) and math.isfinite(want) and want > 0:
        rel = got / want
        if abs(rel - 1) < 1e-6:
            out.append(
                f"  The clipped norm {_num(got, 10)} is off by only {_num(abs(rel - 1), 2)} (relative), but "
                f"values differ by up to {_num(report['max_abs_error'], 2)}: not the exact contract."
            )
        elif rel > 1 + 1e-9:
            out.append(
                f"  The clipped gradient has norm {_num(got)}, {_num(rel, 4)} x what the limit allows: "
                + _bad("clipped too little.")
            )
        elif rel < 1 - 1e-9:
            out.append(
                f"  The clipped gradient has norm {_num(got)}, {_num(rel, 4)} x the correct {_num(want)}: "
                + _bad("clipped too hard.")
            )
    cos = report["cosine"]
    if cos is not None and cos < 1 - 1e-9:
        out.append(
            f"  Cosine {_num(cos, 6)} with the original: " + _bad("the gradient's direction changed") + ","
        )
        out.append("  not just its length: no optimizer step size can undo that.")
    elif cos is not None:
        out.append("  The direction is unchanged (same scale on every rank); only the length is wrong.")
    if bug == "per-rank" and limit > 0:
        r = report["ranks"]
        out.append(
            f"  Per-rank clipping bounds each shard by the limit, so the whole gradient only by "
            f"sqrt({r}) x {_num(limit)} = {_num(math.sqrt(r) * limit)}."
        )
    return out


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
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


def render_bugs(as_json: bool) -> str:
    """The gallery: name, summary, where it happened."""
    if as_json:
        return json.dumps([_jsonable(b.as_dict()) for b in BUGS], separators=(",", ":"))
    lines = [_b(f"gclip bug gallery: {len(BUGS)} ways to get global-norm clipping wrong"), ""]
    for b in BUGS:
        lines.append(f"  {_bad(b.name):<{14 + _pad(_bad(''))}}{b.summary}")
        lines.append(f"  {'':<14}seen in: {b.incident}")
    lines += ["", "Run one next to the correct clip: mpiexec -n 4 python -m gclip.demo --buggy NAME"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the figure


def sweep(opts: Options, modes: Sequence[str], max_ranks: int = SWEEP_RANKS) -> dict[str, list[float]]:
    """The clipped global norm for R = 1..max_ranks simulated ranks, per mode.

    Rank r holds the shard it would hold in the demo (the given shards repeat).
    """
    out: dict[str, list[float]] = {m: [] for m in modes}
    for n in range(1, max_ranks + 1):
        ranks = [_grads(opts, shard_for(opts, r)) for r in range(n)]
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
            out[m].append(_pnorm(_whole([list(r.grads) for r in res]), opts.p))
    return out


def render_plot(report: dict, opts: Options, path: str) -> int:
    """The slide: local norms vs the limit, per-rank scales, the clipped norm as ranks grow."""
    from ._lab import plots

    col = plots.COLORS
    bug = opts.bug
    c = report.get("correct", report)
    fig, (a1, a2, a3) = plots.figure(3, title=_plot_title(report, opts))
    labels = [f"rank {row['rank']}" for row in report["per_rank"]]
    local = [row["local_norm"] for row in c["per_rank"]]
    plots.bars(
        a1,
        labels,
        {"local norm": local},
        title="1. Each rank sees only its own norm",
        ylabel=f"{_pname(opts.p)} norm (log)",
        colors={"local norm": col["neutral"]},
        hlines={
            f"global norm {_num(c['global_norm'], 4)}": (c["global_norm"], col["correct"]),
            f"limit {_num(opts.limit)}": (opts.limit, col["limit"]),
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
    modes = [GLOBAL.name, "per-rank"] + ([bug] if bug and bug != "per-rank" else [])
    curves = sweep(opts, modes)
    xs = list(range(1, SWEEP_RANKS + 1))
    series = {
        "correct (global)": curves[GLOBAL.name],
        "per-rank": curves["per-rank"],
    }
    colors = {
        "correct (global)": col["correct"],
        "per-rank": col["bug"] if bug == "per-rank" else col["other"],
    }
    if bug and bug != "per-rank":
        series[f"bug ({bug})"] = curves[bug]
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
        ylabel=f"{_pname(opts.p)} norm after clipping",
        colors=colors,
        dashed=["sqrt(R) x limit"],
        log=spread > 30,
    )
    a3.axhline(opts.limit, color=col["limit"], linestyle="--", linewidth=1, label=f"limit {_num(opts.limit)}")
    a3.legend(fontsize=8, loc="upper left")
    return plots.save(fig, path)


def _plot_title(report: dict, opts: Options) -> str:
    r = report["ranks"]
    what = f"the {opts.bug} bug vs the correct clip" if opts.bug else "clipping by the global norm"
    return f"gclip: {what} ({r} rank{'s' * (r != 1)}, limit {_num(opts.limit)})"


def _preflight_plot(opts: Options, comm: Any) -> None:
    """Rank 0 checks that the plot can be made; every rank learns the verdict before any clip."""
    problem = None
    if comm.Get_rank() == 0:
        from ._lab import plots

        folder = os.path.dirname(opts.plot or "") or "."
        try:
            plots.require()
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise UsageError(f"--plot: cannot write in the folder {folder!r}")
        except UsageError as exc:
            problem = str(exc)
    problem = comm.bcast(problem, root=0)
    if problem:
        raise UsageError(problem)


# ---------------------------------------------------------------------------
# entry point


def _main(argv: Sequence[str] | None = None, comm: Any = None) -> int:
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    opts = parse_args(argv, comm.Get_size())

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    if opts.list_bugs:
        say(render_bugs(opts.json))
        return 0
    if opts.plot:
        _preflight_plot(opts, comm)
    report = run(opts, comm)
    if report is None:
        return 0
    plotted = render_plot(report, opts, opts.plot) if opts.plot else 0
    if opts.json:
        say(to_json(report))
    else:
        say(render_text(report, opts))
        if opts.plot:
            say(f"plot: wrote {opts.plot} ({plotted // 1024} KB)")
    return 0


main = _cli.entry(PROG, _main)

if __name__ == "__main__":
    main()
