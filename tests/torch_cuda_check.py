"""Check gclip.torch's CUDA path on a machine with a GPU (a minute or two).

    python tests/torch_cuda_check.py     # exits 0 and says so when there is no CUDA device

What it checks, on CUDA tensors of every dtype:

1. the norm is the fsum oracle's (1e-12 relative), and the clipped gradients
   are bitwise those of the same clip on CPU copies (the same float32 or
   float64 products on both devices);
2. the reproducible norm has the numpy core's bits;
3. the number of host syncs does not grow with the number of tensors (CUDA's
   sync debug mode counts them);
4. a bfloat16 gradient is never copied whole: the peak extra device memory
   stays within a few working chunks;
5. a one-rank NCCL process group (the header on the current CUDA device);
6. the sync-free path (``gclip.torch._device``) under
   ``torch.cuda.set_sync_debug_mode("error")``: two calls, no sync (the second
   reads the first one's verdict from pinned memory), and compiled with
   ``fullgraph=True``, equal to eager.

It prints, for GPT-2-small-shaped float32 gradients, the device bandwidth (a
clone) and each clip's time and GB/s against it, gclip against torch.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

import numpy as np


class OneRank:
    """An mpi4py-like communicator of one rank, without MPI."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Allreduce(self, send, recv, op=None):
        recv[...] = send

    def allgather(self, item):
        return [item]


def fsum_norm(tensors) -> float:
    values = [np.square(t.detach().cpu().double().numpy().ravel()) for t in tensors]
    return math.sqrt(math.fsum(np.concatenate(values).tolist()))


def grads_of(dtype, device, seed, shapes):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        p.grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
        out.append(p)
    return out


def check(name, ok, detail=""):
    print(f"  {'ok  ' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}")
    return bool(ok)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("torch_cuda_check: no CUDA device here: skipped")
        return 0
    import gclip
    import gclip.torch as gt
    from gclip.torch import _partials as tp

    one = OneRank()
    cuda = torch.device("cuda", torch.cuda.current_device())
    print(f"torch_cuda_check on {torch.cuda.get_device_name(cuda)}, torch {torch.__version__}")
    results = []
    shapes = [(300, 257), (1000,), (), (64, 3, 3, 3)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        on_gpu, on_cpu = grads_of(dtype, cuda, 1, shapes), grads_of(dtype, "cpu", 1, shapes)
        exact = fsum_norm([p.grad for p in on_cpu])
        limit = 0.3 * exact
        n_gpu = gt.clip_grad_norm_(on_gpu, limit, comm=one)
        gt.clip_grad_norm_(on_cpu, limit, comm=one)
        on_device = n_gpu.device == cuda and n_gpu.dtype == torch.float64
        results.append(check(f"{dtype} norm: float64, on the device", on_device))
        results.append(check(f"{dtype} norm = fsum", abs(n_gpu.item() - exact) <= 1e-12 * exact))
        same = all(torch.equal(a.grad.cpu(), b.grad) for a, b in zip(on_gpu, on_cpu))
        results.append(check(f"{dtype} scaled as on the CPU, bitwise", same))
        rep = gt.get_total_norm([p.grad for p in on_gpu], reproducible=True, comm=one).item()
        core = gclip.global_norm([p.grad.cpu().double().numpy() for p in on_gpu], reproducible=True, comm=one)
        results.append(check(f"{dtype} reproducible bits = numpy core", rep == core, f"{rep!r} {core!r}"))

    # host syncs: the same count for 4 tensors and for 40
    def syncs(n):
        params = grads_of(torch.float32, cuda, 2, [(1000,)] * n)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                gt.clip_grad_norm_(params, 0.1, comm=one)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    few, many = syncs(4), syncs(40)
    results.append(check("syncs do not grow with the tensors", few == many, f"{few} for 4, {many} for 40"))

    # the sync-free path: no host sync at all (sync debug mode "error" raises on one), twice (the
    # second call reads the first call's verdict, from pinned memory), and under torch.compile
    for dtype in (torch.float32, torch.bfloat16):
        params = grads_of(dtype, cuda, 5, shapes)
        exact = fsum_norm([q.grad for q in params])
        gt.clip_grad_norm_(params, 1e9, comm=one)  # warm: the header's constants go down once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            error = ""
            norms = [gt.clip_grad_norm_(params, 1e9, comm=one) for _ in range(2)]
        except RuntimeError as exc:
            error = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ok = not error and abs(norms[-1].item() - exact) <= 1e-12 * exact and norms[-1].device == cuda
        results.append(check(f"{dtype} sync-free under set_sync_debug_mode('error')", ok, error[:200]))
        torch._dynamo.reset()
        compiled = torch.compile(lambda ps=params: gt.clip_grad_norm_(ps, 1e9, comm=one), fullgraph=True)
        results.append(check(f"{dtype} compiled, fullgraph = eager", compiled().item() == norms[-1].item()))

    # memory: a bfloat16 gradient of 64M elements is read in chunks
    n = 64 << 20
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device=cuda))
    p.grad = torch.randn(n, device=cuda).bfloat16()
    for reproducible in (False, True):
        gt.clip_grad_norm_(p, 1.0, comm=one, reproducible=reproducible)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gt.clip_grad_norm_(p, 1.0, comm=one, reproducible=reproducible)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        budget = 4 * 8 * tp.DEVICE_CHUNK  # a few float64 chunks; a float32 copy would be 256 MiB
        what = f"bf16 peak extra memory (reproducible={reproducible})"
        results.append(check(what, extra <= budget, f"{extra} B"))
    del p

    # NCCL: a one-rank process group, the header on the current device
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available() and not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=cuda)
        try:
            params = grads_of(torch.bfloat16, cuda, 3, shapes)
            exact = fsum_norm([q.grad for q in params])
            got = gt.clip_grad_norm_(params, 1.0).item()  # comm=None: the default (NCCL) group
            results.append(check("NCCL group: norm = fsum", abs(got - exact) <= 1e-12 * exact))
        finally:
            dist.destroy_process_group()

    # the record: GPT-2 small's 148 float32 gradients
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    shapes += [(768,), (768,)]
    params = grads_of(torch.float32, cuda, 4, shapes)
    values = sum(q.numel() for q in params)
    big = torch.empty(values, device=cuda)
    copy_s = _best(lambda: big.clone())
    bandwidth = 2 * 4 * values / copy_s  # a copy reads and writes every byte once
    print(f"  device bandwidth (a clone of {values} float32): {bandwidth / 1e9:.0f} GB/s")
    for name, fn, passes in (
        ("torch clip, active", lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3), 3),
        ("gclip clip, active", lambda: gt.clip_grad_norm_(params, 1e-3, comm=one), 3),
        ("torch norm alone", lambda: torch.nn.utils.get_total_norm([q.grad for q in params]), 1),
        ("gclip norm alone", lambda: gt.get_total_norm([q.grad for q in params], comm=one), 1),
    ):
        best = _best(fn)
        rate = passes * 4 * values / best  # the norm reads once; the scale reads and writes once more
        print(f"  {name}: {best * 1e3:.3f} ms, {rate / 1e9:.0f} GB/s ({rate / bandwidth:.0%} of a clone's)")
    for name, fn in (
        ("torch.nn.utils.clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
        ("gclip.torch.clip_grad_norm_", lambda: gt.clip_grad_norm_(params, 1e9, comm=one)),
    ):
        fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        print(f"  {name}: {best * 1e3:.2f} ms ({len(shapes)} float32 tensors, GPT-2 small)")
    failed = results.count(False)
    print(f"torch_cuda_check: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _best(fn, repeat: int = 20) -> float:
    """Best of ``repeat`` timed runs after a warm one, each ending in a device sync."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
