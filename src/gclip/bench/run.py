"""One bench run on the ranks of a job: every case timed, memory, collectives, targets."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from .._lab.cli import rank_size
from .collectives import collective_counts
from .lists import bench_list
from .machine import describe_machine
from .memory import check_memory, first_call_memory, measure_memory
from .ops import bench_case, torch_setup, torch_teardown
from .options import PROG, THREAD_VARS, threads
from .step import bench_step
from .table import fmt_n, fmt_t
from .targets import targets
from .timing import time_allreduce
from .torch_lists import bench_torch_list
from .torch_overhead import bench_overhead
from .workloads import BUSY_LOAD, DELTA, LISTS, auto_repeat, shard

__all__ = ["REPORTED_VARS", "SCHEMA", "case_rows", "effective_bytes", "run_bench"]

SCHEMA = "gclip.bench/1"
REPORTED_VARS = (*THREAD_VARS, "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_VERBOSE")


def effective_bytes(n: int, itemsize: int, active: bool) -> int:
    """Bytes a clip must move: one read for the norm; when active, a read and a write more."""
    return n * itemsize * (3 if active else 1)


def case_rows(n: int, dtype: str, itemsize: int, active: bool, got: dict[str, Any]) -> list[dict]:
    """One row per implementation, with GB/s and its ratios."""
    times = got["times"]
    floor = times["floor"]["median_s"]
    default = times["gclip"]["median_s"]
    nbytes = effective_bytes(n, itemsize, active)
    rows = []
    for impl, t in times.items():
        row = {
            "n": n,
            "dtype": dtype,
            "active": active,
            "impl": impl,
            "median_s": t["median_s"],
            "min_s": t["min_s"],
            "reps": t["reps"],
            "gb_per_s": nbytes / t["median_s"] / 1e9,
            "vs_floor": t["median_s"] / floor,
        }
        if "cpu_median_s" in t and times["floor"].get("cpu_median_s"):  # the busiest rank's CPU time
            row["cpu_vs_floor"] = t["cpu_median_s"] / times["floor"]["cpu_median_s"]
        if impl == "gclip-repro":
            row["vs_default"] = t["median_s"] / default
            if "cpu_median_s" in t and "cpu_median_s" in times["gclip"]:  # the busiest rank's CPU time
                row["cpu_vs_default"] = t["cpu_median_s"] / times["gclip"]["cpu_median_s"]
        if impl == "gclip":
            row["vs_bare"] = t["median_s"] / times["bare"]["median_s"]
        if impl.startswith("torch"):
            row["gclip_vs_this"] = default / t["median_s"]
        if impl.startswith("gclip"):
            row["misses"] = got["misses"] if active else 0
        rows.append(row)
    return rows


def _progress(message: str) -> None:
    if rank_size()[0] == 0:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def run_bench(comm: Any, args: Any) -> dict[str, Any] | None:
    """All measurements; rank 0 returns the results, the others None."""
    import numpy as np

    rank = comm.Get_rank()
    check_memory(comm, args)
    torch_ctx, torch_note = (None, "torch comparison off (--no-torch)")
    if not args.no_torch:
        torch_ctx, torch_note = torch_setup(comm, threads())
    _progress(torch_note)
    load_start = _load()
    if load_start > BUSY_LOAD:
        _progress(
            f"warning: load average {load_start:.1f} at the start: other processes compete, timings are noisy"
        )
    start = time.perf_counter()
    ar = time_allreduce(comm)
    collectives = collective_counts(comm)
    rows: list[dict] = []
    memory: list[dict] = []
    lists: list[dict] = []
    torch_lists: list[dict] = []
    overhead: list[dict] = []
    steps: list[dict] = []
    try:
        for dtype in args.dtypes:
            for n in args.sizes:
                x = shard(n, dtype, rank)
                repeat = args.repeat or auto_repeat(n)
                for active in (False, True):
                    t0 = time.perf_counter()
                    got = bench_case(comm, x, active, repeat, torch_ctx, args.cold)
                    if got is not None:
                        rows += case_rows(n, dtype, x.itemsize, active, got)
                        _progress(_case_line(rows, n, dtype, active, repeat, time.perf_counter() - t0))
                memory += measure_memory(comm, x)
                del x
        for workload in LISTS:
            if workload.name in args.lists:
                t0 = time.perf_counter()
                lists += bench_list(comm, workload, torch_ctx, args.repeat)
                _progress(f"list {workload.name}: {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        torch_lists = bench_torch_list(comm, torch_ctx, args.lists, args.repeat)
        if torch_lists:
            _progress(f"gclip.torch lists: {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        overhead = bench_overhead(comm, torch_ctx, args.lists, args.repeat)
        if overhead:
            _progress(f"gclip.torch overhead, one process: {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        steps = bench_step(comm, torch_ctx, args.lists, args.repeat)
        if steps:
            _progress(f"optimizer steps: {time.perf_counter() - t0:.1f} s")
    finally:
        torch_teardown(torch_ctx)
    if rank != 0:
        return None
    return {
        "schema": SCHEMA,
        "ranks": comm.Get_size(),
        "threads": threads(),
        "timing": "per rep: slowest rank after a Barrier; per case: median over reps",
        "caches": "cold: L1/L2 evicted before each call" if args.cold else "warm: after an untimed call",
        "delta": DELTA,
        "environment": _environment(np),
        "machine": describe_machine(),
        "torch": torch_ctx.torch.__version__ if torch_ctx is not None else None,
        "torch_note": torch_note,
        "allreduce_s": ar,
        "collectives": collectives,
        "rows": rows,
        "memory": memory,
        "lists": lists,
        "torch_lists": torch_lists,
        "torch_overhead": overhead,
        "steps": steps,
        "first_call": None if args.quick else first_call_memory(),
        "targets": targets(rows, memory, collectives, ar, lists, steps),
        "seconds": time.perf_counter() - start,
        "load_average": {"start": load_start, "end": _load()},
    }


def _load() -> float:
    """The 1-minute load average (NaN where the OS has none): a busy machine makes noisy timings."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _case_line(rows: list[dict], n: int, dtype: str, active: bool, repeat: int, secs: float) -> str:
    mine = {r["impl"]: r for r in rows if r["n"] == n and r["dtype"] == dtype and r["active"] == active}
    g = mine["gclip"]
    return (
        f"{dtype} n={fmt_n(n)} clip {'active' if active else 'inactive'}: {repeat} reps in {secs:.1f} s,"
        f" gclip {fmt_t(g['median_s'])} = {g['vs_floor']:.2f}x floor"
    )


def _environment(np: Any) -> dict[str, Any]:
    import platform

    from mpi4py import MPI

    import gclip

    return {
        "gclip": gclip.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "cpus": os.cpu_count(),
        "env": {k: os.environ[k] for k in REPORTED_VARS if k in os.environ},
    }
