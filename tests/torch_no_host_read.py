"""The sync-free path reads nothing on the host: run on FakeTensors over torch's fake
process group of 4 ranks (run by test_torch_device.py, in a process of its own).

    python tests/torch_no_host_read.py

Every aten op the clip dispatches is recorded by a dispatch mode that raises on
``aten._local_scalar_dense`` (``.item()``, ``float()``, ``bool()``, ``.tolist()``); FakeTensors
hold no values, so ``.numpy()`` or a copy to the host would raise as well. The path then
runs every op it runs on an accelerator; the verdict, read there at the next call, is never
read here. Prints one JSON line: the ops seen, the all_reduce calls, the norm's device.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import gclip.torch as gt
import gclip.torch._device as device_path


class NoHostRead(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(f"a host read: {func}")
        return func(*args, **(kwargs or {}))


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    device_path.FORCE = True  # the accelerator's path, on (fake) CPU tensors
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(n)) for n in (5, 300, 7)]
        params.append(torch.nn.Parameter(torch.empty(9, dtype=torch.bfloat16)))
        for p in params:
            p.grad = torch.empty_like(p)
        with NoHostRead() as seen:
            norm = gt.clip_grad_norm_(params, 1.0, replicated=False)
    dist.all_reduce = real
    out = {
        "ops": sorted(set(seen.ops)),
        "all_reduces": len(calls),
        "norm": [str(norm.device), str(norm.dtype)],
    }
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
