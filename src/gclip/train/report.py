"""What rank 0 prints: one JSON object (``--json``) or a short table of the run.

Every norm is named for what it is. ``norms_used`` is, per step, the norm each
rank's clip used (under a per-rank bug each rank has its own);
``true_global_norms`` the global norm of the gradient the ranks clipped (the
replicated bias once): the norm a correct clip uses. ``update_norms`` is the
global norm of the update applied, which a clip promises to keep at most
``max_norm``; ``steps_above_limit`` counts the steps where it was not.
``steps_any_rank_scaled_down`` counts the steps on which at least one rank scaled its part
down, ``ranks_scaled`` says how many did, step by step.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._lab.cli import say
from .._lab.jsonout import dumps
from .loop import SPIKE, Config, Run, departs_at, digest
from .model import CLASSES, Model

__all__ = ["columns", "json_report", "summary", "text_report", "why_lower"]


def _measures(run: Run, config: Config) -> dict:
    """The per-step measures of a run and its counts, named for what they hold."""
    return {
        "losses": run.losses,
        "final_loss": run.final_loss,
        "norms_used": run.norms_used,
        "true_global_norms": run.true_norms,
        "update_norms": run.update_norms,
        "cosines": run.cosines,
        "ranks_scaled": run.ranks_scaled,
        "steps_any_rank_scaled_down": run.steps_any_rank_scaled_down,
        "steps_scaled_on_every_rank": run.scaled_everywhere_steps,
        "steps_above_limit": run.steps_above(config.max_norm),
        "same_norm_on_all_ranks": run.same_norm_on_all_ranks,
        "digest": digest(run.losses),
    }


def _clip_keys(run: Run, config: Config) -> dict:
    """--clip's and --spike's keys (none without them: the fixed clip's report is unchanged)."""
    if config.clip == "fixed" and config.spike is None:
        return {}
    out: dict = {"clip": config.clip, "spike_step": config.spike, "limits": list(run.limits) or None}
    if config.spike is not None and config.spike < len(run.true_norms):
        out["spike"] = _spike(run, config)
    return out


def _spike(run: Run, config: Config) -> dict:
    """The spike step: the gradient's norm, the limit the clip used, the update applied."""
    k = config.spike
    assert k is not None
    limit = run.limits[k] if run.limits else config.max_norm
    before = run.true_norms[k - 1] if k > 0 else None
    return {
        "step": k,
        "norm": run.true_norms[k],
        "norm_before": before,
        "limit": limit,
        "update_norm": run.update_norms[k],
        "clipped": run.ranks_scaled[k] > 0,
    }


def summary(run: Run, config: Config, ranks: int) -> dict:
    """One run as a dict, ready for JSON (an undefined cosine is None: null)."""
    return {
        "mode": run.mode,
        "ranks": ranks,
        "simulated": config.simulated,
        "steps": config.steps,
        "seed": config.seed,
        "lr": config.lr,
        "max_norm": config.max_norm,
        "norm_type": config.norm_type,  # inf is written "inf"
        "reproducible": config.reproducible,
        "layout": config.layout,
        "params": Model().flat_size + CLASSES,
        **_measures(run, config),
        **_clip_keys(run, config),
    }


def json_report(runs: list[Run], config: Config, ranks: int) -> str:
    """The run (and the correct run it is compared with, if any) as one line of strict JSON."""
    out = summary(runs[0], config, ranks)
    if len(runs) > 1:
        ref = runs[1]
        out["correct"] = {"mode": ref.mode, **_measures(ref, config)}
        out["departs_at"] = departs_at(runs[0].losses, ref.losses)
    return dumps(out)


def columns(run: Run, ranks: int) -> list[tuple[str, str]]:
    """The table's norm columns, (first header line, second), labelled per mode."""
    if run.mode == "global":
        return [("global norm", "(all ranks)")]
    if run.same_norm_on_all_ranks:
        return [("norm used", "(all ranks)"), ("true global", "norm")]
    return [("norm used", "(rank 0)"), ("true global", "norm")]


def text_report(runs: list[Run], config: Config, ranks: int) -> None:
    """A few steps of the run, its digest, and how it compares with the correct run (rank 0 prints)."""
    run = runs[0]
    model = Model()
    where = (
        f"laid out as {config.layout.replace(',', ' x ')} (W1, b1, W2 cut over tp, b2 whole on each tp rank)"
        if config.layout
        else f"{model.flat_size} weights sharded over {ranks} rank{'s' * (ranks != 1)} + {CLASSES} replicated"
    )
    say(
        f"gclip.train: MLP {model.inputs}-{model.hidden}-{model.classes}, {where}; mode {run.mode}, "
        f"max_norm {config.max_norm:g}, lr {config.lr:g}, reproducible={config.reproducible}"
    )
    if config.simulated:
        say(f"  ranks: {ranks} simulated in this one process (--ranks {ranks}): the same clip engine")
    elif ranks == 1 and not config.layout:
        say("  note: this ran on 1 rank, so the clip had nothing to combine (and a per-rank bug is the")
        say("        correct clip). Start it with mpirun -n 4 python -m gclip.train ..., or add --ranks 4")
    _table(run, config, ranks)
    above = run.steps_above(config.max_norm)
    say(f"final loss {run.final_loss:.6f}")
    say(
        f"scaled down on at least one rank: {run.steps_any_rank_scaled_down} of {config.steps} steps "
        f"(on every rank: {run.scaled_everywhere_steps})"
    )
    say(f"update applied above max_norm {config.max_norm:g}: {above} of {config.steps} steps")
    say(f"trajectory digest {digest(run.losses)} (equal digests: bitwise-equal losses)")
    if config.clip != "fixed" or config.spike is not None:
        for line in _clip_lines(run, config):
            say(line)
    if len(runs) > 1:
        ref = runs[1]
        at = departs_at(run.losses, ref.losses)
        where = "never" if at is None else f"at step {at}"
        say(
            f"correct run (global): final loss {ref.final_loss:.6f}, scaled down on "
            f"{ref.steps_any_rank_scaled_down} steps, update above max_norm on "
            f"{ref.steps_above(config.max_norm)}; the {run.mode} run departs from it {where}"
        )
        say(
            f"largest update applied: {run.mode} {max(run.update_norms):.4g}, "
            f"global {max(ref.update_norms):.4g} (limit {config.max_norm:g}); smallest cos(update, "
            f"gradient): {run.mode} {_smallest(run.cosines)}, global {_smallest(ref.cosines)}"
        )
        for line in why_lower(run, ref, config):
            say(line)


def _clip_lines(run: Run, config: Config) -> list[str]:
    clipped = [i for i, k in enumerate(run.ranks_scaled) if k]
    lines = [f"clip {config.clip}: scaled down on {len(clipped)} steps ({_steps(clipped)})"]
    if config.spike is not None and config.spike < len(run.true_norms):
        s = _spike(run, config)
        limit = "unit-wise" if s["limit"] != s["limit"] else f"{s['limit']:.4g}"
        before = "" if s["norm_before"] is None else f" (the step before: {s['norm_before']:.4g})"
        lines.append(
            f"spike at step {s['step']} (gradient x {SPIKE:g}): norm {s['norm']:.4g}{before}, limit "
            f"{limit}, update applied {s['update_norm']:.4g}: {'clipped' if s['clipped'] else 'NOT clipped'}"
        )
    return lines


def _steps(steps: list[int]) -> str:
    shown = ", ".join(str(i) for i in steps[:8])
    return shown + (", ..." if len(steps) > 8 else "") if steps else "none"


def _table(run: Run, config: Config, ranks: int) -> None:
    cols = columns(run, ranks)
    heads = [("step", ""), ("loss", ""), *cols, ("update", "applied"), ("ranks that", "scaled down")]
    heads.append(("update above", "max_norm"))
    widths = [6, 10] + [12] * len(cols) + [10, 12, 13]
    for line in (0, 1):
        say("  ".join(f"{h[line]:>{w}}" for h, w in zip(heads, widths)).rstrip())
    every = max(1, config.steps // 10)
    for i in range(config.steps):
        if i % every and i != config.steps - 1:
            continue
        norms = [f"{run.norms_used[i][0]:.4g}"]
        if len(cols) > 1:
            norms.append(f"{run.true_norms[i]:.4g}")
        above = "yes" if run.update_norms[i] > config.max_norm * (1 + 1e-9) else ""
        cells = [str(i), f"{run.losses[i]:.6f}", *norms, f"{run.update_norms[i]:.4g}"]
        cells += [f"{run.ranks_scaled[i]}/{ranks}", above]
        say("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)).rstrip())


def why_lower(run: Run, ref: Run, config: Config) -> list[str]:
    """When a buggy run ends at a lower loss than the correct one, say why in words."""
    if not run.final_loss < ref.final_loss:
        return []
    above = run.steps_above(config.max_norm)
    lead = (
        f"why the {run.mode} run ends lower ({run.final_loss:.4g} against {ref.final_loss:.4g}), "
        "though it has the bug:"
    )
    if above:
        return [
            lead,
            f"  its update was above max_norm {config.max_norm:g} on {above} of {config.steps} steps (up to "
            f"{max(run.update_norms):.4g}).",
            "  It took larger steps than the limit allows, so it is a different experiment (as if",
            "  max_norm were larger), not a better clip. To compare like with like, raise --max-norm",
            "  for the correct run.",
        ]
    return [
        lead,
        f"  its updates stayed within max_norm but went in another direction (smallest cosine "
        f"{_smallest(run.cosines)}):",
        "  a different experiment, not a better clip.",
    ]


def _smallest(cosines: Sequence[float | None]) -> str:
    """The smallest defined cosine; "undefined" when no step had one (a zero or non-finite update)."""
    defined = [c for c in cosines if c is not None]
    return f"{min(defined):.4f}" if defined else "undefined"
