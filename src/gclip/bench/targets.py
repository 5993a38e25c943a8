"""The performance targets, as data: one row per target, with its limit and how it is read.

A target reads one value from the run's measurements (``read``; None when
this run did not measure it, e.g. no 1e7 shard or no torch), and is met when
that value is ``rule`` (at most, at least, exactly) its ``limit`` and the
reading's side condition holds (``sound``: e.g. the one collective is not a
pickle-based one).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

from .table import find_row, fmt_n

__all__ = [
    "AT_LEAST",
    "AT_MOST",
    "EXACTLY",
    "TARGETS",
    "Measured",
    "Reading",
    "Target",
    "allreduce_share",
    "default_collectives",
    "evaluate",
    "gclip_vs_floor",
    "layout_collectives",
    "list_vs_torch",
    "repro_vs_default",
    "targets",
    "worst_memory",
    "worst_vs_torch",
]

AT_MOST, AT_LEAST, EXACTLY = "at most", "at least", "exactly"
_RULES: dict[str, Callable[[float, float], bool]] = {
    AT_MOST: operator.le,
    AT_LEAST: operator.ge,
    EXACTLY: operator.eq,
}


class Measured(NamedTuple):
    """What a run measured (the pieces of its result dict that targets read)."""

    rows: list[dict]
    memory: list[dict]
    collectives: dict[str, Any]
    allreduce_s: float
    lists: list[dict] | tuple = ()  # the list workloads' rows
    steps: list[dict] | tuple = ()  # the optimizer-step rows


class Reading(NamedTuple):
    value: float
    note: str = ""
    sound: bool = True  # a side condition the value cannot show


class Target(NamedTuple):
    name: str
    limit: float
    rule: str  # AT_MOST, AT_LEAST or EXACTLY
    read: Callable[[Measured], Reading | None]  # None: not measured in this run


# ---------------------------------------------------------------------------
# how each value is read


def gclip_vs_floor(n: int, dtype: str, active: bool) -> Callable[[Measured], Reading | None]:
    """gclip's time over the floor's, at shard size n."""

    def read(m: Measured) -> Reading | None:
        row = find_row(m.rows, n, dtype, active, "gclip")
        if row is None:
            return None
        if "cpu_vs_floor" in row:  # the verdict stays wall time; CPU time beside it, for a busy machine
            return Reading(row["vs_floor"], f"in CPU time {row['cpu_vs_floor']:.2f}")
        return Reading(row["vs_floor"])

    return read


def repro_vs_default(n: int, dtype: str, active: bool) -> Callable[[Measured], Reading | None]:
    """reproducible=True's time over the default mode's, at shard size n: in CPU time where the
    run has it (a busy machine disturbs it less; the busiest rank per rep), else in wall time."""

    def read(m: Measured) -> Reading | None:
        row = find_row(m.rows, n, dtype, active, "gclip-repro")
        if row is None:
            return None
        if "cpu_vs_default" in row:
            return Reading(row["cpu_vs_default"], f"CPU time; in wall time {row['vs_default']:.2f}")
        return Reading(row["vs_default"])

    return read


def step_vs_torch(workload: str, impl: str) -> Callable[[Measured], Reading | None]:
    """What gclip's folded clip adds to a fused AdamW step over what torch's clip adds, in CPU time
    where the run has it (a busy machine disturbs it less), else in wall time. Below 0 is possible
    with a GradScaler: the folded clip also takes over the scaler's own inf check. Sound only when
    torch's clip measurably adds to its step."""

    def read(m: Measured) -> Reading | None:
        got = [r for r in m.steps if r["workload"] == workload and r["impl"] == impl and "vs_torch" in r]
        if not got:
            return None
        r = got[0]
        cpu = "cpu_vs_torch" in r
        value, adds = (r["cpu_vs_torch"], r["cpu_adds_s"]) if cpu else (r["vs_torch"], r["adds_s"])
        sound = value == value  # NaN: torch's clip added nothing measurable
        note = f"{r['ranks']} rank(s), {'CPU' if cpu else 'wall'} time; adds {adds * 1e3:.3g} ms"
        note += f"; in wall time {r['vs_torch']:.2f}" if cpu else ""
        fold = r.get("cpu_torch_fold_s" if cpu else "torch_fold_s")
        if fold is not None:  # torch's fused step handed grad_scale, no norm: not gclip's to cut
            note += f"; of it torch's grad_scale pass {fold * 1e3:.3g} ms"
        return Reading(value, note if sound else note + "; torch's clip added nothing measurable", sound)

    return read


def list_vs_torch(name: str, active: bool) -> Callable[[Measured], Reading | None]:
    """gclip's time over torch's foreach clip on list workload ``name``."""

    def read(m: Measured) -> Reading | None:
        got = {r["impl"]: r for r in m.lists if r["workload"] == name and r["active"] == active}
        if "gclip" not in got or "vs_torch" not in got["gclip"]:
            return None
        g, p, f = got["gclip"], got.get("gclip-repro"), got.get("floor")
        note = f"{g['per_tensor_s'] * 1e6:.3g} us per tensor"
        if f is not None:
            note += f"; the floor (bare memory passes): {f['vs_torch']:.2f}x torch"
        if p is not None:
            note += f"; reproducible: {p['vs_torch']:.2f}x torch, {p['vs_default']:.2f}x default"
        return Reading(g["vs_torch"], note)

    return read


def worst_vs_torch(m: Measured) -> Reading | None:
    """gclip's time over torch's, in the case where it is largest."""
    torch_rows = [r for r in m.rows if r["impl"] == "torch"]
    if not torch_rows:
        return None
    worst = max(torch_rows, key=lambda r: r["gclip_vs_this"])
    state = "active" if worst["active"] else "inactive"
    return Reading(worst["gclip_vs_this"], f"worst: {worst['dtype']} {fmt_n(worst['n'])} {state}")


def allreduce_share(n: int) -> Callable[[Measured], Reading | None]:
    """The bare header-sized Allreduce's time over an inactive float64 clip's, at shard size n."""

    def read(m: Measured) -> Reading | None:
        step = find_row(m.rows, n, "float64", False, "gclip")
        bare = find_row(m.rows, n, "float64", False, "bare")
        if step is None or bare is None:
            return None
        bare_share = m.allreduce_s / bare["median_s"]
        note = f"at least the limit; the bare step, dot + Allreduce, unchecked: {bare_share:.2f}"
        return Reading(m.allreduce_s / step["median_s"], note)

    return read


def worst_memory(mode: str, smallest: int) -> Callable[[Measured], Reading | None]:
    """The largest peak extra memory / shard of a ``mode`` clip, over shards of ``smallest`` or more."""

    def read(m: Measured) -> Reading | None:
        big = [r for r in m.memory if r["mode"] == mode and r["n"] >= smallest]
        if not big:
            return None
        worst = max(big, key=lambda r: r["ratio"])
        return Reading(worst["ratio"], f"worst: {worst['dtype']} {fmt_n(worst['n'])}")

    return read


def layout_collectives(m: Measured) -> Reading | None:
    """Collectives of a clip with a replicated array (flag or communicator): the worst."""
    cases = [v for k, v in m.collectives.items() if k.startswith("layout")]
    if not cases:
        return None
    worst = max(cases, key=lambda c: c["total"])
    return Reading(worst["total"], sound=all(c["pickle_based"] == 0 for c in cases))


def default_collectives(m: Measured) -> Reading:
    """Collectives of one active default clip; sound only when none of them pickles."""
    d = m.collectives["default_active"]
    return Reading(d["total"], sound=d["pickle_based"] == 0)


# ---------------------------------------------------------------------------
# the table: the floor and reproducible ratios at 1e7 (the shard streams from memory), the
# list workloads against torch's foreach clip, the one Allreduce at 1e4 (a small step),
# memory from 1e6 (small shards have fixed costs), the count-once rule adding no collective

TARGETS: tuple[Target, ...] = (
    Target("float64 1e7 inactive: gclip / floor", 1.10, AT_MOST, gclip_vs_floor(10**7, "float64", False)),
    Target("float64 1e7 active: gclip / floor", 1.10, AT_MOST, gclip_vs_floor(10**7, "float64", True)),
    Target("float32 1e7 inactive: gclip / floor", 1.25, AT_MOST, gclip_vs_floor(10**7, "float32", False)),
    Target("float32 1e7 active: gclip / floor", 1.25, AT_MOST, gclip_vs_floor(10**7, "float32", True)),
    Target("gclip / torch, every case", 1.0, AT_MOST, worst_vs_torch),
    *(
        Target(
            f"{dtype} 1e7 {'active' if active else 'inactive'}: reproducible / default",
            1.3 if dtype == "float64" else 1.5,
            AT_MOST,
            repro_vs_default(10**7, dtype, active),
        )
        for dtype in ("float64", "float32")
        for active in (False, True)
    ),
    *(
        Target(f"{name} {'active' if active else 'inactive'}: gclip / torch foreach", limit, AT_MOST, read)
        for name, limit in (("gpt2-small", 0.6), ("tiny", 0.3))
        for active in (False, True)
        for read in (list_vs_torch(name, active),)
    ),
    *(
        Target(
            f"{workload}: what {impl} adds / what torch's adds", limit, AT_MOST, step_vs_torch(workload, impl)
        )
        for workload in ("gpt2-small-step", "gpt2-small-step-bf16")
        for impl, limit in (("gclip-folded+step", 0.4), ("gclip-folded-amp+step", 0.3))
    ),
    Target("1e4 float64 step: share of one Allreduce", 0.5, AT_LEAST, allreduce_share(10**4)),
    Target("peak extra memory / shard, default, n >= 1e6", 0.05, AT_MOST, worst_memory("default", 10**6)),
    Target(
        "peak extra memory / shard, reproducible, n >= 1e6",
        0.05,
        AT_MOST,
        worst_memory("reproducible", 10**6),
    ),
    Target("collectives per clip with a replicated array", 1, EXACTLY, layout_collectives),
    Target("collectives per default clip", 1, EXACTLY, default_collectives),
)


def evaluate(measured: Measured, table: tuple[Target, ...] = TARGETS) -> list[dict]:
    """Each target this run measured, with its value, limit and verdict (``ok``), in table order."""
    out = []
    for target in table:
        reading = target.read(measured)
        if reading is None:
            continue
        ok = bool(reading.sound and _RULES[target.rule](reading.value, target.limit))
        row = {"name": target.name, "value": reading.value, "limit": target.limit, "ok": ok}
        out.append({**row, "note": reading.note})
    return out


def targets(
    rows: list[dict],
    memory: list[dict],
    collectives: dict,
    allreduce_s: float,
    lists: list[dict] | tuple = (),
    steps: list[dict] | tuple = (),
) -> list[dict]:
    """The performance targets of one run, each with its measured value and a verdict."""
    return evaluate(Measured(rows, memory, collectives, allreduce_s, lists, steps))
