"""What is timed: the floor, the bare step, gclip (default and reproducible), torch.distributed."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from .._lab.lines import exception_line
from ..engine import HEADER_SIZE
from ..gallery import TORCH_EPS
from .timing import slowest_rank_medians, time_reps
from .workloads import DELTA, INACTIVE_FACTOR

__all__ = [
    "GLOO_INIT_TIMEOUT",
    "Norm",
    "TorchClip",
    "bench_case",
    "implementations",
    "torch_setup",
    "torch_teardown",
]

GLOO_INIT_TIMEOUT = 60  # seconds for torch.distributed to connect the ranks


class Norm:
    """The current global norm of the shared data, as the implementations see it."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.misses = 0


def implementations(x: Any, norm: Norm, active: bool, torch_ctx: Any, comm: Any) -> list:
    """The implementations to time on shard ``x``: name -> zero-argument op."""
    import numpy as np

    import gclip

    fixed = INACTIVE_FACTOR * norm.value  # inactive: never reached, the data never change

    def limit() -> float:
        return norm.value * (1.0 - DELTA) if active else fixed

    def floor() -> None:
        np.dot(x, x)
        if active:
            np.multiply(x, 1.0 - DELTA, out=x)
            norm.value *= 1.0 - DELTA

    from mpi4py import MPI

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

    norm = Norm(gclip.global_norm(x, comm=comm))
    cpu: dict[str, list] = {}
    times = time_reps(comm, implementations(x, norm, active, torch_ctx, comm), repeat, cold, cpu)
    misses = comm.allreduce(norm.misses)
    every = comm.gather(times, root=0)
    every_cpu = comm.gather(cpu, root=0)
    if every is None:
        return None
    return {"times": slowest_rank_medians(every, every_cpu), "misses": misses}


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

    def ops(self, x: Any, norm: Norm, limit: Callable[[], float], active: bool) -> list:
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
            timeout=datetime.timedelta(seconds=GLOO_INIT_TIMEOUT),
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
