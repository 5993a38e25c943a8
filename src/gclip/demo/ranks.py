"""The demo's data, the clip on every rank, and the report rank 0 builds from what they send."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lab.jsonout import dumps
from .._lab.vectors import cosine, vector_norm
from ..clip import clip_by_global_norm
from ..contract import rounded
from ..strategies import GLOBAL, STRATEGIES
from .options import Options

__all__ = ["TOP_NORM", "build_report", "grads_for", "random_shard", "run", "shard_for", "to_json", "whole"]

TOP_NORM = 400.0  # the largest shard's norm; rank r's is TOP_NORM / 2**_PATTERN[r % 4]
_PATTERN = (2, 0, 3, 1)  # 4 ranks: norms 100, 400, 50, 200 (the largest is not on rank 0)


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


# ---------------------------------------------------------------------------
# the report


def build_report(opts: Options, gathered: list[dict]) -> dict:
    """The whole story on rank 0, from what every rank sent (pure; JSON-ready but for arrays)."""
    p = opts.p
    original = whole([g["grads"] for g in gathered])
    report: dict[str, Any] = {
        "mode": opts.mode,
        "ranks": len(gathered),
        "limit": opts.limit,
        "norm_type": p,
        "reproducible": opts.reproducible,
        "data": _data_info(opts),
        "values": [int(g["grads"][0].size) for g in gathered],
        "replicated": list(opts.replicated),
        "input_norm": vector_norm(original, p),
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


def _summary(gathered: list[dict], mode: str, p: float, original: np.ndarray) -> dict:
    runs = [g["runs"][mode] for g in gathered]
    clipped = whole([r["grads"] for r in runs])
    first = runs[0]
    return {
        "global_norm": first["norm"],
        "scale": first["scale"],
        "same_on_all_ranks": all(r["norm"] == first["norm"] and r["scale"] == first["scale"] for r in runs),
        "finite": all(r["finite"] for r in runs),
        "clipped": [r["grads"][0] for r in runs],
        "clipped_replicated": [r["grads"][1] for r in runs] if len(first["grads"]) > 1 else [],
        "clipped_norm": vector_norm(clipped, p),
        "cosine": cosine(clipped, original),
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


def to_json(report: dict) -> str:
    """One line of strict JSON; clipped values rounded to 12 decimals as the seed contract."""
    out = dict(report)
    out["clipped"] = [rounded(s) for s in report["clipped"]]
    out["clipped_replicated"] = [rounded(s) for s in report["clipped_replicated"]]
    if "correct" in report:
        c = dict(report["correct"])
        c["clipped"] = [rounded(s) for s in c["clipped"]]
        c["clipped_replicated"] = [rounded(s) for s in c["clipped_replicated"]]
        out["correct"] = c
    return dumps(out, separators=(",", ":"))
