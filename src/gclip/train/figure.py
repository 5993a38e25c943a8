"""The trainer's figure (``--plot``): loss, the norm of the update applied, its direction."""

from __future__ import annotations

import math

import numpy as np

from .loop import Config, Run
from .model import Model

__all__ = ["plot"]


def plot(path: str, runs: list[Run], config: Config, ranks: int) -> None:
    """Loss curves, the norm of the update actually applied, and its direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(8, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.4]}
    )
    styles = {"global": ("tab:blue", "-")}
    for run in reversed(runs):
        colour, line = styles.get(run.mode, ("tab:red", "--"))
        if config.clip != "fixed":
            label = f"clip {config.clip}: scaled down on {run.steps_any_rank_scaled_down}/{config.steps} "
        else:
            label = f"{run.mode}: update above max_norm on {run.steps_above(config.max_norm)}/{config.steps} "
        label += f"steps, final loss {run.final_loss:.4f}"
        steps = np.arange(len(run.losses))
        top.plot(steps, run.losses, line, color=colour, lw=2, label=label)
        middle.plot(
            steps, run.update_norms, line, color=colour, lw=1.5, label=f"{run.mode}: update", zorder=3
        )
        cosines = [math.nan if c is None else c for c in run.cosines]  # undefined: a gap in the line
        bottom.plot(steps, cosines, line, color=colour, lw=1.5, label=run.mode)
    adaptive = config.clip != "fixed" or config.spike is not None
    if adaptive:  # the spike, the gradient's norm before the clip and the limit the clip took
        run = runs[0]
        steps = np.arange(len(run.true_norms))
        middle.plot(steps, run.true_norms, color="tab:orange", lw=1, label="gradient norm (before the clip)")
        limits = list(run.limits) or [config.max_norm] * len(steps)
        if config.clip != "agc":
            middle.plot(steps, limits, color="tab:green", lw=1, ls="--", label=f"limit ({config.clip})")
        if config.spike is not None and config.spike < len(steps):
            middle.axvline(config.spike, color="grey", lw=1, ls=":", label=f"spike (step {config.spike})")
        middle.set_yscale("log")
    else:
        middle.axhline(config.max_norm, color="grey", lw=1, ls=":", label=f"max_norm = {config.max_norm:g}")
    if any(not r.mode == "global" for r in runs) and ranks > 1:
        middle.axhline(
            math.sqrt(ranks) * config.max_norm, color="grey", lw=1, ls="-.", label=f"sqrt({ranks}) x max_norm"
        )
    top.set_ylabel("training loss")
    top.set_yscale("log")
    title = "loss (cross-entropy, full batch)"
    if config.clip == "fixed" and any(max(r.update_norms) > config.max_norm * (1 + 1e-9) for r in runs):
        title += ": a bug that oversteps the limit (middle) may even fall faster"
    top.set_title(title, fontsize=10)
    middle.set_ylabel("norm")
    middle.set_title(
        f"clip {config.clip}: the gradient's norm, the limit, the update applied (after clipping)"
        if adaptive
        else "global norm of the whole update applied (after clipping): clipping promises <= max_norm",
        fontsize=10,
    )
    bottom.set_ylabel("cosine")
    bottom.set_title("cos(update applied, raw gradient): 1 = direction kept", fontsize=10)
    bottom.set_xlabel("step")
    for ax in (top, middle, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    model = Model()
    fig.suptitle(
        f"gclip.train: MLP {model.inputs}-{model.hidden}-{model.classes}, weights sharded over {ranks} "
        f"{'simulated ' if config.simulated else ''}rank{'s' * (ranks != 1)}, lr {config.lr:g}, "
        f"seed {config.seed}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
