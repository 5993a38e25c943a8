"""The bench's numbers as text: one table line per case, then memory, collectives and targets."""

from __future__ import annotations

import math
from typing import Any

from .machine import machine_line

__all__ = [
    "columns",
    "find_row",
    "fmt_bytes",
    "fmt_n",
    "fmt_t",
    "format_lists",
    "format_steps",
    "format_table",
    "format_torch_lists",
    "format_torch_overhead",
]


def find_row(rows: list[dict], n: int, dtype: str, active: bool, impl: str) -> dict | None:
    for r in rows:
        if (r["n"], r["dtype"], r["active"], r["impl"]) == (n, dtype, active, impl):
            return r
    return None


def fmt_n(n: int) -> str:
    e = math.log10(n) if n > 0 else 0
    return f"1e{round(e)}" if e == round(e) else f"{n:.3g}"


def fmt_t(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def columns(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = []
    for j, line in enumerate(lines):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        text.append("  ".join(cells).rstrip())
        if j == 0:
            text.append("-" * len(text[0]))
    return "\n".join(text)


def _cpu(result: dict[str, Any]) -> str:
    """The CPU, for the headings of the tables below the first (whose line names the whole machine)."""
    machine = result.get("machine")
    return f"on {machine['cpu']['model']}, as above" if machine else "machine not recorded"


def format_table(result: dict[str, Any]) -> str:
    """The human table: one line per (dtype, size, clip state)."""
    rows = result["rows"]
    has_torch = any(r["impl"] == "torch" for r in rows)
    head = ["dtype", "n/rank", "clip", "floor", "GB/s", "gclip", "GB/s", "x floor", "(cpu)", "x bare"]
    head += ["repro", "x dflt"]
    if has_torch:
        head += ["torch", "gclip/torch", "torch-f64acc"]
    lines = [head]
    keys = sorted(
        {(r["dtype"], r["n"], r["active"]) for r in rows}, key=lambda k: (k[0] != "float64", k[1], k[2])
    )
    for dtype, n, active in keys:
        f = find_row(rows, n, dtype, active, "floor")
        g = find_row(rows, n, dtype, active, "gclip")
        p = find_row(rows, n, dtype, active, "gclip-repro")
        line = [dtype, fmt_n(n), "active" if active else "off"]
        line += [fmt_t(f["median_s"]), f"{f['gb_per_s']:.2f}", fmt_t(g["median_s"]), f"{g['gb_per_s']:.2f}"]
        cpu = f"{g['cpu_vs_floor']:.2f}" if "cpu_vs_floor" in g else "-"
        line += [f"{g['vs_floor']:.2f}", cpu, f"{g['vs_bare']:.2f}"]
        line += [fmt_t(p["median_s"]), f"{p['vs_default']:.2f}"]
        if has_torch:
            t = find_row(rows, n, dtype, active, "torch")
            t64 = find_row(rows, n, dtype, active, "torch-f64acc")
            line += [
                fmt_t(t["median_s"]),
                f"{t['gclip_vs_this']:.2f}",
                fmt_t(t64["median_s"]) if t64 else "-",
            ]
        lines.append(line)
    out = [machine_line(result.get("machine")), columns(lines)]
    out.append("")
    out.append(
        f"{result['ranks']} ranks, {result['threads']} thread(s) per rank; {result['timing']};"
        f" caches {result['caches']}.\n"
        "GB/s: per rank, n*itemsize bytes when off (one read), 3x when active (read, read, write).\n"
        "(cpu): the same ratio in the busiest rank's thread CPU time, which another process holding the core"
        " does not lengthen."
    )
    out.append(f"bare header-sized Allreduce: {fmt_t(result['allreduce_s'])}; {result['torch_note']}")
    load = result["load_average"]
    out.append(f"load average: {load['start']:.2f} at the start, {load['end']:.2f} at the end")
    env = result["environment"]["env"]
    out.append("environment: " + (" ".join(f"{k}={v}" for k, v in env.items()) or "no thread variables set"))
    c = result["collectives"]
    out.append(
        "collectives per clip: "
        + ", ".join(f"{k} {v['total']} ({v['pickle_based']} pickle-based)" for k, v in c.items())
    )
    out.append("memory, peak extra / shard (tracemalloc; peak RSS growth):")
    for m in result["memory"]:
        rss = "-" if m["rss_extra_bytes"] is None else fmt_bytes(m["rss_extra_bytes"])
        out.append(
            f"  {m['dtype']:8s} {fmt_n(m['n']):>5s} {m['mode']:12s} {fmt_bytes(m['peak_extra_bytes']):>9s}"
            f" / {fmt_bytes(m['shard_bytes']):>9s} = {m['ratio'] * 100:.3g}%   rss +{rss}"
        )
    if result.get("lists"):
        out.append(f"lists of arrays, per rank (time per clip, slowest rank, median; {_cpu(result)}):")
        out.append(format_lists(result["lists"]))
    if result.get("torch_lists"):
        out.append(
            f"gclip.torch on torch parameters, per rank (gloo group; slowest rank, median; {_cpu(result)}):"
        )
        out.append(format_torch_lists(result["torch_lists"]))
    if result.get("torch_overhead"):
        out.append(
            "gclip.torch against torch's clip_grad_norm_(foreach=True), one process "
            f"(interleaved; median; {_cpu(result)}):"
        )
        out.append(format_torch_overhead(result["torch_overhead"]))
    first = result.get("first_call")
    if first:
        out.append(
            "one-time peak RSS growth of a fresh process's first clip of 1e7 float32: "
            f"{fmt_bytes(first['default'])}"
            f" (numba and the kernels loaded: {first['numba_loaded']}); reproducible's first call adds"
            f" {fmt_bytes(first['reproducible'])}"
        )
    if result.get("steps"):
        out.append(
            "what clipping adds to a fused AdamW step, per rank"
            f" (gloo group; slowest rank, median; {_cpu(result)}):"
        )
        out.append(format_steps(result["steps"]))
    misses = sum(r.get("misses", 0) for r in [*rows, *result.get("lists", [])])
    if misses:
        out.append(f"warning: {misses} active rep(s) did not clip (see 'misses' in the JSON)")
    out.append("targets:")
    for t in result["targets"]:
        mark = "ok  " if t["ok"] else "MISS"
        note = f"  ({t['note']})" if t["note"] else ""
        out.append(f"  {mark} {t['name']}: {t['value']:.3g} (limit {t['limit']:g}){note}")
    return "\n".join(out)


def format_lists(rows: list[dict]) -> str:
    """The list workloads' table (empty when none ran)."""
    if not rows:
        return ""
    head = ["workload", "tensors", "clip", "floor", "gclip", "per tensor", "gclip/floor", "repro", "x dflt"]
    head += ["torch-foreach", "gclip/torch", "repro/torch", "floor/torch"]
    lines = [head]
    keys = sorted({(r["workload"], r["active"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for name, active in keys:
        got = {r["impl"]: r for r in rows if (r["workload"], r["active"]) == (name, active)}
        g, p, t, f = got["gclip"], got["gclip-repro"], got.get("torch-foreach"), got.get("floor")
        line = [name, str(g["tensors"]), "active" if active else "off", fmt_t(f["median_s"]) if f else "-"]
        line += [fmt_t(g["median_s"]), fmt_t(g["per_tensor_s"]), f"{g['vs_floor']:.2f}" if f else "-"]
        line += [fmt_t(p["median_s"]), f"{p['vs_default']:.2f}"]
        if t:
            line += [fmt_t(t["median_s"]), f"{g['vs_torch']:.2f}", f"{p['vs_torch']:.2f}"]
            line += [f"{f['vs_torch']:.2f}" if f else "-"]
        else:
            line += ["-"] * 4
        lines.append(line)
    return columns(lines)


def format_torch_lists(rows: list[dict]) -> str:
    """gclip.torch against torch's own clip plus one all-reduce (empty when none ran)."""
    if not rows:
        return ""
    lines = [["workload", "dtype", "tensors", "clip", "gclip.torch", "torch+allreduce", "gclip/torch"]]
    lines[0] += ["repro", "x dflt"]
    keys = sorted({(r["workload"], r["active"]) for r in rows})
    for name, active in keys:
        got = {r["impl"]: r for r in rows if (r["workload"], r["active"]) == (name, active)}
        g, t, p = got["gclip.torch"], got["torch+allreduce"], got.get("gclip.torch-repro")
        line = [name, g["dtype"], str(g["tensors"]), "active" if active else "off"]
        line += [fmt_t(g["median_s"]), fmt_t(t["median_s"]), f"{g['vs_torch']:.2f}"]
        line += [fmt_t(p["median_s"]), f"{p['vs_default']:.2f}"] if p else ["-", "-"]
        lines.append(line)
    return columns(lines)


def format_torch_overhead(rows: list[dict]) -> str:
    """gclip.torch against torch's own clip in one process: times, ratios, the target (empty when
    none ran)."""
    if not rows:
        return ""
    lines = [["workload", "tensors", "clip", "gclip.torch", "torch", "gclip/torch", "cpu ratio", "target"]]
    keys = sorted({(r["workload"], r["active"]) for r in rows})
    for name, active in keys:
        got = {r["impl"]: r for r in rows if (r["workload"], r["active"]) == (name, active)}
        g, t = got["gclip.torch"], got["torch"]
        line = [name, str(g["tensors"]), "active" if active else "off"]
        line += [fmt_t(g["median_s"]), fmt_t(t["median_s"]), f"{g['vs_torch']:.2f}"]
        line += [f"{g['cpu_vs_torch']:.2f}" if "cpu_vs_torch" in g else "-"]
        line += [f"{'ok' if g['ok'] else 'MISS'} <= {g['limit']:g}"]
        lines.append(line)
    return columns(lines)


def format_steps(rows: list[dict]) -> str:
    """The optimizer-step rows: each time, what it adds to its floor, gclip's added time over torch's."""
    lines = [["workload", "ranks", "impl", "time", "adds", "adds/torch", "cpu", "cpu adds", "cpu adds/torch"]]
    for r in rows:
        line = [r["workload"], str(r["ranks"]), r["impl"], fmt_t(r["median_s"])]
        line += [f"{r['adds_s'] * 1e3:.3g} ms" if "adds_s" in r else "-"]
        line += [f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-"]
        if "cpu_median_s" in r:
            line += [fmt_t(r["cpu_median_s"])]
            line += [f"{r['cpu_adds_s'] * 1e3:.3g} ms" if "cpu_adds_s" in r else "-"]
            line += [f"{r['cpu_vs_torch']:.2f}" if "cpu_vs_torch" in r else "-"]
        lines.append(line)
    return columns(lines)
