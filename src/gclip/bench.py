"""Benchmark: the clip step against its floor, and against torch.distributed.

usage:: mpiexec -n 2 python -m gclip.bench [--sizes 1e3,1e4,1e5,1e6,1e7] [--dtypes float64,float32]
        [--repeat K] [--threads N] [--json [FILE]] [--plot FILE.png] [--no-torch] [--cold] [--quick]
usage:: python -m gclip.bench --ranks-sweep [--ranks 1,2,4] [--sizes ...] [--json FILE] [--plot FILE.png]

What is timed, per shard size (elements per rank) and dtype, with clipping
inactive (max_norm above the norm: nothing to write) and active:

- ``floor``: what no clip can beat on one rank, with no communication: a BLAS
  dot in the shard's dtype (``np.dot(x, x)``) plus, when active, one in-place
  scale (``np.multiply(x, s, out=x)``).
- ``bare``: the floor plus the one all-reduce (of a header-sized buffer),
  nothing checked: the least a distributed clip can cost.
- ``gclip``: ``gclip.clip_by_global_norm(x, max_norm, inplace=True)``.
- ``gclip-repro``: the same with ``reproducible=True``.
- ``torch``: with the ``[bench]`` extra, the FSDP-style clip over a gloo
  process group on the same memory (``torch.from_numpy``): vector_norm in the
  shard's dtype, squared, ``all_reduce``, sqrt, ``max_norm / (norm + 1e-6)``
  clamped to 1, ``mul_`` (torch always multiplies, even by 1). For float32
  shards, ``torch-f64acc`` also accumulates the norm in float64, as gclip does.

The implementations run interleaved, rep by rep, in a rotating order, so they
see the same machine state. Every timed call starts after a ``Barrier`` and
after an untimed call of the same op (warm caches: small shards would otherwise
time the previous op's cache pollution; ``--cold`` evicts L1/L2 instead, as a
backward pass would). A rep's time is the slowest rank's; a case's time is the
median over reps.

Active clipping without drift: ``max_norm`` is set ``DELTA`` (2**-20, about
1e-6) below the current global norm before every rep, so each rep scales by
about 1 - 1e-6 and really writes every element, while the data shrink by 0.1%
at most over a thousand reps: values never approach the subnormal range, where
arithmetic is slow and the timing would lie. The current norm is tracked from
what each implementation returns (gclip's total_norm and scale, torch's norm
and coefficient; the floor's known factor); every gclip rep re-reads the true
norm, and a rep that did not clip is counted in ``misses`` (expected 0).

Besides time: the collectives per clip (a counting proxy passed as ``comm``),
the time of a bare ``Allreduce`` of the clip's header (9 doubles), and the peak extra memory of an
in-place clip (tracemalloc, which numpy reports to; and the peak-RSS growth,
where Linux lets it be reset). BLAS and OpenMP threads are pinned to 1 per
rank unless the environment sets them (``--threads N`` overrides): ranks
already fill the cores.

``--ranks-sweep`` runs this benchmark under ``mpirun -n R`` for each R (with a
timeout) and tabulates step time against ranks and size.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ._lab import cli as _cli
from ._lab.cli import UsageError
from .errors import exception_line

__all__ = ["CountingComm", "main", "parse_dtypes", "parse_sizes"]

PROG = "gclip.bench"
DEFAULT_SIZES = "1e3,1e4,1e5,1e6,1e7"
QUICK_SIZES = "1e3,1e4"
DELTA = 2.0**-20  # active clipping: max_norm this far (relative) below the norm
TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
REPORTED_VARS = (*THREAD_VARS, "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_VERBOSE")
_PINNED = "_GCLIP_BENCH_PINNED"  # set before the re-exec, so it happens once
SCHEMA = "gclip.bench/1"
MAX_ELEMENTS = 2 * 10**9


# ---------------------------------------------------------------------------
# arguments


def parse_sizes(text: str) -> list[int]:
    """'1e3,1e4,10000' -> [1000, 10000, 10000]: whole numbers of elements per rank."""
    sizes = []
    for tok in text.split(","):
        tok = tok.strip().replace("_", "")
        try:
            value = float(tok)
        except ValueError:
            raise UsageError(f"--sizes: {tok!r} is not a number (e.g. 1e3,1e4,1e5)") from None
        if not (math.isfinite(value) and value.is_integer() and 1 <= value <= MAX_ELEMENTS):
            raise UsageError(f"--sizes: {tok!r} is not a whole number of elements in 1..{MAX_ELEMENTS:.0e}")
        sizes.append(int(value))
    return sizes


def parse_dtypes(text: str) -> list[str]:
    """'float32,float64' -> names; gclip's bench covers the two training dtypes."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in ("float32", "float64"):
            raise UsageError(f"--dtypes: {name!r} is not float32 or float64")
    if not names:
        raise UsageError("--dtypes: give float32, float64 or both")
    return names


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(t) for t in text.split(",")]
    except ValueError:
        raise UsageError(f"--ranks: {text!r} is not a list of whole numbers (e.g. 1,2,4)") from None
    if not ranks or any(r < 1 or r > 64 for r in ranks):
        raise UsageError("--ranks: each rank count must be in 1..64")
    return ranks


def _positive(name: str) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{name}: {text!r} is not a whole number") from None
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
        return value

    return convert


def _parser() -> _cli.ArgParser:
    p = _cli.ArgParser(prog=PROG, description="Time the clip step against its floor and torch.")
    p.add_argument("--sizes", help=f"elements per rank, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--dtypes", default="float64,float32", help="float32, float64 or both")
    p.add_argument("--repeat", type=_positive("--repeat"), help="timed reps per case (default: by size)")
    p.add_argument("--threads", type=_positive("--threads"), help="BLAS/OpenMP/torch threads per rank")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write results as JSON (- : stdout)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed comparison")
    p.add_argument("--cold", action="store_true", help="evict L1/L2 before each timed call (default: warm)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 reps: a smoke run")
    p.add_argument("--ranks-sweep", action="store_true", help="run under mpirun -n R for each --ranks")
    p.add_argument("--ranks", default="1,2,4", help="rank counts of --ranks-sweep (default 1,2,4)")
    p.add_argument("--timeout", type=_positive("--timeout"), default=1800, help="seconds per sweep run")
    return p


def _options(argv: Sequence[str] | None) -> Any:
    args = _parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.dtypes = parse_dtypes(args.dtypes)
    args.ranks = parse_ranks(args.ranks)
    if args.repeat is None and args.quick:
        args.repeat = 5
    if args.plot:
        from ._lab import plots

        plots.require()
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-":
            _check_writable(flag, path)
    return args


def _check_writable(flag: str, path: str) -> None:
    """Before the run, on every rank: a result that cannot be saved is a usage error."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}: cannot write {path!r}: no such writable folder")


def auto_repeat(n: int) -> int:
    """Reps for a shard of n elements: ~300 for small shards, fewer for big ones."""
    return max(7, min(300, int(3e8 // n)))


# ---------------------------------------------------------------------------
# threads: fixed before numpy's BLAS starts its pool, so by re-exec


def _wanted_threads(argv: Sequence[str]) -> str | None:
    """The --threads value from raw argv (before argparse, before numpy matters)."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return None


def pin_threads(argv: Sequence[str], env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-exec with, or None if the threads are as wanted.

    Unset thread variables become 1 (the ranks already fill the cores);
    ``--threads N`` overrides whatever is set.
    """
    if env.get(_PINNED):
        return None
    wanted = _wanted_threads(argv)
    if wanted is not None and not (wanted.isdigit() and int(wanted) >= 1):
        return None  # argparse will report it
    new = dict(env)
    for var in THREAD_VARS:
        if wanted is not None:
            new[var] = wanted
        else:
            new.setdefault(var, "1")
    if all(new.get(v) == env.get(v) for v in THREAD_VARS):
        return None
    new[_PINNED] = "1"
    return new


def _reexec_pinned() -> None:
    """numpy (and its BLAS thread pool) is loaded with the gclip package, so the
    thread variables only take effect in a fresh interpreter: exec one, once,
    before MPI starts."""
    env = pin_threads(sys.argv[1:], dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", PROG, *sys.argv[1:]], env)


def _threads() -> int:
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "0")))
    except ValueError:
        return 1


# ---------------------------------------------------------------------------
# counting collectives


_COUNTED = frozenset(
    "Allreduce allreduce Iallreduce Allgather allgather Allgatherv Bcast bcast Reduce reduce "
    "Reduce_scatter Reduce_scatter_block Gather gather Gatherv Scatter scatter Alltoall alltoall "
    "Scan scan Exscan exscan Barrier barrier Send send Recv recv Sendrecv sendrecv Isend isend "
    "Irecv irecv".split()
)


class CountingComm:
    """A communicator proxy that counts the communication calls made through it.

    mpi4py's lowercase methods pickle Python objects; uppercase ones move
    buffers. Everything else is forwarded untouched.
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name not in _COUNTED:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def summary(self) -> dict[str, Any]:
        total = sum(self.calls.values())
        pickled = sum(n for name, n in self.calls.items() if name[0].islower())
        return {"total": total, "pickle_based": pickled, "calls": dict(sorted(self.calls.items()))}


def count_collectives(comm: Any, clip: Callable[..., Any], case: Callable[[], tuple]) -> dict[str, Any]:
    """Run one clip with a counting proxy as ``comm``; the counts, max over ranks."""
    proxy = CountingComm(comm)
    args, kwargs = case()
    clip(*args, comm=proxy, **kwargs)
    mine = proxy.summary()
    every = comm.allgather(mine)  # after the clip, outside the counted proxy
    worst = max(every, key=lambda s: s["total"])
    return {**worst, "same_on_all_ranks": all(s == every[0] for s in every)}


# ---------------------------------------------------------------------------
# timing


def _time_reps(
    comm: Any, ops: Sequence[tuple[str, Callable[[], Any]]], repeat: int, cold: bool = False
) -> dict[str, list]:
    """``repeat`` rounds over the ops in a rotating order; returns this rank's times.

    Each timed call starts after a Barrier. Before it, an untimed call of the
    same op (warm: each op in its own steady state, not in the caches the
    previous op left), or with ``cold`` a write of 8 MiB that evicts L1 and L2
    (the clip after a backward pass has swept the caches).
    """
    from time import perf_counter

    sweep = _Sweeper() if cold else None
    times: dict[str, list] = {name: [] for name, _ in ops}
    k = len(ops)
    for rep in range(repeat):
        for name, op in [ops[(rep + i) % k] for i in range(k)]:
            comm.Barrier()
            if sweep is None or rep == 0:
                op()
            if sweep is not None:
                sweep()
            comm.Barrier()
            t0 = perf_counter()
            op()
            times[name].append(perf_counter() - t0)
    return times


class _Sweeper:
    """Writes a buffer larger than L2, evicting what the caches held."""

    def __init__(self, nbytes: int = 8 << 20) -> None:
        import numpy as np

        self.buf = np.zeros(nbytes // 8)

    def __call__(self) -> None:
        self.buf += 1.0


def slowest_rank_medians(per_rank: Sequence[dict[str, list]]) -> dict[str, dict[str, float]]:
    """Per rep the slowest rank's time; then median and min over reps."""
    out = {}
    for name in per_rank[0]:
        reps = [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
        out[name] = {"median_s": statistics.median(reps), "min_s": min(reps), "reps": len(reps)}
    return out


def time_allreduce(comm: Any, repeat: int = 300) -> float:
    """Median time of a bare SUM Allreduce of the clip's header size (slowest rank per rep)."""
    import numpy as np
    from mpi4py import MPI

    from .engine import HEADER_SIZE

    buf, out = np.zeros(HEADER_SIZE), np.empty(HEADER_SIZE)
    times = _time_reps(comm, [("allreduce", lambda: comm.Allreduce(buf, out, op=MPI.SUM))], repeat)
    every = comm.gather(times, root=0)
    return slowest_rank_medians(every)["allreduce"]["median_s"] if every else math.nan


class _Norm:
    """The current global norm of the shared data, as the implementations see it."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.misses = 0


def _ops(x: Any, norm: _Norm, active: bool, torch_ctx: Any, comm: Any) -> list:
    """The implementations to time on shard ``x``: name -> zero-argument op."""
    import numpy as np

    import gclip

    fixed = 2.0 * norm.value  # inactive: never reached, the data never change

    def limit() -> float:
        return norm.value * (1.0 - DELTA) if active else fixed

    def floor() -> None:
        np.dot(x, x)
        if active:
            np.multiply(x, 1.0 - DELTA, out=x)
            norm.value *= 1.0 - DELTA

    from mpi4py import MPI

    from .engine import HEADER_SIZE

    header, total = np.zeros(HEADER_SIZE), np.empty(HEADER_SIZE)

    def bare() -> None:  # the floor plus the one all-reduce, nothing checked: no clip can beat it
        header[-1] = np.dot(x, x)
        comm.Allreduce(header, total, op=MPI.SUM)
        math.sqrt(total[-1])
        if active:
            np.multiply(x, 1.0 - DELTA, out=x)
            norm.value *= 1.0 - DELTA

    def clip(reproducible: bool) -> Callable[[], None]:
        def run() -> None:
            res = gclip.clip_by_global_norm(x, limit(), comm=comm, inplace=True, reproducible=reproducible)
            if active:
                norm.misses += res.scale >= 1.0
                norm.value = res.total_norm * res.scale

        return run

    ops = [("floor", floor), ("bare", bare), ("gclip", clip(False)), ("gclip-repro", clip(True))]
    if torch_ctx is not None:
        ops += torch_ctx.ops(x, norm, limit, active)
    return ops


def bench_case(
    comm: Any, x: Any, active: bool, repeat: int, torch_ctx: Any, cold: bool = False
) -> dict[str, Any] | None:
    """Time every implementation on shard x, clipping active or not (rank 0 gets the rows)."""
    import gclip

    norm = _Norm(gclip.global_norm(x, comm=comm))
    times = _time_reps(comm, _ops(x, norm, active, torch_ctx, comm), repeat, cold)
    misses = comm.allreduce(norm.misses)
    every = comm.gather(times, root=0)
    if every is None:
        return None
    return {"times": slowest_rank_medians(every), "misses": misses}


# ---------------------------------------------------------------------------
# torch.distributed (optional)


class TorchClip:
    """The FSDP-style clip of torch.distributed over gloo, on numpy's memory."""

    def __init__(self, torch: Any, dist: Any) -> None:
        self.torch, self.dist = torch, dist

    def step(self, t: Any, max_norm: float, acc: Any) -> tuple[Any, Any]:
        torch, dist = self.torch, self.dist
        total = torch.linalg.vector_norm(t, 2, dtype=acc) ** 2
        dist.all_reduce(total)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + TORCH_EPS), max=1.0)
        t.mul_(coef)
        return norm, coef

    def ops(self, x: Any, norm: _Norm, limit: Callable[[], float], active: bool) -> list:
        t = self.torch.from_numpy(x)  # shares x's memory
        accs = [("torch", t.dtype)]
        if t.dtype == self.torch.float32:
            accs.append(("torch-f64acc", self.torch.float64))

        def op(acc: Any) -> Callable[[], None]:
            def run() -> None:
                got, coef = self.step(t, limit(), acc)
                if active:
                    norm.value = float(got) * float(coef)

            return run

        return [(name, op(acc)) for name, acc in accs]


def torch_setup(comm: Any, threads: int) -> tuple[Any, str]:
    """(TorchClip or None, a one-line note): gloo on 127.0.0.1, rank 0 picks the port."""
    try:
        import torch
        import torch.distributed as dist
    except (ImportError, OSError):  # a broken install counts as missing
        torch = None
    if not comm.allreduce(torch is not None and dist.is_available() and dist.is_gloo_available(), op=_min()):
        return None, "torch not installed (pip install 'gclip[bench]'): torch comparison skipped"
    torch.set_num_threads(threads)
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: stay on loopback
    error = ""
    try:
        import datetime

        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=comm.Get_rank(),
            world_size=comm.Get_size(),
            timeout=datetime.timedelta(seconds=60),
        )
    except Exception as exc:  # noqa: BLE001 - agreed on below; the bench goes on without torch
        error = exception_line(exc, with_type=False)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        return None, f"torch.distributed (gloo) did not start: {errors[0]}; torch comparison skipped"
    return TorchClip(torch, dist), f"torch {torch.__version__}, gloo on 127.0.0.1:{port}"


def torch_teardown(ctx: Any) -> None:
    if ctx is not None:
        ctx.dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _min() -> Any:
    from mpi4py import MPI

    return MPI.MIN


# ---------------------------------------------------------------------------
# memory


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
        traced = comm.allreduce(traced, op=_max())
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


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


# ---------------------------------------------------------------------------
# the run


def _shard(n: int, dtype: str, rank: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(20240 + rank)
    return rng.standard_normal(n, dtype=np.dtype(dtype).type)


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
        if impl == "gclip-repro":
            row["vs_default"] = t["median_s"] / default
        if impl == "gclip":
            row["vs_bare"] = t["median_s"] / times["bare"]["median_s"]
        if impl.startswith("torch"):
            row["gclip_vs_this"] = default / t["median_s"]
        if impl.startswith("gclip"):
            row["misses"] = got["misses"] if active else 0
        rows.append(row)
    return rows


def _progress(message: str) -> None:
    if _cli.rank_size()[0] == 0:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def run_bench(comm: Any, args: Any) -> dict[str, Any] | None:
    """All measurements; rank 0 returns the results, the others None."""
    import numpy as np

    rank = comm.Get_rank()
    _check_memory(comm, args)
    torch_ctx, torch_note = (None, "torch comparison off (--no-torch)")
    if not args.no_torch:
        torch_ctx, torch_note = torch_setup(comm, _threads())
    _progress(torch_note)
    load_start = _load()
    if load_start > 0.5:
        _progress(
            f"warning: load average {load_start:.1f} at the start: other processes compete, timings are noisy"
        )
    start = time.perf_counter()
    ar = time_allreduce(comm)
    collectives = _collective_counts(comm)
    rows: list[dict] = []
    memory: list[dict] = []
    try:
        for dtype in args.dtypes:
            for n in args.sizes:
                x = _shard(n, dtype, rank)
                repeat = args.repeat or auto_repeat(n)
                for active in (False, True):
                    t0 = time.perf_counter()
                    got = bench_case(comm, x, active, repeat, torch_ctx, args.cold)
                    if got is not None:
                        rows += case_rows(n, dtype, x.itemsize, active, got)
                        _progress(_case_line(rows, n, dtype, active, repeat, time.perf_counter() - t0))
                memory += measure_memory(comm, x)
                del x
    finally:
        torch_teardown(torch_ctx)
    if rank != 0:
        return None
    return {
        "schema": SCHEMA,
        "ranks": comm.Get_size(),
        "threads": _threads(),
        "timing": "per rep: slowest rank after a Barrier; per case: median over reps",
        "caches": "cold: L1/L2 evicted before each call" if args.cold else "warm: after an untimed call",
        "delta": DELTA,
        "environment": _environment(np),
        "torch": torch_ctx.torch.__version__ if torch_ctx is not None else None,
        "torch_note": torch_note,
        "allreduce_s": ar,
        "collectives": collectives,
        "rows": rows,
        "memory": memory,
        "targets": targets(rows, memory, collectives, ar),
        "seconds": time.perf_counter() - start,
        "load_average": {"start": load_start, "end": _load()},
    }


def _load() -> float:
    """The 1-minute load average (NaN where the OS has none): a busy machine makes noisy timings."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def needed_bytes(sizes: Sequence[int], dtypes: Sequence[str], ranks: int, torch: bool) -> int:
    """Memory the largest case holds on this machine: every rank's shard, plus
    torch's float64 copy of a float32 shard (torch-f64acc)."""
    itemsize = {"float32": 4, "float64": 8}
    per_rank = max(
        n * itemsize[d] + (n * 8 if torch and d == "float32" else 0) for n in sizes for d in dtypes
    )
    return per_rank * ranks


def _check_memory(comm: Any, args: Any) -> None:
    """Refuse sizes that would not fit (1e8 float64 is 0.8 GB per rank); rank 0 decides for all."""
    verdict = None
    if comm.Get_rank() == 0:
        need = needed_bytes(args.sizes, args.dtypes, comm.Get_size(), not args.no_torch)
        free = _mem_available()
        if free is not None and need > 0.8 * free:
            verdict = (
                f"--sizes {_fmt_n(max(args.sizes))} needs about {_fmt_bytes(need)} on"
                f" {comm.Get_size()} ranks, more than 80% of the {_fmt_bytes(free)} available"
            )
    verdict = comm.bcast(verdict, root=0)
    if verdict:
        raise UsageError(verdict)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _case_line(rows: list[dict], n: int, dtype: str, active: bool, repeat: int, secs: float) -> str:
    mine = {r["impl"]: r for r in rows if r["n"] == n and r["dtype"] == dtype and r["active"] == active}
    g = mine["gclip"]
    return (
        f"{dtype} n={_fmt_n(n)} clip {'active' if active else 'inactive'}: {repeat} reps in {secs:.1f} s,"
        f" gclip {_fmt_t(g['median_s'])} = {g['vs_floor']:.2f}x floor"
    )


def _collective_counts(comm: Any) -> dict[str, Any]:
    """Collectives per clip on each path, with a counting proxy as ``comm``."""
    import numpy as np

    import gclip

    x = _shard(1000, "float64", comm.Get_rank())
    norm = gclip.global_norm(x, comm=comm)

    def case(limit: float, **kw: Any) -> Callable[[], tuple]:
        return lambda: ((x, limit), {"inplace": True, **kw})

    y = x.astype(np.float32)

    def case32() -> tuple:
        return (y, norm * 0.5), {"inplace": True}

    clip = gclip.clip_by_global_norm
    return {
        "default_inactive": count_collectives(comm, clip, case(2.0 * norm)),
        "default_active": count_collectives(comm, clip, case(norm * 0.5)),
        "default_float32": count_collectives(comm, clip, case32),
        "reproducible": count_collectives(comm, clip, case(norm * 0.5, reproducible=True)),
    }


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


# ---------------------------------------------------------------------------
# targets


def _row(rows: list[dict], n: int, dtype: str, active: bool, impl: str) -> dict | None:
    for r in rows:
        if (r["n"], r["dtype"], r["active"], r["impl"]) == (n, dtype, active, impl):
            return r
    return None


def targets(rows: list[dict], memory: list[dict], collectives: dict, ar: float) -> list[dict]:
    """The performance targets, each with its measured value and a verdict."""
    out = []

    def add(name: str, value: float, limit: float, ok: bool, note: str = "") -> None:
        out.append({"name": name, "value": value, "limit": limit, "ok": bool(ok), "note": note})

    for dtype, limit in (("float64", 1.25), ("float32", 2.0)):
        for active in (False, True):
            r = _row(rows, 10**7, dtype, active, "gclip")
            if r is not None:
                state = "active" if active else "inactive"
                add(f"{dtype} 1e7 {state}: gclip / floor", r["vs_floor"], limit, r["vs_floor"] <= limit)
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    if torch_rows:
        worst = min(torch_rows, key=lambda r: -r["gclip_vs_this"])
        where = f"worst: {worst['dtype']} {_fmt_n(worst['n'])} {'active' if worst['active'] else 'inactive'}"
        add("gclip / torch, every case", worst["gclip_vs_this"], 1.0, worst["gclip_vs_this"] <= 1.0, where)
    small = _row(rows, 10**4, "float64", False, "gclip")
    bare = _row(rows, 10**4, "float64", False, "bare")
    if small is not None and bare is not None:
        share = ar / small["median_s"]
        add(
            "1e4 float64 step: share of one Allreduce",
            share,
            0.5,
            share >= 0.5,
            f"at least the limit; the bare step, dot + Allreduce, unchecked: {ar / bare['median_s']:.2f}",
        )
    for mode in ("default", "reproducible"):
        big = [m for m in memory if m["mode"] == mode and m["n"] >= 10**6]
        if big:
            worst_m = max(big, key=lambda m: m["ratio"])
            note = f"worst: {worst_m['dtype']} {_fmt_n(worst_m['n'])}"
            add(
                f"peak extra memory / shard, {mode}, n >= 1e6",
                worst_m["ratio"],
                0.05,
                worst_m["ratio"] <= 0.05,
                note,
            )
    d = collectives["default_active"]
    add("collectives per default clip", d["total"], 1, d["total"] == 1 and d["pickle_based"] == 0)
    return out


# ---------------------------------------------------------------------------
# output


def _fmt_n(n: int) -> str:
    e = math.log10(n) if n > 0 else 0
    return f"1e{round(e)}" if e == round(e) else f"{n:.3g}"


def _fmt_t(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def format_table(result: dict[str, Any]) -> str:
    """The human table: one line per (dtype, size, clip state)."""
    rows = result["rows"]
    has_torch = any(r["impl"] == "torch" for r in rows)
    head = ["dtype", "n/rank", "clip", "floor", "GB/s", "gclip", "GB/s", "x floor", "x bare"]
    head += ["repro", "x dflt"]
    if has_torch:
        head += ["torch", "gclip/torch", "torch-f64acc"]
    lines = [head]
    keys = sorted(
        {(r["dtype"], r["n"], r["active"]) for r in rows}, key=lambda k: (k[0] != "float64", k[1], k[2])
    )
    for dtype, n, active in keys:
        f = _row(rows, n, dtype, active, "floor")
        g = _row(rows, n, dtype, active, "gclip")
        p = _row(rows, n, dtype, active, "gclip-repro")
        line = [dtype, _fmt_n(n), "active" if active else "off"]
        line += [_fmt_t(f["median_s"]), f"{f['gb_per_s']:.2f}", _fmt_t(g["median_s"]), f"{g['gb_per_s']:.2f}"]
        line += [f"{g['vs_floor']:.2f}", f"{g['vs_bare']:.2f}"]
        line += [_fmt_t(p["median_s"]), f"{p['vs_default']:.2f}"]
        if has_torch:
            t = _row(rows, n, dtype, active, "torch")
            t64 = _row(rows, n, dtype, active, "torch-f64acc")
            line += [
                _fmt_t(t["median_s"]),
                f"{t['gclip_vs_this']:.2f}",
                _fmt_t(t64["median_s"]) if t64 else "-",
            ]
        lines.append(line)
    out = [_columns(lines)]
    out.append("")
    out.append(
        f"{result['ranks']} ranks, {result['threads']} thread(s) per rank; {result['timing']};"
        f" caches {result['caches']}.\n"
        "GB/s: per rank, n*itemsize bytes when off (one read), 3x when active (read, read, write)."
    )
    out.append(f"bare header-sized Allreduce: {_fmt_t(result['allreduce_s'])}; {result['torch_note']}")
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
        rss = "-" if m["rss_extra_bytes"] is None else _fmt_bytes(m["rss_extra_bytes"])
        out.append(
            f"  {m['dtype']:8s} {_fmt_n(m['n']):>5s} {m['mode']:12s} {_fmt_bytes(m['peak_extra_bytes']):>9s}"
            f" / {_fmt_bytes(m['shard_bytes']):>9s} = {m['ratio'] * 100:.3g}%   rss +{rss}"
        )
    misses = sum(r.get("misses", 0) for r in rows)
    if misses:
        out.append(f"warning: {misses} active rep(s) did not clip (see 'misses' in the JSON)")
    out.append("targets:")
    for t in result["targets"]:
        mark = "ok  " if t["ok"] else "MISS"
        note = f"  ({t['note']})" if t["note"] else ""
        out.append(f"  {mark} {t['name']}: {t['value']:.3g} (limit {t['limit']:g}){note}")
    return "\n".join(out)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _columns(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = []
    for j, line in enumerate(lines):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        text.append("  ".join(cells).rstrip())
        if j == 0:
            text.append("-" * len(text[0]))
    return "\n".join(text)


def plot_results(result: dict[str, Any], path: str) -> None:
    """Time per active clip against size, per dtype; and each clip's ratio to the floor."""
    from ._lab import plots

    rows = result["rows"]
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: d != "float64")
    fig, axes = plots.figure(len(dtypes) + 1, title=f"gclip.bench: {result['ranks']} ranks, 1 step")
    colors = {"floor": plots.COLORS["bound"], "gclip": plots.COLORS["correct"], "gclip-repro": "#457b9d"}
    colors.update({"torch": plots.COLORS["bug"], "torch-f64acc": plots.COLORS["other"]})
    for ax, dtype in zip(axes, dtypes):
        mine = [r for r in rows if r["dtype"] == dtype and r["active"]]
        sizes = sorted({r["n"] for r in mine})
        series = {
            impl: [_row(rows, n, dtype, True, impl)["median_s"] for n in sizes]
            for impl in colors
            if all(_row(rows, n, dtype, True, impl) for n in sizes)
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
            got = [_row(rows, n, dtype, active, impl) for n in sizes]
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


def _emit(result: dict[str, Any], args: Any, table: str) -> None:
    """Table on stdout (stderr when JSON goes to stdout); JSON; plot. Rank 0 only."""
    to_stdout = args.json == "-"
    print(table, file=sys.stderr if to_stdout else sys.stdout, flush=True)
    if args.json:
        text = json.dumps(result, indent=1, sort_keys=False)
        if to_stdout:
            print(text, flush=True)
        else:
            _write(args.json, text + "\n")
    if args.plot:
        plot_results(result, args.plot) if not args.ranks_sweep else plot_sweep(result, args.plot)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------
# the ranks sweep


def _child_env(timeout: int) -> dict[str, str]:
    """The environment for a nested mpirun: without this job's process-manager variables."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_CH3", "OMPI_", _PINNED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.setdefault("MPIEXEC_TIMEOUT", str(timeout))  # Hydra's own watchdog as well
    return env


def _mpirun() -> str:
    import shutil

    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        raise UsageError("--ranks-sweep needs mpirun on PATH")
    return exe


def sweep_command(ranks: int, args: Any, out: str) -> list[str]:
    """The command line of one sweep run (no torch: the sweep is about ranks)."""
    sizes = ",".join(str(n) for n in args.sizes)
    cmd = ["timeout", str(args.timeout), _mpirun(), "-n", str(ranks), sys.executable, "-m", PROG]
    cmd += ["--sizes", sizes, "--dtypes", ",".join(args.dtypes), "--no-torch", "--json", out]
    if args.repeat:
        cmd += ["--repeat", str(args.repeat)]
    cmd += ["--threads", str(args.threads or _threads())]
    return cmd


def run_sweep(args: Any) -> dict[str, Any]:
    import subprocess
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory(prefix="gclip-bench-") as tmp:
        for ranks in args.ranks:
            out = os.path.join(tmp, f"r{ranks}.json")
            cmd = sweep_command(ranks, args, out)
            print(f"{PROG}: sweep: {ranks} rank(s) ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(
                cmd, env=_child_env(args.timeout), capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                why = "timed out" if proc.returncode == 124 else f"exited {proc.returncode}"
                raise UsageError(f"--ranks-sweep: mpirun -n {ranks} {why}: {tail}")
            with open(out) as f:
                runs.append(json.load(f))
            print(f"{PROG}: sweep: {ranks} rank(s) done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cpus = os.cpu_count() or 1
    return {"schema": SCHEMA + "/sweep", "cpus": cpus, "runs": runs, "sweep": sweep_rows(runs)}


def sweep_rows(runs: Sequence[dict]) -> list[dict]:
    """One row per (dtype, n, clip state, ranks): gclip and floor medians."""
    rows = []
    for run in runs:
        for r in run["rows"]:
            if r["impl"] == "gclip":
                f = _row(run["rows"], r["n"], r["dtype"], r["active"], "floor")
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
    rows = result["sweep"]
    ranks = sorted({r["ranks"] for r in rows})
    head = ["dtype", "n/rank", "clip"]
    for k in ranks:
        head += [f"gclip R={k}", f"floor R={k}", "x floor"]
    lines = [head]
    keys = sorted(
        {(r["dtype"], r["n"], r["active"]) for r in rows}, key=lambda k: (k[0] != "float64", k[1], k[2])
    )
    for dtype, n, active in keys:
        line = [dtype, _fmt_n(n), "active" if active else "off"]
        for k in ranks:
            got = [r for r in rows if (r["dtype"], r["n"], r["active"], r["ranks"]) == (dtype, n, active, k)]
            if got:
                line += [_fmt_t(got[0]["gclip_s"]), _fmt_t(got[0]["floor_s"]), f"{got[0]['vs_floor']:.2f}"]
            else:
                line += ["-", "-", "-"]
        lines.append(line)
    ar = {r["ranks"]: r["allreduce_s"] for r in rows}
    note = ", ".join(f"R={k}: {_fmt_t(ar[k])}" for k in ranks)
    over = [k for k in ranks if k > result["cpus"]]
    text = [_columns(lines), "", f"bare header-sized Allreduce: {note}"]
    if over:
        text.append(
            f"R={','.join(map(str, over))} oversubscribes the {result['cpus']} cores: ranks take turns on"
            " a core, so a collective waits for a descheduled rank: the scheduler's time, not gclip's."
        )
    return "\n".join(text)


def plot_sweep(result: dict[str, Any], path: str) -> None:
    from ._lab import plots

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


# ---------------------------------------------------------------------------


def _main(argv: Sequence[str] | None) -> int:
    if argv is None:
        _reexec_pinned()
    args = _options(argv)
    if args.ranks_sweep:
        if _cli.rank_size()[1] > 1:
            raise UsageError("--ranks-sweep launches mpirun itself: run it without mpirun")
        result = run_sweep(args)
        _emit(result, args, format_sweep(result))
        return 0
    from mpi4py import MPI

    result = run_bench(MPI.COMM_WORLD, args)
    if result is not None:
        _emit(result, args, format_table(result))
    return 0


main = _cli.entry(PROG, _main)

if __name__ == "__main__":
    main()
