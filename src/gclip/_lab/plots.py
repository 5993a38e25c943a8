"""Small matplotlib helpers for the demo, the trainer and the bench.

matplotlib is an optional extra (``pip install 'gclip[plot]'``): nothing here
imports it at module level, and :func:`require` turns its absence into a
one-line usage error. Figures are plain ``matplotlib.figure.Figure`` objects
rendered by the Agg backend: no pyplot, no global state, no display needed,
so they are safe to build on rank 0 of an MPI job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .cli import UsageError

__all__ = ["COLORS", "MISSING", "bars", "figure", "finish", "lines", "require", "save"]

MISSING = "plots need matplotlib, which is not installed: pip install 'gclip[plot]'"

# one meaning per colour across every gclip figure
COLORS = {
    "correct": "#2a9d8f",
    "bug": "#e76f51",
    "limit": "#264653",
    "bound": "#8d99ae",
    "other": "#e9c46a",
    "neutral": "#8ecae6",
}


def require() -> None:
    """Raise a one-line UsageError if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # any broken install counts as missing
        raise UsageError(MISSING) from None


def figure(panels: int, *, title: str | None = None, width: float = 5.2, height: float = 4.4) -> tuple:
    """(figure, list of axes): ``panels`` side by side, rendered by Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    if title:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    return fig, list(axes)


def _log_ok(values: Sequence[float]) -> bool:
    return all(v > 0 and math.isfinite(v) for v in values)


def bars(
    ax: Any,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    ylabel: str,
    colors: Mapping[str, str] | None = None,
    hlines: Mapping[str, tuple[float, str]] | None = None,
    log: bool = False,
    annotate: bool = True,
) -> None:
    """Grouped bars (one group per label, one bar per series) and labelled horizontal lines.

    ``hlines`` maps a legend label to (y, colour). ``log`` is ignored when a
    value is not positive (a log axis cannot show it).
    """
    colors = colors or {}
    names = list(series)
    width = 0.8 / max(1, len(names))
    values = [v for s in series.values() for v in s] + [y for y, _ in (hlines or {}).values()]
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
        heights = [v if math.isfinite(v) else 0.0 for v in series[name]]
        rects = ax.bar(xs, heights, width * 0.92, label=name, color=colors.get(name))
        if annotate:
            ax.bar_label(rects, labels=[_short(v) for v in series[name]], fontsize=7, padding=2)
    for name, (y, color) in (hlines or {}).items():
        if math.isfinite(y):
            ax.axhline(y, color=color, linestyle="--", linewidth=1.5, label=name)
    ax.set_xticks(range(len(labels)), labels)
    top = max((v for v in values if math.isfinite(v)), default=0.0)
    if log and _log_ok(values):
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 3, top * 30)  # room for the legend above the bars
    elif top > 0:
        ax.set_ylim(0, top * 1.35)
    finish(ax, title, ylabel)


def lines(
    ax: Any,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    colors: Mapping[str, str] | None = None,
    dashed: Sequence[str] = (),
    log: bool = False,
) -> None:
    """One line per series over ``x``; names in ``dashed`` are drawn as thin reference lines."""
    colors = colors or {}
    for name, ys in series.items():
        if name in dashed:
            ax.plot(x, ys, linestyle=":", linewidth=1.5, color=colors.get(name), label=name)
        else:
            ax.plot(x, ys, marker="o", markersize=4, linewidth=2, color=colors.get(name), label=name)
    ax.set_xlabel(xlabel)
    if log and _log_ok([v for ys in series.values() for v in ys]):
        ax.set_yscale("log")
    finish(ax, title, ylabel)


def finish(ax: Any, title: str, ylabel: str) -> None:
    """A panel's title, y label, grid and legend, the same on every figure."""
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _short(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


def save(fig: Any, path: str | os.PathLike, *, dpi: int = 100) -> int:
    """Write the figure as PNG; returns its size in bytes. A write error is a one-line UsageError."""
    try:
        fig.savefig(path, dpi=dpi, format="png")
        return os.path.getsize(path)
    except OSError as exc:
        raise UsageError(f"cannot write the plot {os.fspath(path)!r}: {exc.strerror or exc}") from None
