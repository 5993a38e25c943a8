"""gclip.torch.clip_step on 2+ real ranks (pytest-mpi): sharded parameters, fused AdamW, a GradScaler,
and an inf in one rank's shard. The global norm is inf on every rank, so every rank skips the step and
backs its loss scale off; the documented per-rank recipe (unscale_, clip, scaler.step) steps on the
ranks whose own shard is finite, which the test shows too (the case it guards against).

    timeout 300 mpirun -n 2 python -m pytest -q --with-mpi -m mpi tests/test_torch_fused_mpi.py
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip.torch as gt  # noqa: E402
from conftest import agree  # noqa: E402

pytestmark = pytest.mark.mpi


def shard_step(comm, folded: bool, inf: bool):
    """One AMP step on this rank's shard; returns (stepped, loss scale after update)."""
    gen = torch.Generator().manual_seed(10 + comm.rank)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (40, 8)]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for p in params:
        p.grad = scaler.scale(torch.randn(p.shape, generator=gen))
    if inf and comm.rank == comm.size - 1:
        params[0].grad[5] = math.inf
    before = [p.detach().clone() for p in params]
    if folded:
        gt.clip_step(opt, 1.0, scaler=scaler, comm=comm, replicated=False)
    else:
        scaler.unscale_(opt)
        gt.clip_grad_norm_(params, 1.0, comm=comm, replicated=False)
        scaler.step(opt)
    scaler.update()
    stepped = not all(torch.equal(a, p) for a, p in zip(before, params))
    return stepped, scaler.get_scale()


@pytest.mark.mpi(min_size=2)
def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(comm):
    stepped, scale = shard_step(comm, folded=True, inf=True)
    agree(comm, not stepped and scale == 2.0**7, f"stepped={stepped} scale={scale}")
    stepped, scale = shard_step(comm, folded=True, inf=False)
    agree(comm, stepped and scale == 2.0**8, f"finite: stepped={stepped} scale={scale}")
    # the per-rank recipe: the ranks with a finite shard step, the other skips
    stepped, _ = shard_step(comm, folded=False, inf=True)
    agree(comm, stepped is (comm.rank != comm.size - 1), f"per-rank recipe: stepped={stepped}")
