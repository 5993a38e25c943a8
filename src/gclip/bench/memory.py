"""Memory: the peak extra memory of an in-place clip, and what a run needs before it starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._lab.cli import UsageError
from .table import fmt_bytes, fmt_n
from .workloads import DELTA, MEMORY_HEADROOM

__all__ = ["check_memory", "measure_memory", "mem_available", "needed_bytes", "peak_extra_bytes"]


def _vm_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Linux resets VmHWM (peak RSS) on '5' to clear_refs; elsewhere no RSS figure."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _vm_kib("VmHWM") is not None
    except OSError:
        return False


def peak_extra_bytes(run: Callable[[], Any]) -> tuple[int, int | None]:
    """(tracemalloc peak growth, peak-RSS growth or None) while ``run()`` runs."""
    import tracemalloc

    rss = _reset_peak_rss()
    rss_before = _vm_kib("VmRSS") if rss else None
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    hwm = _vm_kib("VmHWM") if rss else None
    rss_extra = None if hwm is None or rss_before is None else max(0, hwm - rss_before) * 1024
    return peak - before, rss_extra


def measure_memory(comm: Any, x: Any) -> list[dict[str, Any]]:
    """Peak extra memory of one in-place active clip, default and reproducible (max over ranks)."""
    import gclip

    rows = []
    for reproducible in (False, True):
        norm = gclip.global_norm(x, comm=comm)

        def run(r: bool = reproducible, limit: float = norm * (1.0 - DELTA)) -> None:
            gclip.clip_by_global_norm(x, limit, comm=comm, inplace=True, reproducible=r)

        traced, rss = peak_extra_bytes(run)
        traced = comm.allreduce(traced, op=_max_op())
        rss_all = comm.allgather(rss)
        rss = None if any(v is None for v in rss_all) else max(rss_all)
        rows.append(
            {
                "n": int(x.size),
                "dtype": x.dtype.name,
                "mode": "reproducible" if reproducible else "default",
                "shard_bytes": int(x.nbytes),
                "peak_extra_bytes": int(traced),
                "ratio": traced / x.nbytes,
                "rss_extra_bytes": rss,
            }
        )
    return rows


def _max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def needed_bytes(sizes: Sequence[int], dtypes: Sequence[str], ranks: int, torch: bool) -> int:
    """Memory the largest case holds on this machine: every rank's shard, plus
    torch's float64 copy of a float32 shard (torch-f64acc)."""
    itemsize = {"float32": 4, "float64": 8}
    per_rank = max(
        n * itemsize[d] + (n * 8 if torch and d == "float32" else 0) for n in sizes for d in dtypes
    )
    return per_rank * ranks


def check_memory(comm: Any, args: Any) -> None:
    """Refuse sizes that would not fit (1e8 float64 is 0.8 GB per rank); rank 0 decides for all."""
    verdict = None
    if comm.Get_rank() == 0:
        need = needed_bytes(args.sizes, args.dtypes, comm.Get_size(), not args.no_torch)
        free = mem_available()
        if free is not None and need > MEMORY_HEADROOM * free:
            verdict = (
                f"--sizes {fmt_n(max(args.sizes))} needs about {fmt_bytes(need)} on {comm.Get_size()}"
                f" ranks, more than {MEMORY_HEADROOM:.0%} of the {fmt_bytes(free)} available"
            )
    verdict = comm.bcast(verdict, root=0)
    if verdict:
        raise UsageError(verdict)


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_FIRST_CALL = """
import json, sys
import numpy as np
def hwm():
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # the peak so far: reset to the current RSS
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
def peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
import gclip
x = np.random.default_rng(0).normal(size=10**7).astype(np.float32)
out = {}
for name, kw in (('default', {}), ('reproducible', {'reproducible': True})):
    before = hwm()
    gclip.clip_simulated([[x]], 1.0, **kw)
    first = peak() - before
    before = hwm()
    gclip.clip_simulated([[x]], 1.0, **kw)
    out[name] = first - (peak() - before)  # the copy clip_simulated returns is in both
out['numba_loaded'] = 'numba' in sys.modules
print(json.dumps(out))
"""


def first_call_memory() -> dict[str, Any] | None:
    """The one-time growth of the peak RSS in a fresh process's first clip of a 1e7 float32 shard
    (simulated, no MPI): numba's import and the cached kernels loaded, the first call's peak less
    the second's; default, then reproducible (what its first call adds on top)."""
    import json
    import os
    import subprocess
    import sys

    if not _reset_peak_rss():
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPI", "HYDRA"))}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, timeout=600
        )
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
