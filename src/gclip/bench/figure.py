"""The bench's figures: time per clip against size, ratios to the floor, the ranks sweep."""

from __future__ import annotations

from typing import Any

from .._lab import plots
from .table import find_row

__all__ = ["plot_results", "plot_sweep"]


def plot_results(result: dict[str, Any], path: str) -> None:
    """Time per active clip against size, per dtype; and each clip's ratio to the floor."""
    rows = result["rows"]
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: d != "float64")
    fig, axes = plots.figure(len(dtypes) + 1, title=f"gclip.bench: {result['ranks']} ranks, 1 step")
    colors = {"floor": plots.COLORS["bound"], "gclip": plots.COLORS["correct"], "gclip-repro": "#457b9d"}
    colors.update({"torch": plots.COLORS["bug"], "torch-f64acc": plots.COLORS["other"]})
    for ax, dtype in zip(axes, dtypes):
        mine = [r for r in rows if r["dtype"] == dtype and r["active"]]
        sizes = sorted({r["n"] for r in mine})
        series = {
            impl: [find_row(rows, n, dtype, True, impl)["median_s"] for n in sizes]
            for impl in colors
            if all(find_row(rows, n, dtype, True, impl) for n in sizes)
        }
        plots.lines(
            ax,
            sizes,
            series,
            title=f"{dtype}, clipping active",
            xlabel="elements per rank",
            ylabel="seconds per clip (median)",
            colors=colors,
            dashed=("floor",),
            log=True,
        )
        ax.set_xscale("log")
    ax = axes[-1]
    sizes = sorted({r["n"] for r in rows})
    series, tints, dashed = {}, {}, []
    for dtype, tint in zip(dtypes, (plots.COLORS["correct"], "#457b9d")):
        for impl, active in (("gclip", True), ("gclip", False), ("torch", True)):
            got = [find_row(rows, n, dtype, active, impl) for n in sizes]
            if all(got):
                name = f"{impl} {dtype} {'active' if active else 'off'}"
                series[name] = [g["vs_floor"] for g in got]
                tints[name] = (
                    tint if impl == "gclip" else plots.COLORS["bug" if dtype == "float64" else "other"]
                )
                if not active or impl == "torch":
                    dashed.append(name)
    plots.lines(
        ax,
        sizes,
        series,
        title="time / floor (1 = the floor)",
        xlabel="elements per rank",
        ylabel="x floor",
        colors=tints,
        dashed=dashed,
        log=True,
    )
    ax.axhline(1.0, color=plots.COLORS["limit"], linewidth=1)
    ax.set_xscale("log")
    plots.save(fig, path)


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """Time per active clip against size, one line per rank count (the floor dashed)."""
    rows = result["sweep"]
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: d != "float64")
    fig, axes = plots.figure(len(dtypes), title="gclip.bench --ranks-sweep: active clip step")
    for ax, dtype in zip(axes, dtypes):
        sizes = sorted({r["n"] for r in rows if r["dtype"] == dtype})
        series, tints = {}, {}
        palette = [plots.COLORS[c] for c in ("correct", "limit", "bug", "other", "bound")]
        for i, k in enumerate(sorted({r["ranks"] for r in rows})):
            got = {r["n"]: r for r in rows if r["dtype"] == dtype and r["ranks"] == k and r["active"]}
            if all(n in got for n in sizes):
                series[f"gclip R={k}"] = [got[n]["gclip_s"] for n in sizes]
                series[f"floor R={k}"] = [got[n]["floor_s"] for n in sizes]
                tints[f"gclip R={k}"] = tints[f"floor R={k}"] = palette[i % len(palette)]
        dashed = [name for name in series if name.startswith("floor")]
        plots.lines(
            ax,
            sizes,
            series,
            title=dtype,
            xlabel="elements per rank",
            ylabel="seconds per clip",
            colors=tints,
            dashed=dashed,
            log=True,
        )
        ax.set_xscale("log")
    plots.save(fig, path)
