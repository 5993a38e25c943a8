"""The distributed clip on real ranks (pytest-mpi): run under mpirun -n 1, 2, 3 and 4.

Each test computes its results, then all ranks agree on the verdict (allgather)
before asserting, so a failure is seen by every rank at once and no rank is
left waiting in a collective (conftest.py also aborts the job on a failure).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gclip
import seed_oracle
from gclip.contract import rounded, seed_checks

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def agree(comm, ok: bool, detail: str = "") -> None:
    """Assert on every rank that every rank's ``ok`` holds."""
    verdicts = comm.allgather((bool(ok), detail))
    bad = [f"rank {r}: {d}" for r, (good, d) in enumerate(verdicts) if not good]
    assert not bad, "; ".join(bad)


def gather_clipped(comm, result) -> list:
    return comm.allgather(rounded(result.grads))


def random_layout(rng, size: int, n: int):
    """A global vector cut into ``size`` contiguous shards, some possibly empty."""
    values = rng.normal(size=n) * rng.choice([1e-3, 1.0, 1e3])
    cuts = np.sort(rng.integers(0, n + 1, size=size - 1))
    bounds = [0, *cuts.tolist(), n]
    return values, [values[bounds[i] : bounds[i + 1]] for i in range(size)]


@pytest.mark.parametrize("n", range(1, 6))
def test_seed_checks_on_real_ranks(comm, n):
    checks = [c for c in seed_checks(n) if len(c.shards) == comm.size]
    for check in checks:
        mine = np.asarray(check.shards[comm.rank], dtype=float)
        got = gather_clipped(comm, gclip.clip_by_global_norm(mine, check.limit))
        agree(comm, got == check.expected, f"{check.label}: {got} != {check.expected}")


@pytest.mark.parametrize("n", range(1, 6))
@pytest.mark.parametrize(("mode", "implementation"), [("per-rank", "broken"), ("rms", "attempt")])
def test_faulty_modes_reproduce_the_seed_on_real_ranks(comm, n, mode, implementation):
    recorded = dict((label, actual) for label, actual, _ in seed_oracle.observations(implementation, n))
    for check in seed_checks(n):
        if len(check.shards) != comm.size:
            continue
        mine = np.asarray(check.shards[comm.rank], dtype=float)
        got = gather_clipped(comm, gclip.clip_by_global_norm(mine, check.limit, mode=mode))
        agree(comm, got == recorded[check.label], f"{check.label}: {got} != {recorded[check.label]}")


@pytest.mark.parametrize("trial", range(30))
def test_random_layouts_equal_the_contract(comm, trial):
    rng = np.random.default_rng(1000 + trial)  # same stream on every rank
    values, shards = random_layout(rng, comm.size, int(rng.integers(0, 50)))
    limit = float(rng.choice([0.0, 0.5, 10.0, 1e4]))
    exact = gclip.clip_by_global_norm(shards[comm.rank], limit, reproducible=True)
    got = gather_clipped(comm, exact)
    expected = gclip.clip_shards([s.tolist() for s in shards], limit)
    agree(comm, got == expected, f"reproducible {got} != contract {expected}")

    fast = gclip.clip_by_global_norm(shards[comm.rank], limit)
    scales = comm.allgather(fast.scale.hex())
    norm = float(np.linalg.norm(values)) if values.size else 0.0
    agree(comm, len(set(scales)) == 1, f"ranks got different scales {scales}")
    agree(comm, math.isclose(fast.total_norm, norm, rel_tol=1e-13), f"{fast.total_norm} vs {norm}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reproducible_bits_are_the_single_process_bits(comm, dtype):
    """The same global vector on 1, 2, 3 or 4 ranks: the norm has the very same bits."""
    rng = np.random.default_rng(7)
    values, shards = random_layout(rng, comm.size, 5000)
    values = values.astype(dtype)
    shards = [s.astype(dtype) for s in shards]
    whole = gclip.clip_simulated([values], 1.0, reproducible=True)[0].total_norm
    got = gclip.global_norm(shards[comm.rank], reproducible=True)
    agree(comm, got.hex() == whole.hex(), f"{got.hex()} != {whole.hex()}")
    # a second, different cut of the same vector into lists of arrays
    pieces = np.array_split(values, 3 * comm.size)
    mine = pieces[comm.rank :: comm.size][::-1]
    got2 = gclip.global_norm(mine, reproducible=True)
    agree(comm, got2.hex() == whole.hex(), f"{got2.hex()} != {whole.hex()}")


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_matches_torch_clip_grad_norm(comm, norm_type):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    shapes = [(3, 5), (7,), (2, 2, 2), (0,), (11,)]
    whole = [rng.normal(size=s) for s in shapes]
    # each tensor split along its first axis over the ranks: this rank's slices
    mine = [np.array_split(t, comm.size)[comm.rank] if t.ndim else t for t in whole]
    # torch cannot take the inf-norm of an empty tensor (no identity for max): leave it out there
    kept = [i for i, t in enumerate(whole) if t.size or not math.isinf(norm_type)]
    tensors = [torch.from_numpy(whole[i].copy()) for i in kept]
    for t in tensors:
        t.grad = t.clone()
    ref = float(torch.nn.utils.clip_grad_norm_(tensors, 0.5, norm_type=norm_type))
    result = gclip.clip_by_global_norm(mine, 0.5, norm_type=norm_type, mode="epsilon")
    agree(comm, math.isclose(result.total_norm, ref, rel_tol=1e-12), f"{result.total_norm} vs {ref}")
    expected = [np.array_split(t.grad.numpy(), comm.size)[comm.rank] for t in tensors]
    got = [result.grads[i] for i in kept]
    close = all(np.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(got, expected))
    agree(comm, close, "clipped values differ from torch's")


def test_replicated_tensors_count_once(comm):
    rng = np.random.default_rng(3)
    shards = [rng.normal(size=10) for _ in range(comm.size)]
    bias = rng.normal(size=4)  # replicated on every rank
    right = math.sqrt(sum(float(s @ s) for s in shards) + float(bias @ bias))
    double = math.sqrt(sum(float(s @ s) for s in shards) + comm.size * float(bias @ bias))
    mine = [shards[comm.rank], bias.copy()]
    got = gclip.global_norm(mine, replicated=[False, True])
    bug = gclip.global_norm(mine, replicated=[False, True], mode="double-count")
    agree(comm, math.isclose(got, right, rel_tol=1e-13), f"{got} vs {right}")
    agree(comm, math.isclose(bug, double, rel_tol=1e-13), f"double-count {bug} vs {double}")
    if comm.size > 1:
        agree(comm, bug > got, "double counting should inflate the norm")


@pytest.mark.mpi(min_size=4)
def test_hsdp_layout_shards_over_one_comm_replicas_over_another(comm):
    """4 ranks = 2 replica groups x 2 shards. The norm is reduced over the shard comm only."""
    if comm.size % 2:
        pytest.skip("needs an even number of ranks")
    shard_comm = comm.Split(color=comm.rank // 2, key=comm.rank)  # {0,1}, {2,3}
    rng = np.random.default_rng(5)
    full = rng.normal(size=40)  # every replica group holds the same full gradient
    mine = np.array_split(full, shard_comm.size)[shard_comm.rank]
    right = gclip.global_norm(mine, comm=shard_comm)
    wrong = gclip.global_norm(mine, comm=comm)  # summed over replicas too: counted twice
    ref = float(np.linalg.norm(full))
    agree(comm, math.isclose(right, ref, rel_tol=1e-13), f"{right} vs {ref}")
    agree(comm, math.isclose(wrong, ref * math.sqrt(comm.size // 2), rel_tol=1e-13), f"{wrong}")
    shard_comm.Free()


def test_errors_are_raised_on_every_rank(comm):
    bad_rank = comm.size - 1
    x = np.ones(3)
    limit = -1.0 if comm.rank == bad_rank else 1.0
    with pytest.raises(gclip.GclipValueError) as info:
        gclip.clip_by_global_norm(x, limit)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1 and f"rank {bad_rank}" in messages[0], str(messages))
    # and the communicator is still fine
    ok = gclip.clip_by_global_norm(x, 1.0)
    agree(comm, math.isclose(ok.total_norm, math.sqrt(3 * comm.size)), str(ok.total_norm))


def test_inplace_on_torch_tensors_without_copies(comm):
    torch = pytest.importorskip("torch")
    t = torch.full((5,), 2.0, dtype=torch.float32)
    ptr = t.data_ptr()
    result = gclip.clip_by_global_norm(t, 1.0, inplace=True)
    norm = math.sqrt(20 * comm.size)
    agree(comm, result.grads is t and t.data_ptr() == ptr, "not the same tensor")
    agree(comm, math.isclose(float(t[0]), 2.0 / norm, rel_tol=1e-6), f"{float(t[0])}")
