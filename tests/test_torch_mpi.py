"""gclip.torch on real ranks (pytest-mpi, 1..4 ranks): over an mpi4py communicator
and over a gloo process group started inside the same mpirun job.

    mpirun -n N python -m pytest --with-mpi -m mpi tests/test_torch_mpi.py

Every rank holds shards of its own (one per dtype), a bias held by every rank
and a weight held by its pair of ranks. The oracle gathers every rank's
gradients as float64 arrays, keeps each held copy once and adds the squares
with math.fsum; torch's own clip on the gathered model is a second oracle.
Verdicts are agreed (allgather) before asserting, so every rank fails together.
"""

from __future__ import annotations

import datetime
import math
import socket
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import torch.distributed as dist  # noqa: E402

import gclip  # noqa: E402
import gclip.torch as gt  # noqa: E402
from conftest import OneRankComm, agree  # noqa: E402
from torch_oracle import DTYPES, float64, fsum_norm, scaled_once  # noqa: E402

pytestmark = pytest.mark.mpi


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World(NamedTuple):
    kind: str  # "mpi" or "gloo"
    comm: Any  # what gclip.torch is given
    pair: Any  # the group of this rank's pair (ranks 2k, 2k+1), of the same kind


@pytest.fixture(scope="module")
def mpi_world(comm):
    pair = comm.Split(comm.rank // 2, comm.rank)
    yield World("mpi", comm, pair)
    pair.Free()


@pytest.fixture(scope="module")
def gloo_world(comm):
    """The default torch.distributed group (gloo) over the mpirun job's ranks."""
    assert not dist.is_initialized()
    port = comm.bcast(free_port() if comm.rank == 0 else None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.size,
        timeout=datetime.timedelta(seconds=120),
    )
    pairs = [dist.new_group(list(range(k, min(k + 2, comm.size)))) for k in range(0, comm.size, 2)]
    yield World("gloo", dist.group.WORLD, pairs[comm.rank // 2])
    dist.destroy_process_group()


@pytest.fixture(params=["mpi", "gloo"])
def world(request):
    return request.getfixturevalue(f"{request.param}_world")


# ---------------------------------------------------------------------------
# what each rank holds, and the oracle


def param(shape, dtype, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return p


class Held(NamedTuple):
    shards: list  # this rank's own
    bias: Any  # the same on every rank
    pair: Any  # the same on both ranks of a pair

    def parameters(self) -> list:
        return [*self.shards, self.bias, self.pair]

    def entries(self, world: World) -> list:
        return [False] * len(self.shards) + [True, world.pair]


def held(rank: int, dtypes=DTYPES, scale: float = 1.0, copies=(torch.float32, torch.bfloat16)) -> Held:
    """Shards whose sizes differ from rank to rank (rank 0's first one is empty), and the
    copies: the bias and the pair's weight (of the dtypes ``copies``)."""
    bias_dtype, pair_dtype = (copies, copies) if isinstance(copies, torch.dtype) else copies
    shards = [param((rank + i, 5 - i), dtype, 1000 * rank + i, scale) for i, dtype in enumerate(dtypes)]
    bias = param((6,), bias_dtype, 7, scale)
    return Held(shards, bias, param((4, 3), pair_dtype, 100 + rank // 2, scale))


def gathered(comm, mine: Held) -> list:
    """Every value of the whole model once, as float64 arrays: every rank's shards,
    the bias once, each pair's weight once."""
    report = (
        [float64(p.grad) for p in mine.shards],
        float64(mine.bias.grad),
        comm.rank % 2,
        float64(mine.pair.grad),
    )
    everything = comm.allgather(report)
    arrays = [a for shards, _, _, _ in everything for a in shards]
    arrays.append(everything[0][1])
    arrays += [pair for _, _, position, pair in everything if position == 0]
    return arrays


# ---------------------------------------------------------------------------
# the norm and the scale


@pytest.mark.parametrize("given", ["list", "generator"])
def test_clip_is_the_gathered_fsum_and_scales_every_grad_once(comm, world, given):
    mine = held(comm.rank)
    nothing = torch.nn.Parameter(torch.zeros(3))  # no gradient: skipped
    params = [*mine.parameters(), nothing, mine.shards[1]]  # and a shard listed twice
    entries = [*mine.entries(world), False, False]
    before = {id(p): float64(p.grad) for p in mine.parameters()}
    exact = fsum_norm(gathered(comm, mine))
    limit = 0.4 * exact
    arg = params if given == "list" else (p for p in params)
    got = gt.clip_grad_norm_(arg, limit, comm=world.comm, replicated=entries)
    ok = (
        isinstance(got, torch.Tensor)
        and got.dtype == torch.float64
        and abs(got.item() - exact) <= 1e-12 * exact
    )
    agree(comm, ok, f"{world.kind}: {got!r} vs {exact!r}")
    for p in mine.parameters():
        ok, detail = scaled_once(before[id(p)], p.grad, limit / got.item())
        agree(comm, ok and p.grad.dtype == p.dtype, f"{world.kind}: {detail}")
    agree(comm, nothing.grad is None)


def test_torchs_own_clip_on_the_gathered_model_is_a_second_oracle(comm, world):
    mine = held(comm.rank, [torch.float64] * 3, 10.0, copies=torch.float64)
    whole = [torch.nn.Parameter(torch.zeros(a.shape, dtype=torch.float64)) for a in gathered(comm, mine)]
    for p, a in zip(whole, gathered(comm, mine)):
        p.grad = torch.from_numpy(a)
    theirs = torch.nn.utils.clip_grad_norm_(whole, 1.0).item()
    ours = gt.clip_grad_norm_(mine.parameters(), 1.0, comm=world.comm, replicated=mine.entries(world)).item()
    agree(comm, abs(ours - theirs) <= 1e-12 * theirs, f"{ours!r} vs torch's {theirs!r}")
    # torch scales by max_norm / (norm + 1e-6), gclip by exactly max_norm / norm
    factor = (theirs + 1e-6) / theirs
    pairs = zip(gathered(comm, mine), (float64(p.grad) * factor for p in whole))
    worst = max(float(abs(a - b).max() / abs(b).max()) for a, b in pairs if b.size)
    agree(comm, worst <= 1e-14, f"scaled grads differ from torch's by {worst!r} beyond the epsilon")


@pytest.mark.parametrize("p", [1.0, 3.0, math.inf])
def test_p_norms(comm, world, p):
    mine = held(comm.rank)
    exact = fsum_norm(gathered(comm, mine), p)
    got = gt.get_total_norm(
        [q.grad for q in mine.parameters()], p, comm=world.comm, replicated=mine.entries(world)
    )
    agree(comm, abs(got.item() - exact) <= 1e-12 * exact, f"{world.kind} p={p}: {got.item()!r} vs {exact!r}")


def test_reproducible_norm_has_the_bits_of_one_process(comm, world):
    mine = held(comm.rank, scale=1e3)
    one_process = gclip.global_norm(gathered(comm, mine), reproducible=True, comm=OneRankComm())
    grads = [q.grad for q in mine.parameters()]
    got = gt.get_total_norm(grads, comm=world.comm, replicated=mine.entries(world), reproducible=True).item()
    agree(comm, got == one_process, f"{world.kind}: {got.hex()} vs {one_process.hex()}")


def test_a_pair_group_as_comm(comm, gloo_world, mpi_world):
    """comm may be a subgroup: its ranks are translated to the group's own."""
    mine = held(comm.rank)
    pair_ranks = [r for r in range(comm.size) if r // 2 == comm.rank // 2]
    everything = comm.allgather([float64(p.grad) for p in mine.shards])
    exact = fsum_norm([a for r in pair_ranks for a in everything[r]] + [float64(mine.bias.grad)])
    for world in (mpi_world, gloo_world):
        grads = [*(p.grad for p in mine.shards), mine.bias.grad]
        got = gt.get_total_norm(grads, comm=world.pair, replicated=[False] * len(mine.shards) + [True])
        agree(comm, abs(got.item() - exact) <= 1e-12 * exact, f"{world.kind}: {got.item()!r} vs {exact!r}")


def test_comm_none_is_the_default_torch_group_once_initialised(comm, gloo_world):
    mine = held(comm.rank)
    exact = fsum_norm(gathered(comm, mine))
    got = gt.get_total_norm(
        [p.grad for p in mine.parameters()], replicated=[False] * 4 + [True, gloo_world.pair]
    )
    agree(comm, abs(got.item() - exact) <= 1e-12 * exact, f"{got.item()!r} vs {exact!r}")


# ---------------------------------------------------------------------------
# errors: the same one on every rank, none left waiting


def raised(call) -> tuple[str, str]:
    try:
        call()
    except gclip.GclipError as exc:
        return type(exc).__name__, str(exc)
    return "nothing", ""


BAD_INPUT = {
    "integer": ("GclipTypeError", "has dtype torch.int64"),
    "overlap": ("GclipValueError", "overlap in memory"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUT))
def test_bad_input_on_one_rank_is_the_same_error_on_every_rank(comm, world, bad):
    mine = held(comm.rank)
    grads = [p.grad for p in mine.parameters()]
    last = comm.size - 1
    if comm.rank == last and bad == "integer":
        grads[0] = torch.arange(3)
    if comm.rank == last and bad == "overlap":
        flat = torch.zeros(20)
        grads += [flat[:10], flat[5:15]]  # two gradients sharing part of their memory
    kind, message = raised(lambda: gt.get_total_norm(grads, comm=world.comm, replicated=False))
    every = comm.allgather((kind, message))
    expected_kind, words = BAD_INPUT[bad]
    same = all(e == every[0] for e in every)
    ok = same and kind == expected_kind and f"rank {last} of {comm.size}" in message and words in message
    agree(comm, ok, f"{world.kind}: {every}")


def test_a_nonfinite_gradient_raises_on_every_rank_when_asked(comm, world):
    mine = held(comm.rank)
    if comm.rank == comm.size - 1:
        mine.shards[2].grad.view(-1)[0] = math.inf
    kind, message = raised(
        lambda: gt.clip_grad_norm_(
            mine.parameters(), 1.0, error_if_nonfinite=True, comm=world.comm, replicated=mine.entries(world)
        )
    )
    ok = kind == "NonFiniteNormError" and f"non-finite values on rank {comm.size - 1}" in message
    agree(comm, ok, f"{world.kind}: {kind}: {message}")


def test_ranks_that_disagree_on_a_replicated_tensor_raise_together(comm, world):
    if comm.size < 2:
        pytest.skip("a disagreement needs two ranks")
    mine = held(comm.rank)
    if comm.rank == 1:
        mine = mine._replace(bias=param((5,), torch.float32, 7))  # rank 1's copy has another shape
    entries = mine.entries(world)
    kind, message = raised(
        lambda: gt.clip_grad_norm_(mine.parameters(), 1.0, comm=world.comm, replicated=entries)
    )
    ok = (
        kind == "GclipValueError"
        and "disagree on the copies they hold" in message
        and "[5] float32" in message
    )
    agree(comm, ok, f"{world.kind}: {kind}: {message}")


def test_core_api_refuses_a_torch_group_with_a_gclip_error(comm, gloo_world):
    kind, message = raised(lambda: gclip.global_norm([torch.ones(2).numpy()], comm=dist.group.WORLD))
    agree(comm, kind == "GclipTypeError" and "gclip.torch" in message, f"{kind}: {message}")


def test_plain_tensors_without_a_declaration_are_refused_on_every_rank(comm, world):
    """No default that would count every replica (DDP: sqrt(R) too large) or one rank's only."""
    mine = held(comm.rank)
    kind, message = raised(lambda: gt.clip_grad_norm_(mine.parameters(), 1.0, comm=world.comm))
    every = comm.allgather((kind, message))
    if comm.size == 1:
        agree(comm, kind == "nothing", f"{world.kind}: one rank needs no declaration: {every}")
        return
    ok = all(e == every[0] for e in every) and kind == "GclipValueError" and "replicated=" in message
    agree(comm, ok, f"{world.kind}: {every}")


def test_an_expanded_gradient_is_refused_before_the_header_on_every_rank(comm, world):
    """A stride-0 gradient (``expand``) cannot be scaled in place: torch refuses the multiply.
    Refused in the reading, it is one agreed error and no rank scales anything; found by
    torch's multiply instead, it was an error of that rank alone, after the all-reduce."""
    mine = held(comm.rank)
    last = comm.size - 1
    if comm.rank == last:
        grad = mine.shards[1].grad
        mine.shards[1].grad = torch.ones(1, dtype=grad.dtype).expand(*grad.shape)  # shape (rank + 1, 4)
    before = [p.grad.clone() for p in mine.parameters()]
    try:
        gt.clip_grad_norm_(mine.parameters(), 1e-3, comm=world.comm, replicated=mine.entries(world))
        kind, message = "nothing", ""
    except Exception as exc:  # noqa: BLE001 - torch's own error on one rank is the defect
        kind, message = type(exc).__name__, str(exc)
    every = comm.allgather((kind, message))
    ok = all(e == every[0] for e in every) and kind == "GclipValueError"
    ok = ok and f"rank {last} of {comm.size}" in message and "stride 0" in message
    untouched = all(torch.equal(p.grad, b) for p, b in zip(mine.parameters(), before))
    agree(comm, ok and untouched, f"{world.kind}: {every}; untouched: {untouched}")
