"""What rank 0 prints: one JSON object (``--json``) or a short table of the run."""

from __future__ import annotations

from collections.abc import Sequence

from .._lab.cli import say
from .._lab.jsonout import dumps
from .loop import Config, Run, departs_at, digest
from .model import CLASSES, Model

__all__ = ["json_report", "summary", "text_report"]


def summary(run: Run, config: Config, ranks: int) -> dict:
    """One run as a dict, ready for JSON (an undefined cosine is None: null)."""
    return {
        "mode": run.mode,
        "ranks": ranks,
        "steps": config.steps,
        "seed": config.seed,
        "lr": config.lr,
        "max_norm": config.max_norm,
        "norm_type": config.norm_type,  # inf is written "inf"
        "reproducible": config.reproducible,
        "layout": config.layout,
        "params": Model().flat_size + CLASSES,
        "clipped_steps": run.clipped_steps,
        "final_loss": run.final_loss,
        "losses": run.losses,
        "grad_norms": run.grad_norms,
        "update_norms": run.update_norms,
        "cosines": run.cosines,
        "digest": digest(run.losses),
    }


def json_report(runs: list[Run], config: Config, ranks: int) -> str:
    """The run (and the correct run it is compared with, if any) as one line of strict JSON."""
    out = summary(runs[0], config, ranks)
    if len(runs) > 1:
        ref = runs[1]
        out["correct"] = {
            "mode": ref.mode,
            "losses": ref.losses,
            "final_loss": ref.final_loss,
            "clipped_steps": ref.clipped_steps,
            "update_norms": ref.update_norms,
            "cosines": ref.cosines,
            "digest": digest(ref.losses),
        }
        out["departs_at"] = departs_at(runs[0].losses, ref.losses)
    return dumps(out)


def text_report(runs: list[Run], config: Config, ranks: int) -> None:
    """A few steps of the run, its digest, and how it compares with the correct run (rank 0 prints)."""
    run = runs[0]
    model = Model()
    where = (
        f"laid out as {config.layout.replace(',', ' x ')} (W1, b1, W2 cut over tp, b2 whole on each tp rank)"
        if config.layout
        else f"{model.flat_size} weights sharded over {ranks} rank(s) + {CLASSES} replicated"
    )
    say(
        f"gclip.train: MLP {model.inputs}-{model.hidden}-{model.classes}, {where}; mode {run.mode}, "
        f"max_norm {config.max_norm:g}, lr {config.lr:g}, reproducible={config.reproducible}"
    )
    say(f"{'step':>6} {'loss':>12} {'clip norm':>12} {'applied':>10}  clipped")
    every = max(1, config.steps // 10)
    for i in range(config.steps):
        if i % every == 0 or i == config.steps - 1:
            mark = "yes" if run.clipped[i] else ""
            norms = f"{run.grad_norms[i]:>12.4g} {run.update_norms[i]:>10.4g}"
            say(f"{i:>6} {run.losses[i]:>12.6f} {norms}  {mark}")
    say(f"final loss {run.final_loss:.6f}; clipped on {run.clipped_steps} of {config.steps} steps")
    say(f"trajectory digest {digest(run.losses)} (equal digests: bitwise-equal losses)")
    if len(runs) > 1:
        ref = runs[1]
        at = departs_at(run.losses, ref.losses)
        where = "never" if at is None else f"at step {at}"
        say(
            f"correct run (global): final loss {ref.final_loss:.6f}, clipped on {ref.clipped_steps} steps; "
            f"the {run.mode} run departs from it {where}"
        )
        say(
            f"largest update applied: {run.mode} {max(run.update_norms):.4g}, "
            f"global {max(ref.update_norms):.4g} (limit {config.max_norm:g}); smallest cos(update, "
            f"gradient): {run.mode} {_smallest(run.cosines)}, global {_smallest(ref.cosines)}"
        )


def _smallest(cosines: Sequence[float | None]) -> str:
    """The smallest defined cosine; "undefined" when no step had one (a zero or non-finite update)."""
    defined = [c for c in cosines if c is not None]
    return f"{min(defined):.4f}" if defined else "undefined"
