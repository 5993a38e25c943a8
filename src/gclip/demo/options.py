"""The demo's flags: every rank parses the same argv, so every rank fails together."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._lab.cli import ArgParser, UsageError, parse_max_norm
from .._lab.transformer import PROPORTIONS
from ..gallery import BUGS, GLOBAL, LAYOUT_BUG_NAMES, LAYOUT_BUGS, STRATEGIES, USAGE_BUG_NAMES

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_REPLICATED",
    "DEFAULT_SIZE",
    "LAYOUT_MYSTERY_POOL",
    "MAX_SIMULATED",
    "MAX_SIZE",
    "MODELS",
    "MYSTERY_PAIRS",
    "MYSTERY_POOL",
    "PROG",
    "Options",
    "layout_axes",
    "layout_mysteries",
    "mysteries",
    "parse_args",
    "parse_data",
]

PROG = "gclip.demo"
DEFAULT_SIZE = 1000
DEFAULT_LIMIT = 1.0
DEFAULT_REPLICATED = (30.0, -40.0)
MAX_SIZE = 10**6  # a demo gathers everything on rank 0
MAX_SIMULATED = 64  # --ranks R: simulated ranks in one process

# --mystery K runs the K-th bug of the seed's own order of the pool (mysteries(seed)). The pool:
# every bug of how the norm is combined but inf-pow, which shows only on the inf-norm: its run
# switches the whole demo to it (the header says "inf norm", table 1 shows max |x|), which names
# it, and its numbers could not be read against the L2 local norms the others are read against.
# Nor nan-mask, which shows only on data of its own (every value NaN names it). The bugs added to the
# gallery later (ADDED) stay out of both pools: the seeds already handed out keep their mysteries.
ADDED = (
    "nan-mask",
    "expert-tp-shards-dropped",
    "dense-expert-apart",
    "duplicates-on-mp-rank0-only",
    "epsilon-per-rank",
)
MYSTERY_POOL = tuple(b.name for b in BUGS if b.name != "inf-pow" and b.name not in ADDED)


def _pairs(pool: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Every pair of distinct bugs of the pool, once, in an order where two pairs next to each
    other (the last and the first too) have no bug in common: a round-robin schedule of the
    pool's 9 bugs (round r pairs r - i with r + i, i = 1..4; bug r sits the round out)."""
    n = len(pool)
    return tuple((pool[(r - i) % n], pool[(r + i) % n]) for r in range(n) for i in range(1, (n - 1) // 2 + 1))


MYSTERY_PAIRS = _pairs(MYSTERY_POOL)  # 36 pairs
# seed S's pair is MYSTERY_PAIRS[(S + _PAIR_SHIFT) % 36]: any 36 consecutive seeds get 36 different
# pairs, and consecutive seeds (students side by side) no bug in common. The shift gives the lab's
# worked example, seed 43 (no student's: they are handed 1 to 40), rms then double-count.
_PAIR_SHIFT = 11
_MYSTERY_STREAM = 6007  # the order of mysteries 3.. has its own random stream, apart from the data's


def mysteries(seed: int) -> tuple[str, ...]:
    """Seed ``seed``'s order of the mystery pool: ``--mystery K`` runs its K-th bug.

    Mysteries 1 and 2 are the seed's pair (a student's exercise); the other bugs of the pool follow
    in an order drawn from the whole seed, for whoever wants more.
    """
    pair = MYSTERY_PAIRS[(seed + _PAIR_SHIFT) % len(MYSTERY_PAIRS)]
    rest = [name for name in MYSTERY_POOL if name not in pair]
    order = np.random.default_rng([seed, _MYSTERY_STREAM]).permutation(len(rest))
    return (*pair, *(rest[int(i)] for i in order))


# --mystery K --layout AXES runs the K-th layout bug of the seed's own order of the bugs that show on
# that layout (layout_mysteries). Not the hang (skip-collective): its run says who skipped the
# all-reduce, which names it. The seed also gives the model its own values (transformer.Model).
LAYOUT_MYSTERY_POOL = tuple(b.name for b in LAYOUT_BUGS if not b.skips_collective and b.name not in ADDED)
_LAYOUT_MYSTERY_STREAM = 6011
MODELS = PROPORTIONS  # --model: the lab's values, or the incidents' proportions


def layout_axes(text: str) -> dict[str, int]:
    """``pp=2,dp=2,tp=2`` as {axis: size}, leniently (the Mesh says what is wrong with bad text)."""
    axes = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        axes[name.strip()] = int(value) if value.strip().isdigit() else 0
    return axes


def _shows_on(bug: Any, axes: dict[str, int]) -> bool:
    """Whether a layout bug changes anything on a layout: every axis it acts on is there, > 1."""
    needs = bug.axes()
    return all(axes.get(a, 1) > 1 for a in needs)


def layout_mysteries(seed: int, axes: dict[str, int]) -> tuple[str, ...]:
    """Seed ``seed``'s order of the layout bugs that show on ``axes``: ``--mystery K --layout``.

    Mysteries 1 and 2 are bugs i and i + 2 of the pool (i = seed mod its size): two seeds side by
    side share no bug (pools of 4 or more); the others follow in an order drawn from the seed.
    """
    pool = [n for n in LAYOUT_MYSTERY_POOL if _shows_on(LAYOUT_BUG_NAMES[n], axes)]
    if len(pool) < 2:
        return tuple(pool)
    pair = (pool[seed % len(pool)], pool[(seed + 2) % len(pool)])
    rest = [n for n in pool if n not in pair]
    order = np.random.default_rng([seed, _LAYOUT_MYSTERY_STREAM]).permutation(len(rest))
    return (*pair, *(rest[int(i)] for i in order))


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
    layout: str | None = None  # e.g. "pp=2,dp=2,tp=2": the lab's model laid out over the ranks
    simulate: int | None = None  # --ranks R: R simulated ranks in this one process (no mpirun)
    mystery: int | None = None  # --mystery K: ``bug`` is mysteries(seed)[K - 1], its name kept out
    values: bool = False  # --values: the JSON holds the clipped values too
    explain: str | None = None  # --explain (with --layout): "summary" (by kind), or "full" (every tensor)
    model: str = "lab"  # --model (with --layout): the values of the lab's transformer (MODELS)

    @property
    def mode(self) -> str:
        return self.bug or GLOBAL.name

    @property
    def bug_label(self) -> str:
        """What the output calls the bug: its name, or "mystery K" when the name is hidden."""
        return f"mystery {self.mystery}" if self.mystery else (self.bug or GLOBAL.name)

    @property
    def p(self) -> float:
        if self.norm_type is not None:
            return self.norm_type
        if self.bug in STRATEGIES and STRATEGIES[self.bug].norm_type is not None:
            return float(STRATEGIES[self.bug].norm_type)  # type: ignore[arg-type]
        return 2.0


def _parser() -> ArgParser:
    names = [b.name for b in BUGS] + [b.name for b in LAYOUT_BUGS]  # not the usage bugs: no clip of theirs
    p = ArgParser(
        prog="mpirun -n 4 python -m gclip.demo",
        description="Clip one gradient sharded over the MPI ranks by its global norm, phase by phase.",
    )
    p.add_argument(
        "--buggy",
        nargs="?",
        const="per-rank",
        type=_bug_name(names),
        metavar="NAME",
        help="also run a gallery bug on the same data, side by side (alone: per-rank; see --list-bugs)",
    )
    p.add_argument(
        "--mystery",
        type=int,
        metavar="K",
        help=f"run mystery K (1..{len(MYSTERY_POOL)}) of the seed, a gallery bug, without saying which: "
        "the lab's exercise (each seed's mysteries 1 and 2 are its own pair); with --layout, a layout bug",
    )
    p.add_argument(
        "--ranks",
        type=int,
        metavar="R",
        help="simulate R ranks in this one process, without mpirun (the same engine; no MPI needed)",
    )
    p.add_argument(
        "--layout",
        metavar="AXES",
        help="lay a small transformer out over the ranks, e.g. pp=2,dp=2,tp=2 (axes pp, dp, tp, ep)",
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default="lab",
        help="with --layout: the model's values: lab (default), or incidents (the tied embedding half "
        "of the sum of squares, the tp-duplicated norms 16%%: the incidents' proportions)",
    )
    p.add_argument(
        "--explain",
        nargs="?",
        const="summary",
        choices=("summary", "full"),
        help="with --layout: who holds and counts each kind of tensor (summary), or every tensor (full)",
    )
    p.add_argument("--shards", metavar="JSON", help="one list of numbers per rank, e.g. '[[3,0],[0,4]]'")
    p.add_argument("--max-norm", default=str(DEFAULT_LIMIT), metavar="X", help="the max norm (default 1)")
    # the flag's old name, kept so that old commands still work (the API and the trainer say max_norm)
    p.add_argument("--limit", dest="max_norm", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
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
    p.add_argument("--values", action="store_true", help="with --json: include the clipped values themselves")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figure (needs matplotlib)")
    p.add_argument("--list-bugs", action="store_true", help="list the bug gallery and exit")
    return p


def parse_args(argv: Sequence[str] | None, ranks: int | None) -> Options:
    """Options from argv, validated; bad input raises a one-line UsageError.

    ``ranks`` is the number of real ranks (MPI's): ``--shards`` must match it, or
    ``--ranks`` when given, which real ranks refuse (None: not checked).
    """
    ns = _parser().parse_args(argv)
    if ns.list_bugs:
        return Options(None, [], DEFAULT_LIMIT, None, 0, 0, None, False, ns.json, None, True)
    if ns.ranks is not None:
        if not 1 <= ns.ranks <= MAX_SIMULATED:
            raise UsageError(f"--ranks must be between 1 and {MAX_SIMULATED}, got {ns.ranks}")
        if ranks is not None and ranks > 1:
            raise UsageError(
                f"--ranks simulates ranks in one process, but this runs on {ranks} real ranks: "
                "drop --ranks, or drop mpirun"
            )
        ranks = ns.ranks
    if ns.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {ns.seed}")
    if ns.mystery is not None:
        if ns.layout is None and not 1 <= ns.mystery <= len(MYSTERY_POOL):
            raise UsageError(f"--mystery takes a number from 1 to {len(MYSTERY_POOL)}, got {ns.mystery}")
        if ns.buggy:
            raise UsageError("--mystery runs a bug of its own: drop --buggy")
        if ns.layout is None:
            ns.buggy = mysteries(ns.seed)[ns.mystery - 1]
    if ns.mystery is not None and ns.layout is not None:
        pool = layout_mysteries(ns.seed, layout_axes(ns.layout))
        if not 1 <= ns.mystery <= len(pool):
            raise UsageError(
                f"--mystery with --layout {ns.layout} takes a number from 1 to {len(pool)} "
                f"(the layout bugs that show on it), got {ns.mystery}"
            )
        ns.buggy = pool[ns.mystery - 1]
    if ns.explain and ns.layout is None:
        raise UsageError("--explain goes with --layout: it lists the laid-out model's tensors")
    if ns.model != "lab" and ns.layout is None:
        raise UsageError("--model goes with --layout: it sets the values of the laid-out model")
    if ns.values and not ns.json:
        raise UsageError("--values goes with --json (the text report shows short shards' values already)")
    if not 0 <= ns.size <= MAX_SIZE:
        raise UsageError(f"--size must be between 0 and {MAX_SIZE}, got {ns.size}")
    if ns.plot is not None and not ns.plot.strip():
        raise UsageError("--plot needs a file name")
    if ns.buggy in LAYOUT_BUG_NAMES and ns.layout is None:
        shows = LAYOUT_BUG_NAMES[ns.buggy].shows_on
        raise UsageError(f"--buggy {ns.buggy} is a layout bug: add --layout (e.g. --layout {shows})")
    if ns.layout is not None:
        clash = [f for f, v in (("--shards", ns.shards), ("--replicated", ns.replicated)) if v]
        if clash:
            raise UsageError(f"--layout lays out its own model: drop {', '.join(clash)}")
    shards, limit, replicated, p = parse_data(ns.shards, ns.max_norm, ns.replicated, ns.norm_type, ranks)
    return Options(
        shards,
        replicated,
        limit,
        p,
        ns.seed,
        ns.size,
        ns.buggy,
        ns.reproducible,
        ns.json,
        ns.plot,
        False,
        ns.layout,
        ns.ranks,
        ns.mystery,
        ns.values,
        ns.explain,
        ns.model,
    )


def _bug_name(names: Sequence[str]) -> Any:
    """--buggy's type: a bug the demo runs; a usage bug is refused with where to see it."""

    def name(text: str) -> str:
        if text in USAGE_BUG_NAMES:
            raise UsageError(
                f"--buggy {text} is a bug of how a training loop calls the clip, not of the clip: the "
                f"demo cannot run it; see it with the torch example: {USAGE_SEE}"
            )
        if text not in names:
            raise UsageError(f"argument --buggy: invalid choice: {text!r} (choose from {', '.join(names)})")
        return text

    return name


USAGE_SEE = (
    "docs/torch.md, 'Three usage bugs of the gallery', and "
    "python -m pytest -v tests/test_torch_usage_bugs.py (each one with plain torch, then with gclip.torch)"
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
                f"rank{'s' * (ranks != 1)}: give one list per rank (mpirun -n {len(data)}, "
                f"or --ranks {len(data)})"
            )
        values = [_numbers(s, f"--shards[{i}]") for i, s in enumerate(data)]
    if replicated is None:
        reps = [] if values is not None else list(DEFAULT_REPLICATED)
    else:
        reps = _numbers(_json(replicated, "--replicated"), "--replicated")
    return values, parse_max_norm(limit), reps, _norm_type(norm_type)


def _json(text: str, flag: str) -> Any:
    def constant(name: str) -> None:
        raise UsageError(f"{flag}: {name} is not allowed, values must be finite numbers")

    if len(text) >= 2 and text[0] == text[-1] == "'":  # cmd.exe passes single quotes on as they are
        raise UsageError(
            f"{flag}: not valid JSON: it starts with a single quote, which this shell passed on (cmd.exe "
            f'does): write it in double quotes, e.g. {flag} "{text[1:-1]}"'
        )
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
