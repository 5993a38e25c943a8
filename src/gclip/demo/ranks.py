"""The demo's data, the clip on every rank, and the report rank 0 builds from what they send."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lab.jsonout import dumps
from .._lab.vectors import cosine, vector_norm
from ..contract import rounded
from ..gallery import GLOBAL, STRATEGIES, clip_by_global_norm, clip_simulated
from .options import Options

__all__ = [
    "SIMULATED_HOST",
    "TOP_NORM",
    "build_report",
    "grads_for",
    "random_shard",
    "run",
    "run_simulated",
    "shard_for",
    "shard_norm",
    "to_json",
    "whole",
]

TOP_NORM = 400.0  # seed 0: the largest shard's norm; rank r's is TOP_NORM / 2**_PATTERN[r % 4]
_PATTERN = (2, 0, 3, 1)  # 4 ranks: norms 100, 400, 50, 200 (the largest is not on rank 0)
_NORMS_STREAM = (7919, 104729)  # seeds > 0: the norms' own random stream, apart from the values'
_TOPS = 67  # the largest norms a seed > 0 can have: 8 k, k = 33..100 but 50
_TOP_STEP = 29  # coprime with 67, so k runs over all 67 in any 67 consecutive seeds; seed 7 keeps 280
SIMULATED_HOST = "simulated"  # the host column of a --ranks run


# ---------------------------------------------------------------------------
# the data


def _norm_pattern(seed: int) -> tuple[float, tuple[int, ...]]:
    """(the largest norm, the halvings per rank) of seed ``seed``'s data.

    Seed 0 is the tutorial's: 400 and (2, 0, 3, 1), so norms 100, 400, 50, 200.
    Any other seed's largest norm is 8 k, k one of the 67 whole numbers from 33 to 100 but 50
    (seed 0's 400): the ((_TOP_STEP * seed) mod 67)-th, so that any 67 consecutive seeds (a class)
    get different largest norms, hence different global norms. Its sum of squares is above
    float16's 65504. The order of the four halvings is drawn from the seed, the largest never on
    rank 0 (so that rank 0's norm and the largest differ).
    """
    if seed == 0:
        return TOP_NORM, _PATTERN
    k = 33 + (_TOP_STEP * seed) % _TOPS
    k += k >= 50
    rng = np.random.default_rng([seed, *_NORMS_STREAM])
    rng.integers(33, 100)  # the stream's first draw once chose k; still drawn, so each seed keeps its order
    order = tuple(int(i) for i in rng.permutation(len(_PATTERN)))
    if order[0] == 0:
        order = order[1:] + order[:1]
    return 8.0 * k, order


def shard_norm(seed: int, rank: int) -> float:
    """The norm of rank ``rank``'s seeded shard: the largest norm halved 0 to 3 times.

    The pattern of four norms repeats over the ranks.
    """
    top, pattern = _norm_pattern(seed)
    return top / 2.0 ** pattern[rank % len(pattern)]


def random_shard(seed: int, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s seeded random shard: a random direction scaled to :func:`shard_norm`.

    Seed 0 gives the tutorial's norms, 100, 400, 50, 200 over four ranks; every
    other seed its own (so each student of a lab gets their own numbers).
    """
    x = np.random.default_rng([seed, rank]).standard_normal(size)
    n = float(np.linalg.norm(x))
    return x * (shard_norm(seed, rank) / n) if n > 0 else x


def shard_for(opts: Options, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard (the given shards repeat when ``rank`` is past them)."""
    if opts.shards is not None:
        return np.asarray(opts.shards[rank % len(opts.shards)], dtype=np.float64)
    return random_shard(opts.seed, rank, opts.size) * _data_scale(opts)


def _data_scale(opts: Options) -> float:
    """The default data's factor: 1, or the bug's own (nan-mask shows only on a norm that overflows)."""
    bug = STRATEGIES.get(opts.bug or "")
    return bug.data_scale if bug is not None else 1.0


def grads_for(opts: Options, shard: np.ndarray) -> tuple[list[np.ndarray], list[bool]]:
    """(this rank's arrays, which are replicated): the shard, and the bias if any."""
    if not opts.replicated:
        return [shard], [False]
    return [shard, np.asarray(opts.replicated, dtype=np.float64)], [False, True]


def whole(per_rank_grads: list[list[np.ndarray]]) -> np.ndarray:
    """The gradient as one vector: every shard, and the replicated tensor once (rank 0's copy)."""
    parts = [g[0] for g in per_rank_grads]
    if per_rank_grads and len(per_rank_grads[0]) > 1:
        parts.append(per_rank_grads[0][1])
    return np.concatenate([np.ravel(a) for a in parts]) if parts else np.zeros(0)


# ---------------------------------------------------------------------------
# running on the ranks


def run(opts: Options, comm: Any) -> dict | None:
    """Clip on every rank of ``comm`` (correct, and the bug if any); rank 0 gets the report."""
    rank = comm.Get_rank()
    shard = shard_for(opts, rank)
    grads, flags = grads_for(opts, shard)
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
        mine["runs"][mode] = _what_it_did(res)
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    return build_report(opts, gathered)


def run_simulated(opts: Options) -> dict:
    """The same clips on ``opts.simulate`` simulated ranks, in this one process (no MPI).

    ``gclip.clip_simulated`` runs the library's engine on each simulated rank;
    only the all-reduce is a sum over a list. The report is the one :func:`run`
    builds, its host column "simulated".
    """
    size = opts.simulate or 1
    per_rank = [grads_for(opts, shard_for(opts, r)) for r in range(size)]
    gathered: list[dict[str, Any]] = [
        {"rank": r, "host": SIMULATED_HOST, "grads": g, "runs": {}} for r, (g, _) in enumerate(per_rank)
    ]
    for mode in dict.fromkeys([GLOBAL.name, opts.mode]):
        results = clip_simulated(
            [g for g, _ in per_rank],
            opts.limit,
            norm_type=opts.p,
            mode=mode,
            reproducible=opts.reproducible,
            replicated=per_rank[0][1],
        )
        for mine, res in zip(gathered, results):
            mine["runs"][mode] = _what_it_did(res)
    return build_report(opts, gathered)


def _what_it_did(res: Any) -> dict:
    return {
        "local_sumsq": float(res.local_power),
        "local_norm": float(res.local_norm),
        "norm": float(res.total_norm),
        "scale": float(res.scale),
        "finite": bool(res.finite),
        "grads": list(res.grads),
    }


def _host() -> str:
    from mpi4py import MPI

    return MPI.Get_processor_name()


# ---------------------------------------------------------------------------
# the report


def build_report(opts: Options, gathered: list[dict]) -> dict:
    """The whole story on rank 0, from what every rank sent (pure; JSON-ready but for arrays).

    ``true_global_norm`` is the correct clip's norm of the input. A bug's run
    reports the norms and scales it used (``norms_used``, ``scales``, one per
    rank), never a ``global_norm`` of its own: rank 0's number is not a global
    norm under most bugs. ``--mystery K`` keeps the bug's name out (``mode`` is
    "mystery-K", no ``bug`` object).
    """
    p = opts.p
    original = whole([g["grads"] for g in gathered])
    report: dict[str, Any] = {
        "mode": f"mystery-{opts.mystery}" if opts.mystery else opts.mode,
        "ranks": len(gathered),
        "simulated": opts.simulate is not None,
        "limit": opts.limit,
        "norm_type": p,
        "reproducible": opts.reproducible,
        "data": _data_info(opts, len(gathered)),
        "values_per_rank": [int(g["grads"][0].size) for g in gathered],  # counts: the shards, not the bias
        "replicated": list(opts.replicated),
        "input_norm": vector_norm(original, p),
    }
    if opts.mystery:
        report["mystery"] = opts.mystery
    correct = _summary(gathered, GLOBAL.name, p, original)
    report["true_global_norm"] = correct["global_norm"]
    if opts.bug is None:
        report.update(correct)
        report["max_abs_error"] = 0.0
        return report
    report.update(_summary(gathered, opts.bug, p, original))
    del report["global_norm"], report["scale"]  # rank 0's alone: norms_used and scales say it all
    keep = ("global_norm", "scale", "clipped", "clipped_replicated", "clipped_norm", "cosine", "per_rank")
    report["correct"] = {k: correct[k] for k in keep}
    report["correct"]["scales"] = correct["scales"]
    report["max_abs_error"] = _max_error(gathered, opts.bug, GLOBAL.name)
    if not opts.mystery:
        report["bug"] = STRATEGIES[opts.bug].as_dict()
    return report


def _data_info(opts: Options, ranks: int) -> dict:
    if opts.shards is not None:
        return {"source": "shards"}
    norms = [shard_norm(opts.seed, r) * _data_scale(opts) for r in range(ranks)]
    return {"source": "seed", "seed": opts.seed, "size": opts.size, "shard_norms": norms}


def _summary(gathered: list[dict], mode: str, p: float, original: np.ndarray) -> dict:
    runs = [g["runs"][mode] for g in gathered]
    clipped = whole([r["grads"] for r in runs])
    first = runs[0]
    return {
        "global_norm": first["norm"],
        "scale": first["scale"],
        "same_on_all_ranks": all(
            _same(r["norm"], first["norm"]) and _same(r["scale"], first["scale"]) for r in runs
        ),
        "finite": all(r["finite"] for r in runs),
        "clipped": [r["grads"][0] for r in runs],
        "clipped_replicated": [r["grads"][1] for r in runs] if len(first["grads"]) > 1 else [],
        "clipped_norm": vector_norm(clipped, p),
        "cosine": cosine(clipped, original),
        "norms_used": [r["norm"] for r in runs],
        "scales": [r["scale"] for r in runs],
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


def _same(a: float, b: float) -> bool:
    """Equal, a NaN equal to a NaN (every rank's NaN scale is one scale)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _max_error(gathered: list[dict], mode: str, reference: str) -> float:
    worst = 0.0
    for g in gathered:
        for a, b in zip(g["runs"][mode]["grads"], g["runs"][reference]["grads"]):
            if a.size:
                with np.errstate(invalid="ignore", over="ignore"):
                    d = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                worst = d if math.isnan(d) else max(worst, d)
    return worst


def to_json(report: dict, values: bool = False) -> str:
    """One line of strict JSON. The clipped values (``clipped``, ``clipped_replicated``,
    rounded to 12 decimals as the contract's checks are) only with ``values``
    (``--values``): on the default data they are thousands of numbers."""
    out = dict(report)
    parts = [out]
    if "correct" in report:
        out["correct"] = dict(report["correct"])
        parts.append(out["correct"])
    for part in parts:
        for key in ("clipped", "clipped_replicated"):
            if values:
                part[key] = [rounded(s) for s in part[key]]
            else:
                del part[key]
    return dumps(out, separators=(",", ":"))
