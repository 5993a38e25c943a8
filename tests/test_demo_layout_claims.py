"""Every layout bug's explanation, checked against the numbers of its own runs (simulated ranks).

The "Why" of each layout bug of the gallery states claims: the direction kept or changed, the norm
too large or too small, by how much (sqrt(dp), sqrt(1 + s), sqrt(1 + (tp - 1) d)), copies that drift
apart, a bound of the update. Each claim is a phrase with a check on the run's report; every layout
bug is run on the 3-D layouts where it shows, on the lab's model and under --model incidents, and
every claim its text makes must hold there. A sentence about the direction must be one of the
checked claims. "What happened" (built from the numbers) must give the factor against the limit
and the cosine, and say "kept" exactly when the cosine is 1.

The oracles are the report's own parts: per-rank norms, the clipped norm, the cosine, the shares
of gclip.explain, and the model's norm from its definition (math.fsum over every tensor once).
"""

from __future__ import annotations

import math
import re

import pytest

from gclip import gallery
from gclip.demo.layout import happened, run_layout_simulated
from gclip.demo.options import _shows_on, layout_axes, parse_args

LAYOUTS_3D = ["pp=2,dp=2,tp=2", "dp=2,ep=2,tp=2", "pp=2,ep=2,tp=2"]
MODELS = ["lab", "incidents"]


def simulated(layout: str, bug: str | None = None, model: str = "lab") -> dict:
    axes = layout_axes(layout)
    argv = ["--layout", layout, "--model", model, "--ranks", str(math.prod(axes.values())), "--json"]
    return run_layout_simulated(parse_args([*argv, *(["--buggy", bug] if bug else [])], None))


def _ratio(r: dict) -> float:
    return r["bug_run"]["norms"][0] / r["model_norm"]


def _share(r: dict, kind: str) -> float:
    return math.fsum(k["share"] for k in r["who_counts_what"] if k["kind"].endswith(kind))


def _one_scale(r: dict) -> bool:
    return r["bug_run"]["same_on_all_ranks"]


def _axis(r: dict, name: str) -> int:
    return layout_axes(r["layout"]).get(name, 1)


def _above_bound(r: dict, b: dict, axis: str) -> bool:
    return b["clipped_norm"] <= math.sqrt(_axis(r, axis)) * r["limit"] * (1 + 1e-12)


def _grows_like(r: dict, want: float) -> bool:
    return _ratio(r) == pytest.approx(want, rel=1e-9)


def _too_large(r: dict, b: dict) -> bool:
    return all(n > r["model_norm"] for n in b["norms"])


# phrase of a "Why" -> what must be true of the run (r: the report, b: the bug's run)
CLAIMS = {
    "the direction is kept": lambda r, b: _one_scale(r) and b["cosine"] == pytest.approx(1, abs=1e-12),
    "keep it almost exactly": lambda r, b: 1 - 1e-4 < b["cosine"] < 1,
    "keep the direction almost exactly": lambda r, b: 1 - 1e-4 < b["cosine"] < 1,
    "sqrt(dp) times too large": lambda r, b: _grows_like(r, math.sqrt(_axis(r, "dp"))),
    "clipped too hard": _too_large,
    "clipping fires too early": _too_large,
    "too small": lambda r, b: all(n < r["model_norm"] for n in b["norms"]),
    "clipped too little": lambda r, b: b["clipped_norm"] > r["limit"],
    "the step is too short": lambda r, b: b["clipped_norm"] < r["limit"],
    "the step is too long": lambda r, b: b["clipped_norm"] > r["limit"],
    "up to sqrt(pp) x the limit": lambda r, b: _above_bound(r, b, "pp"),
    "up to sqrt(ep) x the limit": lambda r, b: _above_bound(r, b, "ep"),
    "drift apart": lambda r, b: bool(b["drifted"]),
    "the ranks no longer hold the same model": lambda r, b: bool(b["drifted"]),
    "it grows by sqrt(1 + s)": lambda r, b: _grows_like(r, math.sqrt(1 + _share(r, "embedding"))),
    "grows by sqrt(1 + (tp - 1) d)": lambda r, b: _grows_like(
        r, math.sqrt(1 + (_axis(r, "tp") - 1) * _share(r, "tp-duplicate"))
    ),
    "the direction changes": lambda r, b: b["cosine"] < 1 - 1e-9,
    "up to sqrt(2) x the limit": lambda r, b: (
        r["limit"] * (1 + 1e-9) < b["clipped_norm"] <= math.sqrt(2) * r["limit"] * (1 + 1e-12)
    ),
    "leaves every other rank waiting": lambda r, b: "returned without entering the all-reduce" in b["note"],
}


def _runs() -> list[tuple[str, str, str]]:
    out = []
    for bug in gallery.LAYOUT_BUGS:
        for layout in LAYOUTS_3D:
            if _shows_on(bug, layout_axes(layout)):
                out += [(bug.name, layout, model) for model in MODELS]
    return out


@pytest.mark.parametrize("bug,layout,model", _runs(), ids=str)
def test_each_claim_of_the_explanation_holds_on_the_run(bug, layout, model):
    r = simulated(layout, bug, model)
    b, why = r["bug_run"], r["bug"]["explanation"]
    made = [phrase for phrase in CLAIMS if phrase in why]
    assert made, why  # every explanation makes a checked claim
    for phrase in made:
        assert CLAIMS[phrase](r, b), (phrase, b["norms"][:1], b["clipped_norm"], b["cosine"])
    for sentence in re.split(r"(?<=\.) ", why):
        if "direction" in sentence:
            assert any(p in sentence for p in made), sentence  # no unchecked claim about the direction


@pytest.mark.parametrize("bug,layout,model", _runs(), ids=str)
def test_what_happened_gives_the_factor_against_the_limit_and_the_cosine(bug, layout, model):
    r = simulated(layout, bug, model)
    b = r["bug_run"]
    text = " ".join(happened(r))
    if b["note"]:  # the hang: no update at all
        assert "returned without entering the all-reduce" in text
        return
    factor = b["clipped_norm"] / r["limit"]
    assert f"The clipped update is {factor:.4g} x the limit" in text, text
    assert "cosine with the gradient is" in text
    shown = float(re.search(r"cosine with the gradient is ([\d.]+)", text).group(1))
    assert shown == pytest.approx(b["cosine"], abs=1e-6)
    assert ("the direction is kept" in text) == (b["cosine"] > 1 - 1e-12), text


def test_the_scale_laws_numbers_are_the_runs():
    """The numbers the texts give: the shares on the lab's model and under incidents, and the
    factors they give at tp = 2, 4, 8 (tp-duplicates-summed) and on a pipeline (tied-counted-twice)."""
    tp_why = gallery.LAYOUT_BUG_NAMES["tp-duplicates-summed"].explanation
    tied_why = gallery.LAYOUT_BUG_NAMES["tied-counted-twice"].explanation
    lab, incidents = simulated("pp=2,dp=2,tp=2"), simulated("pp=2,dp=2,tp=2", model="incidents")
    assert f"on the lab's model d is about {_share(lab, 'tp-duplicate'):.0%}" in tp_why
    assert f"under --model incidents {_share(incidents, 'tp-duplicate'):.0%}" in tp_why
    assert f"On the lab's model s is about {_share(lab, 'embedding'):.0%}" in tied_why
    assert f"under --model incidents {_share(incidents, 'embedding'):.0%}" in tied_why
    for tp in (2, 4, 8):
        ratio = _ratio(simulated(f"tp={tp}", "tp-duplicates-summed", "incidents"))
        assert f"{ratio:.2f}x at tp = {tp}" in tp_why
    tied = _ratio(simulated("pp=2,dp=2,tp=2", "tied-counted-twice", "incidents"))
    assert f"({tied:.2f}x)" in tied_why


def test_the_incidents_model_makes_the_tied_and_tp_bugs_as_large_as_the_incidents():
    """On the lab's layouts under --model incidents: tied-counted-twice and tp-duplicates-summed
    move the norm by at least 1.2x (the incidents: 1.36x to 1.52x at TP=8, sqrt(2) for a tied
    weight that is the whole gradient), against below 1.01x on the lab's values."""
    tied = _ratio(simulated("pp=2,dp=2,tp=2", "tied-counted-twice", "incidents"))
    dups = _ratio(simulated("pp=2,dp=1,tp=4", "tp-duplicates-summed", "incidents"))
    assert tied >= 1.2 and dups >= 1.2
    assert 1.36 <= _ratio(simulated("tp=8", "tp-duplicates-summed", "incidents")) <= 1.52
    assert _ratio(simulated("pp=2,dp=2,tp=2", "tied-counted-twice")) < 1.01
    r = simulated("pp=2,dp=2,tp=2", model="incidents")  # the correct clip: still the model's norm
    assert r["global_norm"] == pytest.approx(r["model_norm"], rel=1e-12)


def test_the_layout_plot_draws_who_holds_counts_and_the_norms_used(tmp_path):
    """--plot with --layout: panel 1 the values each rank holds, panel 2 the share of the sum of
    squares each rank counts (summing to the whole model once), panel 3 the norm each rank used,
    correct and bug; a mystery's figure names no bug."""
    pytest.importorskip("matplotlib")
    from gclip._lab import plots
    from gclip.demo.figure import render_layout_plot

    for argv, hidden in (
        (["--buggy", "tied-counted-twice"], None),
        (["--seed", "43", "--mystery", "2"], "mystery 2"),
    ):
        opts = parse_args(["--layout", "pp=2,dp=2,tp=2", "--model", "incidents", "--ranks", "8", *argv], None)
        r = run_layout_simulated(opts)
        total = math.fsum(v for h in r["holdings"] for v in h["counted_share"].values())
        assert total == pytest.approx(1.0, rel=1e-12)  # every element counted once
        held = [sum(h["held"].values()) for h in r["holdings"]]
        assert held == [row["held"] for row in r["correct"]["per_rank"]]
        seen: dict = {}
        original = plots.bars

        def spy(ax, labels, series, seen=seen, original=original, **kw):
            seen.update(series)
            return original(ax, labels, series, **kw)

        plots.bars = spy
        try:
            size = render_layout_plot(r, opts, str(tmp_path / "layout.png"))
        finally:
            plots.bars = original
        assert size > 10_000 and (tmp_path / "layout.png").read_bytes()[:4] == b"\x89PNG"
        assert seen["correct"] == [row["norm"] for row in r["correct"]["per_rank"]]
        label = hidden or "tied-counted-twice"
        assert seen[label] == [row["norm"] for row in r["bug_run"]["per_rank"]]
        if hidden:
            assert not any(name in str(seen) for name in gallery.LAYOUT_BUG_NAMES)


def test_explain_summarizes_each_kind_of_tensor_in_words_and_full_lists_every_row():
    """--explain (the students' view): per kind of tensor, its pieces, how many ranks hold each,
    the ranks that count them and its share of the sum of squares, against the model's own pieces
    on every rank (the oracle: transformer.pieces and the tensors' values, not gclip.explain);
    --explain full: one row per piece."""
    from gclip._lab import transformer
    from gclip.demo.layout import render_layout
    from gclip.layout import Mesh, ranges

    layout, shape = "pp=2,dp=2,tp=2", {"pp": 2, "dp": 2, "tp": 2}
    model = transformer.Model("incidents", 0)
    holders: dict[tuple, list[int]] = {}
    kind_of: dict[tuple, str] = {}
    sumsq: dict[tuple, float] = {}
    for r in range(8):
        for piece in transformer.pieces(Mesh((r, 8), **shape), model=model):
            key = (piece.name, piece.part)
            holders.setdefault(key, []).append(r)
            kind_of[key] = piece.kind
            sumsq[key] = math.fsum(float(v) ** 2 for v in piece.array.ravel())
    total = math.fsum(sumsq.values())
    opts = parse_args(["--layout", layout, "--model", "incidents", "--explain", "--ranks", "8"], None)
    text = render_layout(run_layout_simulated(opts), opts)
    for kind in sorted(set(kind_of.values())):
        keys = [k for k in holders if kind_of[k] == kind]
        copies = sorted({len(holders[k]) for k in keys})
        counted = sorted({min(holders[k]) for k in keys})
        share = math.fsum(sumsq[k] for k in keys) / total
        held = f"each held by {'/'.join(map(str, copies))} ranks (identical copies), counted on one of them"
        assert f"{kind}: {len(keys)} pieces, {held}: ranks {ranges(counted)}" in text, kind
        assert f"{share:.1%} of the model's sum of squares" in text, kind
    assert "about half" in text  # the tied embedding under --model incidents, in words
    assert "rows of gclip.explain" not in text
    full = parse_args(["--layout", layout, "--explain", "full", "--ranks", "8"], None)
    rows = render_layout(run_layout_simulated(full), full)
    assert f"every tensor ({len(holders)} rows of gclip.explain)" in rows  # one per piece (pp=2: no head)
