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
from ..replicas import explain, explain_simulated
from .options import Options
from .text import bold, green, num, pname, red, wrap

__all__ = ["build_report", "render_layout", "run_layout", "to_json"]


def model_of(opts: Options) -> transformer.Model:
    """The values of the laid-out model: ``--model``'s proportions, ``--seed``'s draw."""
    return transformer.Model(opts.model, opts.seed)


def run_layout(opts: Options, comm: Any) -> dict | None:
    """Clip the model on every rank of ``comm``, or on ``opts.simulate`` simulated ranks (``comm``
    None); rank 0 gets the report (None elsewhere)."""
    if comm is None:
        return run_layout_simulated(opts)
    mesh = Mesh.parse(comm, opts.layout or "")
    try:
        transformer.pieces(Mesh((0, mesh.size), **mesh.shape))  # fits the model? (no collective)
    except GclipError:
        mesh.free()
        raise
    model = model_of(opts)
    arrays, entries, names, _ = transformer.clip_arguments(mesh, model=model)
    rows = explain(arrays, replicated=entries, names=names, norm_type=opts.p)
    kwargs = dict(norm_type=opts.p, reproducible=opts.reproducible, model=model)
    runs = {GLOBAL.name: layout_run.clip_model(mesh, opts.limit, **kwargs)}
    if opts.bug:
        runs[opts.bug] = layout_run.clip_model(mesh, opts.limit, bug=opts.bug, **kwargs)
    mine = {mode: _sent(run) for mode, run in runs.items()}
    gathered = comm.gather(mine, root=0)
    mesh.free()
    if comm.Get_rank() != 0:
        return None
    return build_report(opts, mesh, rows, gathered)


def run_layout_simulated(opts: Options) -> dict:
    """The same clips on ``opts.simulate`` simulated ranks, in this one process: the same engine,
    the same arguments on every rank, so the same report as on real ranks (but for ``simulated``)."""
    size = opts.simulate or 1
    mesh = Mesh.parse((0, size), opts.layout or "")
    transformer.pieces(mesh)  # fits the model?
    model = model_of(opts)
    args = [transformer.clip_arguments(Mesh((r, size), **mesh.shape), model=model) for r in range(size)]
    rows = explain_simulated(
        [a[0] for a in args], replicated=[a[1] for a in args], names=[a[2] for a in args], norm_type=opts.p
    )
    kwargs = dict(norm_type=opts.p, reproducible=opts.reproducible, model=model)
    runs = {GLOBAL.name: layout_run.clip_model_simulated(mesh.shape, opts.limit, **kwargs)}
    if opts.bug:
        runs[opts.bug] = layout_run.clip_model_simulated(mesh.shape, opts.limit, bug=opts.bug, **kwargs)
    gathered = [{mode: _sent(run[r]) for mode, run in runs.items()} for r in range(size)]
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
        "split": run.split,
        "pieces": [(p.name, p.part, p.kind, p.array) for p in run.pieces],
        "counts": [p.replicated is False or layout_run.counts_here(p.replicated) for p in run.pieces],
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
    model = model_of(opts)
    shapes = transformer.model_shapes(ep)
    parts = {
        (n, part): transformer.full_tensor(n, shapes[n], model=model, ep=ep)[_slice(part, n, ep)]
        for n, part in _keys(gathered)
    }
    original = _vector(parts)
    report: dict[str, Any] = {
        "layout": mesh.describe(),
        "ranks": mesh.size,
        "simulated": opts.simulate is not None,
        "mode": f"mystery-{opts.mystery}" if opts.mystery else opts.mode,
        "limit": opts.limit,
        "norm_type": opts.p,
        "reproducible": opts.reproducible,
        "model": {"proportions": opts.model, "seed": opts.seed},
        "model_values": int(sum(math.prod(s) for s in shapes.values())),
        "model_norm": layout_run.true_norm(ep, opts.p, model),  # from the model's definition: the oracle
        "who_counts_what": _kinds(rows, gathered),
    }
    if opts.mystery:
        report["mystery"] = opts.mystery
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
        if per_rank[0].get("split") is not None:  # two clips on every rank: the dense tensors', the experts'
            entry["split"] = [[list(x) for x in r["split"]] for r in per_rank]
        report["correct" if mode == GLOBAL.name else "bug_run"] = entry
    report["holdings"] = _holdings(gathered, parts, opts.p)
    report["global_norm"] = report["correct"]["norms"][0]
    report["scale"] = report["correct"]["scales"][0]
    if opts.bug and not opts.mystery:
        report["bug"] = _bug(opts.bug)
    return report


def _holdings(gathered: list[dict], original: dict[tuple, np.ndarray], p: float) -> list[dict]:
    """Per rank, by kind of tensor: the values it holds, the values it counts (the correct clip),
    and the share of the model's sum of |x|^p those carry (of the gradient before the clip)."""
    total = math.fsum(float(np.sum(np.abs(a) ** p)) for a in original.values()) if math.isfinite(p) else 0.0
    out = []
    for rank, g in enumerate(gathered):
        sent = g[GLOBAL.name]
        held: dict[str, int] = {}
        counted: dict[str, int] = {}
        share: dict[str, float] = {}
        for (name, part, kind, array), counts in zip(sent["pieces"], sent["counts"]):
            held[kind] = held.get(kind, 0) + int(array.size)
            counted[kind] = counted.get(kind, 0) + (int(array.size) if counts else 0)
            part_sum = float(np.sum(np.abs(original[(name, part)]) ** p)) if total and counts else 0.0
            share[kind] = share.get(kind, 0.0) + (part_sum / total if total else 0.0)
        out.append({"rank": rank, "held": held, "counted": counted, "counted_share": share})
    return out


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
    """Per kind of tensor: its pieces, how many ranks hold each, the ranks that count them, its share."""
    kind_of = {(n, k) for g in gathered for n, _, k, _ in g[GLOBAL.name]["pieces"]}
    kinds: dict[str, dict] = {}
    names = dict(kind_of)
    for row in rows:
        first = row.name.split(" = ")[0]
        kind = names.get(first, "?")
        k = kinds.setdefault(
            kind, {"kind": kind, "pieces": 0, "copies": set(), "counted_on": set(), "values": 0, "share": 0.0}
        )
        k["pieces"] += 1
        k["copies"].add(row.copies)
        k["counted_on"].add(row.counted_on)
        k["values"] += math.prod(row.shape)
        k["share"] += row.share
    return [
        {**k, "copies": sorted(k["copies"]), "counted_on": sorted(k["counted_on"])} for k in kinds.values()
    ]


def _explained(tensors: list[dict]) -> list[str]:
    """gclip.explain's rows as a table: the teacher's picture of who counts what."""
    out = [f"   every tensor ({len(tensors)} rows of gclip.explain):"]
    out.append(f"     {'tensor':<34} {'shape':<12} {'held by ranks':<16} {'counted on':>10}  {'share':>7}")
    for t in tensors:
        shape, held = "x".join(map(str, t["shape"])) or "()", ranges(t["ranks"])
        out.append(f"     {t['name']:<34} {shape:<12} {held:<16} {t['counted_on']:>10}  {t['share']:>7.2%}")
    return out


def share_words(share: float) -> str:
    """A share of the sum of squares in plain words: "almost all", "about half", "a small part"."""
    if share >= 0.9:
        return "almost all of it"
    if share < 0.05:
        return "a small part"
    for frac, words in ((3 / 4, "three quarters"), (2 / 3, "two thirds"), (1 / 2, "half"), (1 / 3, "a third"),
                        (1 / 4, "a quarter"), (1 / 5, "a fifth"), (1 / 6, "a sixth"), (1 / 8, "an eighth"),
                        (1 / 10, "a tenth")):  # fmt: skip
        if abs(share - frac) <= 0.1 * frac:
            return f"about {words}"
    return "a part"


def _summary_lines(report: dict) -> list[str]:
    """--explain's student view: per kind of tensor, who holds it, who counts it, its share."""
    p = report["norm_type"]
    what = "sum of squares" if p == 2 else f"sum of |x|^{num(p)}"
    out = ["   who holds and who counts each kind of tensor (--explain full: every tensor):"]
    for k in report["who_counts_what"]:
        copies = "/".join(map(str, k["copies"]))
        if k["copies"] == [1]:
            held = f"{k['pieces']} pieces, each on one rank only, counted there"
        else:
            held = (
                f"{k['pieces']} pieces, each held by {copies} ranks (identical copies), "
                f"counted on one of them: ranks {ranges(k['counted_on'])}"
            )
        out.append(f"     {k['kind']}: {held}")
        share = f"{k['share']:.1%} of the model's {what}"
        out.append(f"       {k['values']:,} values, {share}: {share_words(k['share'])}")
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
    if report["simulated"]:
        lines.append(
            f"  ranks: {r} simulated in this one process (--ranks {r}): the same clip engine and the same "
            "arrays on every rank as on real ranks; the all-reduce is a sum over a list"
        )
    model = report["model"]
    values = "the incidents' proportions" if model["proportions"] == "incidents" else "the lab's values"
    lines.append(
        f"  model: a small transformer, {report['model_values']:,} values ({values}, seed {model['seed']}): "
        "an embedding tied to the output head, attention and MLP weights sharded over tp, layer norms "
        "whole on every tp rank" + (", experts spread over ep" if "ep=" in layout else "")
    )
    lines += [
        "",
        bold("1. local: each rank sums what it COUNTS; a tensor held by a group counts on one of them"),
    ]
    lines.append(f"   {'rank':>4}  {'coords':<16} {'values held':>11}  {'counted':>9}")
    for row in c["per_rank"]:
        coords = " ".join(f"{k}{v}" for k, v in row["coords"].items())
        lines.append(f"   {row['rank']:>4}  {coords:<16} {row['held']:>11,}  {row['counted']:>9,}")
    if opts.explain == "full":
        lines += _explained(report["tensors"])
    elif opts.explain:
        lines += _summary_lines(report)
    else:
        what = "sum of squares" if p == 2 else f"sum of |x|^{num(p)}"
        lines.append("   who counts what (--explain: who holds and counts each kind, in words):")
        for k in report["who_counts_what"]:
            copies = "/".join(map(str, k["copies"]))
            held = "held by 1 rank" if k["copies"] == [1] else f"held by {copies} ranks, counted on one"
            lines.append(
                f"     {k['kind']:<30} {k['pieces']:>4} pieces  {held:<36} {k['share']:.1%} of the {what}"
            )
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


def happened(report: dict) -> list[str]:
    """What the bug's run did, from its numbers alone: the sentences of "What happened"."""
    b, c, limit = report["bug_run"], report["correct"], report["limit"]
    if b["note"]:
        return [b["note"][0].upper() + b["note"][1:] + "."]
    out = []
    if b.get("split"):
        (dense, dense_scale), (experts, experts_scale) = b["split"][0]
        out.append(
            f"Every rank clipped its dense tensors by their own norm {num(dense)} (scale {num(dense_scale)}) "
            f"and its experts by theirs, {num(experts)} (scale {num(experts_scale)}): two norms, neither the "
            f"true one, {num(report['global_norm'])}."
        )
    elif not b["same_on_all_ranks"]:
        out.append("The ranks clipped by different norms: there was no global norm at all.")
    ratio = b["norms"][0] / report["global_norm"] if b["norms"][0] and report["global_norm"] else None
    if ratio is not None and b["same_on_all_ranks"] and abs(ratio - 1) > 1e-9 and not b.get("split"):
        more = "too large: clipped too hard" if ratio > 1 else "too small: clipped too little"
        out.append(f"Every rank used the norm {num(b['norms'][0])}, {num(ratio, 4)} x the true one, {more}.")
    if limit > 0:
        factor = b["clipped_norm"] / limit
        where = "above" if factor > 1 + 1e-9 else "below" if factor < 1 - 1e-9 else "at"
        out.append(
            f"The clipped update is {num(factor, 4)} x the limit ({where} it; the correct clip: "
            f"{num(c['clipped_norm'] / limit, 4)} x)."
        )
    if b["cosine"] is None:
        out.append("No step is left, so no direction: the cosine is undefined.")
    else:
        cos = b["cosine"]
        shown = f"{cos:.10f}" if 1 - 1e-6 < cos < 1 - 1e-12 else _cos(cos)
        if cos > 1 - 1e-12:
            kept = "the direction is kept"
        elif cos > 1 - 1e-4:
            kept = "the direction changed, but hardly: the scales differ little"
        else:
            kept = "the direction changed"
        out.append(f"Its cosine with the gradient is {shown}: {kept}.")
    if b["drifted"]:
        out.append(
            "Copies that must stay identical were scaled differently: they drift apart, step after step."
        )
    return out


def _bug_lines(report: dict, opts: Options) -> list[str]:
    b, c, limit = report["bug_run"], report["correct"], opts.limit
    if opts.mystery:
        lines = [bold(f"mystery {opts.mystery} on the same layout: a layout bug of the gallery (which one?)")]
    else:
        bug = report["bug"]
        lines = [
            bold(f"the {bug['name']} bug on the same layout: {bug['summary']}"),
            f"  seen in: {bug['incident'] or '(no public incident confirmed: a teaching example)'}",
        ]
    if b["note"]:
        lines += [red("  " + b["note"]), ""]
        if not opts.mystery:
            lines += [bold("Why:"), *wrap(report["bug"]["explanation"], "  ")]
        return lines
    label = f"mystery {opts.mystery}" if opts.mystery else "bug"
    lines.append(f"   {'ranks':<10}{'correct: norm -> scale':<28}{label}: norm -> scale")
    groups: dict[str, list[int]] = {}  # ranks with the same numbers share a line
    for good, bad in zip(c["per_rank"], b["per_rank"]):
        left = f"{num(good['norm'])} -> {num(good['scale'])}"
        right = f"{num(bad['norm'])} -> {num(bad['scale'])}"
        groups.setdefault(f"{left:<28}{right}", []).append(good["rank"])
    for text, ranks in groups.items():
        lines.append(f"   {ranges(ranks):<10}{text}")
    if limit > 0:
        lines.append(
            f"   clipped model norm: correct {num(c['clipped_norm'], 8)}, "
            f"{label} {num(b['clipped_norm'], 8)} ({num(b['clipped_norm'] / limit, 4)} x limit)"
        )
    lines.append(f"   cosine with the original: correct {_cos(c['cosine'])}, {label} {_cos(b['cosine'])}")
    if b["drifted"]:
        lines.append(
            red(f"   copies that no longer agree after the clip: {', '.join(b['drifted'][:4])}")
            + (f" and {len(b['drifted']) - 4} more" if len(b["drifted"]) > 4 else "")
        )
    lines += ["", bold("What happened:"), *wrap(" ".join(happened(report)), "  ")]
    if not opts.mystery:
        lines += [bold("Why:"), *wrap(report["bug"]["explanation"], "  ")]
    return lines


def _cos(c: float | None) -> str:
    return "undefined" if c is None else f"{c:.6f}"
