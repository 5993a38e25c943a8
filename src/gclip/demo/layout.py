"""``--layout pp=2,dp=2,tp=2``: the lab's transformer laid out over the ranks, clipped.

Every rank builds its part of the model under the mesh (shards, copies, the
tied embedding, experts with ``ep``), clips it correctly, and with
``--buggy NAME`` once more with the bug. Rank 0 gathers what each rank held,
counted and applied, puts the model back together (one copy per tensor shard)
and tells the story: who holds what, who counts it, the one all-reduce, the
scale, and, for a bug, what it broke (the clipped norm, the direction, copies
that drifted apart, or the ranks left waiting).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._lab import layout_run, transformer
from .._lab.jsonout import dumps
from .._lab.vectors import cosine, vector_norm
from ..errors import GclipError
from ..gallery import GLOBAL, LAYOUT_BUG_NAMES, STRATEGIES
from ..layout import Mesh, ranges
from ..replicas import explain
from .options import Options
from .text import bold, green, num, pname, red, wrap

__all__ = ["build_report", "render_layout", "run_layout", "to_json"]


def run_layout(opts: Options, comm: Any) -> dict | None:
    """Clip the model on every rank of ``comm``; rank 0 gets the report (None elsewhere)."""
    mesh = Mesh.parse(comm, opts.layout or "")
    try:
        transformer.pieces(Mesh((0, mesh.size), **mesh.shape))  # fits the model? (no collective)
    except GclipError:
        mesh.free()
        raise
    arrays, entries, names, _ = transformer.clip_arguments(mesh)
    rows = explain(arrays, replicated=entries, names=names, norm_type=opts.p)
    runs = {
        GLOBAL.name: layout_run.clip_model(mesh, opts.limit, norm_type=opts.p, reproducible=opts.reproducible)
    }
    if opts.bug:
        runs[opts.bug] = layout_run.clip_model(
            mesh, opts.limit, bug=opts.bug, norm_type=opts.p, reproducible=opts.reproducible
        )
    mine = {mode: _sent(run) for mode, run in runs.items()}
    gathered = comm.gather(mine, root=0)
    mesh.free()
    if comm.Get_rank() != 0:
        return None
    return build_report(opts, mesh, rows, gathered)


def _sent(run: layout_run.RankClip) -> dict:
    """What a rank sends rank 0: its numbers and its arrays after the clip (picklable)."""
    return {
        "rank": run.rank,
        "coords": run.coords,
        "norm": run.norm,
        "scale": run.scale,
        "counted": run.counted,
        "held": run.held,
        "note": run.note,
        "pieces": [(p.name, p.part, p.kind, p.array) for p in run.pieces],
    }


def _model(per_rank: list[dict]) -> tuple[dict, list[str]]:
    """One array per tensor shard, and the tensors whose copies no longer agree."""
    kept: dict[tuple, np.ndarray] = {}
    drifted: dict[str, list[int]] = {}
    for sent in per_rank:
        for name, part, _, array in sent["pieces"]:
            key = (name, part)
            if key not in kept:
                kept[key] = array
            elif not np.array_equal(kept[key], array):
                drifted.setdefault(name, []).append(sent["rank"])
    return kept, [f"{name} (ranks {ranges(sorted(set(r)))})" for name, r in drifted.items()]


def _vector(kept: dict) -> np.ndarray:
    return np.concatenate([np.ravel(kept[k]) for k in sorted(kept)]) if kept else np.zeros(0)


def build_report(opts: Options, mesh: Mesh, rows: list, gathered: list[dict]) -> dict:
    """The whole story on rank 0 (pure; JSON-ready)."""
    ep = "ep" in mesh.shape
    original = _vector(
        {
            (n, part): transformer.full_tensor(n, transformer.model_shapes(ep)[n])[_slice(part, n, ep)]
            for n, part in _keys(gathered)
        }
    )
    report: dict[str, Any] = {
        "layout": mesh.describe(),
        "ranks": mesh.size,
        "mode": opts.mode,
        "limit": opts.limit,
        "norm_type": opts.p,
        "reproducible": opts.reproducible,
        "model_values": int(sum(math.prod(s) for s in transformer.model_shapes(ep).values())),
        "model_norm": layout_run.true_norm(ep, opts.p),  # from the model's definition: the oracle
        "who_counts_what": _kinds(rows, gathered),
    }
    if opts.explain:  # gclip.explain's rows, as the function returns them
        report["tensors"] = [
            {**r._asdict(), "shape": list(r.shape), "ranks": list(r.ranks), "copies": r.copies} for r in rows
        ]
    for mode in gathered[0]:
        per_rank = [g[mode] for g in gathered]
        kept, drifted = _model(per_rank)
        clipped = _vector(kept)
        norms = [r["norm"] for r in per_rank]
        scales = [r["scale"] for r in per_rank]
        entry = {
            "norms": norms,
            "scales": scales,
            "same_on_all_ranks": len(set(map(repr, zip(norms, scales)))) == 1,
            "clipped_norm": vector_norm(clipped, opts.p),
            "cosine": cosine(clipped, original),
            "drifted": drifted,
            "note": per_rank[0]["note"],
            "per_rank": [
                {k: r[k] for k in ("rank", "coords", "held", "counted", "norm", "scale")} for r in per_rank
            ],
        }
        report["correct" if mode == GLOBAL.name else "bug_run"] = entry
    report["global_norm"] = report["correct"]["norms"][0]
    report["scale"] = report["correct"]["scales"][0]
    if opts.bug:
        report["bug"] = _bug(opts.bug)
    return report


def _keys(gathered: list[dict]) -> list[tuple]:
    return sorted({(name, part) for g in gathered for name, part, _, _ in g[GLOBAL.name]["pieces"]})


def _slice(part: tuple[int, int, int], name: str, ep: bool) -> Any:
    axis, index, count = part
    shape = transformer.model_shapes(ep)[name]
    if count == 1:
        return ...
    step = shape[axis] // count
    cut = [slice(None)] * len(shape)
    cut[axis] = slice(index * step, (index + 1) * step)
    return tuple(cut)


def _kinds(rows: list, gathered: list[dict]) -> list[dict]:
    """Per kind of tensor: how many ranks hold each piece, and that one counts it."""
    kind_of = {(n, k) for g in gathered for n, _, k, _ in g[GLOBAL.name]["pieces"]}
    kinds: dict[str, dict] = {}
    names = dict(kind_of)
    for row in rows:
        first = row.name.split(" = ")[0]
        kind = names.get(first, "?")
        k = kinds.setdefault(kind, {"kind": kind, "pieces": 0, "copies": set(), "share": 0.0})
        k["pieces"] += 1
        k["copies"].add(row.copies)
        k["share"] += row.share
    return [{**k, "copies": sorted(k["copies"])} for k in kinds.values()]


def _explained(tensors: list[dict]) -> list[str]:
    """gclip.explain's rows as a table: the teacher's picture of who counts what."""
    out = [f"   every tensor ({len(tensors)} rows of gclip.explain):"]
    out.append(f"     {'tensor':<34} {'shape':<12} {'held by ranks':<16} {'counted on':>10}  {'share':>7}")
    for t in tensors:
        shape, held = "x".join(map(str, t["shape"])) or "()", ranges(t["ranks"])
        out.append(f"     {t['name']:<34} {shape:<12} {held:<16} {t['counted_on']:>10}  {t['share']:>7.2%}")
    return out


def _bug(name: str) -> dict:
    bug = LAYOUT_BUG_NAMES.get(name) or STRATEGIES[name]
    return bug.as_dict()


def to_json(report: dict) -> str:
    return dumps(report, separators=(",", ":"))


# ---------------------------------------------------------------------------
# the text


def render_layout(report: dict, opts: Options) -> str:
    r, layout, limit, p = report["ranks"], report["layout"], opts.limit, report["norm_type"]
    c = report["correct"]
    title = f"the lab's model laid out as {layout.replace(',', ' x ')} over {r} ranks, clipped to a global "
    lines = [bold(f"gclip demo: {title}{pname(p)} norm of at most {num(limit)}")]
    lines.append(
        f"  model: a small transformer, {report['model_values']:,} values: an embedding tied to the output "
        "head, attention and MLP weights sharded over tp, layer norms whole on every tp rank"
        + (", experts spread over ep" if "ep=" in layout else "")
    )
    lines += [
        "",
        bold("1. local: each rank sums what it COUNTS; a tensor held by a group counts on one of them"),
    ]
    lines.append(f"   {'rank':>4}  {'coords':<16} {'values held':>11}  {'counted':>9}")
    for row in c["per_rank"]:
        coords = " ".join(f"{k}{v}" for k, v in row["coords"].items())
        lines.append(f"   {row['rank']:>4}  {coords:<16} {row['held']:>11,}  {row['counted']:>9,}")
    lines.append("   who counts what:")
    for k in report["who_counts_what"]:
        copies = "/".join(map(str, k["copies"]))
        held = "held by 1 rank" if k["copies"] == [1] else f"held by {copies} ranks, counted on one"
        lines.append(
            f"     {k['kind']:<30} {k['pieces']:>4} pieces  {held:<36} {k['share']:.1%} of the norm^p"
        )
    if "tensors" in report:
        lines += _explained(report["tensors"])
    else:
        lines.append("     (--explain: every tensor, where it lives and who counts it)")
    lines.append(
        bold(f"2. all-reduce: one MPI_Allreduce over all {r} ranks adds what each counted")
        + f"  ->  global norm {bold(num(report['global_norm']))}"
    )
    same = report["global_norm"] == report["model_norm"] or math.isclose(
        report["global_norm"], report["model_norm"], rel_tol=1e-12
    )
    verdict = green("every element counted exactly once") if same else red("NOT the model's norm")
    lines.append(
        f"   the model's norm from its definition (each tensor once): {num(report['model_norm'])}: {verdict}"
    )
    lines.append(bold(f"3. scale: min(1, limit / global norm) = {num(report['scale'])} on every rank"))
    lines.append(
        f"   clipped model norm {num(c['clipped_norm'], 10)} (limit {num(limit)}); cosine {_cos(c['cosine'])}"
    )
    if opts.bug:
        lines += ["", *_bug_lines(report, opts)]
    else:
        lines += [
            "",
            "Next: --buggy NAME runs a bug of the gallery here (--list-bugs); try --buggy tied-counted-twice",
        ]
    return "\n".join(lines)


def _bug_lines(report: dict, opts: Options) -> list[str]:
    bug, b, c, limit = report["bug"], report["bug_run"], report["correct"], opts.limit
    lines = [
        bold(f"the {bug['name']} bug on the same layout: {bug['summary']}"),
        f"  seen in: {bug['incident'] or '(no public incident confirmed: a teaching example)'}",
    ]
    if b["note"]:
        lines += [red("  " + b["note"]), ""]
        lines += [bold("Why:"), *wrap(bug["explanation"], "  ")]
        return lines
    lines.append(f"   {'ranks':<10}{'correct: norm -> scale':<28}{'bug: norm -> scale'}")
    groups: dict[str, list[int]] = {}  # ranks with the same numbers share a line
    for good, bad in zip(c["per_rank"], b["per_rank"]):
        left = f"{num(good['norm'])} -> {num(good['scale'])}"
        right = f"{num(bad['norm'])} -> {num(bad['scale'])}"
        groups.setdefault(f"{left:<28}{right}", []).append(good["rank"])
    for text, ranks in groups.items():
        lines.append(f"   {ranges(ranks):<10}{text}")
    lines.append(
        f"   clipped model norm: correct {num(c['clipped_norm'], 8)}, bug {num(b['clipped_norm'], 8)} "
        f"({num(b['clipped_norm'] / limit, 4)} x limit)"
        if limit > 0
        else ""
    )
    lines.append(f"   cosine with the original: correct {_cos(c['cosine'])}, bug {_cos(b['cosine'])}")
    if b["drifted"]:
        lines.append(
            red(f"   copies that no longer agree after the clip: {', '.join(b['drifted'][:4])}")
            + (f" and {len(b['drifted']) - 4} more" if len(b["drifted"]) > 4 else "")
        )
    happened = []
    if not b["same_on_all_ranks"]:
        happened.append("The ranks clipped by different norms: there was no global norm at all.")
    ratio = b["norms"][0] / report["global_norm"] if b["norms"][0] and report["global_norm"] else None
    if ratio is not None and b["same_on_all_ranks"] and abs(ratio - 1) > 1e-9:
        more = "too large: clipped too hard" if ratio > 1 else "too small: clipped too little"
        happened.append(
            f"Every rank used the norm {num(b['norms'][0])}, {num(ratio, 4)} x the true one, {more}."
        )
    if b["drifted"]:
        happened.append(
            "Copies that must stay identical were scaled differently: they drift apart, step after step."
        )
    lines += [
        "",
        bold("What happened:"),
        *wrap(" ".join(happened) or "The bug gives the correct result here.", "  "),
    ]
    lines += [bold("Why:"), *wrap(bug["explanation"], "  ")]
    return lines


def _cos(c: float | None) -> str:
    return "undefined" if c is None else f"{c:.6f}"
