"""``--ranks-sweep``: the bench under ``mpirun -n R`` for each R, tabulated against ranks and size."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._lab import mpirun
from .._lab.cli import UsageError
from .machine import machine_line
from .options import PINNED, PROG, threads
from .run import SCHEMA
from .table import columns, find_row, fmt_n, fmt_t

__all__ = ["format_sweep", "run_sweep", "sweep_command", "sweep_rows"]


def sweep_command(args: Any, out: str) -> list[str]:
    """What each rank of one sweep run runs (no torch: the sweep is about ranks)."""
    sizes = ",".join(str(n) for n in args.sizes)
    cmd = [sys.executable, "-m", PROG]
    cmd += ["--sizes", sizes, "--dtypes", ",".join(args.dtypes), "--no-torch", "--lists", "none"]
    cmd += ["--json", out]
    if args.repeat:
        cmd += ["--repeat", str(args.repeat)]
    cmd += ["--threads", str(args.threads or threads())]
    return cmd


def run_sweep(args: Any) -> dict[str, Any]:
    """The bench under ``mpirun -n R`` for each R of ``--ranks``, each run under ``--timeout``."""
    import tempfile

    try:
        mpirun.find_mpirun()
    except mpirun.MpirunNotFound:
        raise UsageError("--ranks-sweep needs mpirun on PATH") from None
    runs = []
    with tempfile.TemporaryDirectory(prefix="gclip-bench-") as tmp:
        for ranks in args.ranks:
            out = os.path.join(tmp, f"r{ranks}.json")
            print(f"{PROG}: sweep: {ranks} rank(s) ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            # without this job's pinning mark: each run pins its own threads (--threads)
            env = {PINNED: None}
            proc = mpirun.run(ranks, *sweep_command(args, out), timeout=args.timeout, env=env)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                why = "timed out" if proc.returncode == mpirun.TIMED_OUT else f"exited {proc.returncode}"
                raise UsageError(f"--ranks-sweep: mpirun -n {ranks} {why}: {tail}")
            with open(out) as f:
                runs.append(json.load(f))
            print(f"{PROG}: sweep: {ranks} rank(s) done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cpus = os.cpu_count() or 1
    machine = runs[0].get("machine") if runs else None  # every run's: the same host
    return {
        "schema": SCHEMA + "/sweep",
        "cpus": cpus,
        "machine": machine,
        "runs": runs,
        "sweep": sweep_rows(runs),
    }


def sweep_rows(runs: Sequence[dict]) -> list[dict]:
    """One row per (dtype, n, clip state, ranks): gclip and floor medians."""
    rows = []
    for run in runs:
        for r in run["rows"]:
            if r["impl"] == "gclip":
                f = find_row(run["rows"], r["n"], r["dtype"], r["active"], "floor")
                rows.append(
                    {
                        "ranks": run["ranks"],
                        "n": r["n"],
                        "dtype": r["dtype"],
                        "active": r["active"],
                        "gclip_s": r["median_s"],
                        "floor_s": f["median_s"],
                        "vs_floor": r["vs_floor"],
                        "allreduce_s": run["allreduce_s"],
                    }
                )
    return rows


def format_sweep(result: dict[str, Any]) -> str:
    """The sweep's table: gclip and floor per rank count, and the bare Allreduce per rank count."""
    rows = result["sweep"]
    ranks = sorted({r["ranks"] for r in rows})
    head = ["dtype", "n/rank", "clip"]
    for k in ranks:
        mark = "*" if k > result["cpus"] else ""  # oversubscribed
        head += [f"gclip R={k}{mark}", f"floor R={k}{mark}", "x floor"]
    lines = [head]
    keys = sorted(
        {(r["dtype"], r["n"], r["active"]) for r in rows}, key=lambda k: (k[0] != "float64", k[1], k[2])
    )
    for dtype, n, active in keys:
        line = [dtype, fmt_n(n), "active" if active else "off"]
        for k in ranks:
            got = [r for r in rows if (r["dtype"], r["n"], r["active"], r["ranks"]) == (dtype, n, active, k)]
            if got:
                line += [fmt_t(got[0]["gclip_s"]), fmt_t(got[0]["floor_s"]), f"{got[0]['vs_floor']:.2f}"]
            else:
                line += ["-", "-", "-"]
        lines.append(line)
    ar = {r["ranks"]: r["allreduce_s"] for r in rows}
    note = ", ".join(f"R={k}: {fmt_t(ar[k])}" for k in ranks)
    over = [k for k in ranks if k > result["cpus"]]
    text = [machine_line(result.get("machine")), columns(lines), "", f"bare header-sized Allreduce: {note}"]
    if over:
        text.append(
            f"*: R={','.join(map(str, over))} oversubscribes the {result['cpus']} cores: ranks take turns on"
            " a core, so a collective waits for a descheduled rank: the scheduler's time, not gclip's."
        )
    return "\n".join(text)
