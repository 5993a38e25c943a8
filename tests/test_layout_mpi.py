"""Parallel layouts on real ranks (pytest-mpi, 1..4 ranks): 2-D meshes of the world.

Every factorisation of the world into two of the axes pp, dp, tp, ep is a
layout of the same model; each must give the oracle's norm (every rank's
pieces gathered, one per tensor shard, math.fsum) and, reproducibly, the same
bits as every other layout. The oracle never reads the groups given to gclip.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import gclip
import layout_oracle
from conftest import agree
from gclip import Mesh
from gclip._lab import transformer

pytestmark = pytest.mark.mpi


def layouts(size: int, moe: bool) -> list[dict]:
    """Every (axis a = x, axis b = y) with x * y = size the model splits evenly."""
    axes = ("pp", "dp", "tp", "ep") if moe else ("pp", "dp", "tp")
    out = []
    for a, b in itertools.combinations(axes, 2):
        if moe and "ep" not in (a, b):
            continue
        for x in range(1, size + 1):
            if size % x == 0:
                out.append({a: x, b: size // x})
    return out


def gathered_pieces(comm, pieces):
    return [p for mine in comm.allgather([p._replace(replicated=None) for p in pieces]) for p in mine]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_every_2d_layout_gives_the_oracle_norm_and_the_same_bits(comm, moe):
    bits = set()
    tried = layouts(comm.size, moe)
    assert len(tried) >= 2
    for axes in tried:
        mesh = Mesh(comm, **axes)
        arrays, entries, _, pieces = transformer.clip_arguments(mesh)
        ref = layout_oracle.norm(gathered_pieces(comm, pieces))
        got = gclip.global_norm(arrays, replicated=entries)
        agree(comm, math.isclose(got, ref, rel_tol=1e-12), f"{axes}: {got!r} vs {ref!r}")
        exact = gclip.global_norm(arrays, replicated=entries, reproducible=True)
        bits.add(exact.hex())
        agree(comm, math.isclose(exact, ref, rel_tol=2.3e-16), f"{axes}: reproducible {exact!r} vs {ref!r}")
        mesh.free()
    every = comm.allgather(sorted(bits))
    agree(comm, len(bits) == 1 and all(b == every[0] for b in every), f"bits differ: {every}")


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_p_norms_and_in_place_scaling_on_a_layout(comm, norm_type):
    axes = {"dp": comm.size, "tp": 1} if comm.size % 2 else {"dp": comm.size // 2, "tp": 2}
    mesh = Mesh(comm, **axes)
    arrays, entries, _, pieces = transformer.clip_arguments(mesh)
    ref = layout_oracle.norm(gathered_pieces(comm, pieces), norm_type)
    before = [np.array(p.array) for p in pieces]
    result = gclip.clip_by_global_norm(arrays, 0.01, norm_type=norm_type, replicated=entries, inplace=True)
    agree(comm, math.isclose(result.total_norm, ref, rel_tol=1e-12), f"{result.total_norm} vs {ref}")
    once = all(np.array_equal(p.array, old * result.scale) for p, old in zip(pieces, before))
    agree(comm, once, "an array was not scaled exactly once")
    mesh.free()


def test_a_rank_that_declares_differently_raises_the_same_error_everywhere(comm):
    if comm.size == 1:
        # one rank is its own group: a declaration cannot disagree with itself
        got = gclip.global_norm([np.ones(3)], replicated=[comm])
        agree(comm, got == math.sqrt(3), str(got))
        return
    odd = comm.size - 1
    copy = np.ones(4 if comm.rank != odd else 5)  # the last rank holds a different "copy"
    before = copy.copy()
    with pytest.raises(gclip.GclipValueError) as info:
        gclip.clip_by_global_norm([np.ones(2), copy], 0.1, replicated=[False, True], inplace=True)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1, str(messages))
    agree(comm, f"rank {odd} declare 1 array ([5] float64)" in messages[0], messages[0])
    agree(comm, np.array_equal(copy, before), "the arrays changed after an agreed error")


def test_check_replicas_names_the_replica_that_drifted(comm):
    mesh = Mesh(comm, dp=comm.size)
    arrays, entries, names, _ = transformer.clip_arguments(mesh)
    gclip.check_replicas(arrays, replicated=entries, names=names)  # copies agree: no error
    if comm.size == 1:
        mesh.free()
        return
    drifted = comm.size - 1
    if comm.rank == drifted:
        arrays[1][0] = np.nextafter(arrays[1][0], np.inf)  # one ulp
    with pytest.raises(gclip.GclipValueError) as info:
        gclip.check_replicas(arrays, replicated=entries, names=names)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1, str(messages))
    agree(
        comm,
        f"rank {drifted} hold other values than rank 0" in messages[0] and names[1] in messages[0],
        messages[0],
    )
    mesh.free()


def test_a_bad_mesh_is_the_same_error_on_every_rank(comm):
    with pytest.raises(gclip.GclipValueError) as info:
        Mesh(comm, dp=comm.size + 1)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1 and f"the world has {comm.size}" in messages[0], str(messages))


def test_ranks_that_ask_for_different_meshes_get_the_same_error(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    axes = {"dp": comm.size} if comm.rank else {"pp": comm.size}
    with pytest.raises(gclip.GclipValueError) as info:
        Mesh(comm, **axes)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1, str(messages))
    agree(comm, f"rank 0: pp={comm.size}" in messages[0] and f"dp={comm.size}" in messages[0], messages[0])


def tied_first_and_last(comm):
    """A tensor tied between rank 0 and the last rank, named and placed differently on each:
    (arrays, entries, names) for this rank, and the group (None elsewhere)."""
    last = comm.size - 1
    tied = comm.Split(0 if comm.rank in (0, last) else 1, comm.rank)
    embed = np.linspace(-1.0, 2.0, 6)
    own = np.full(3, float(comm.rank + 1))
    if comm.rank == 0:
        return [embed.copy(), own], [tied, False], ["embed", "w0"], tied
    if comm.rank == last:
        return [own, embed.copy()], [False, tied], [f"w{last}", "head"], tied
    return [own], [False], [f"w{comm.rank}"], tied


def test_a_tied_copy_is_matched_by_its_place_in_the_group_not_its_name(comm):
    if comm.size == 1:
        pytest.skip("a tie needs two ranks")
    arrays, entries, names, tied = tied_first_and_last(comm)
    gclip.check_replicas(arrays, replicated=entries, names=names)  # the copies agree
    rows = gclip.explain(arrays, replicated=entries, names=names)
    powers = [float(np.dot(a, a)) for a in arrays]  # the oracle: each rank's own, the tie once
    every = comm.allgather(powers)
    total = math.fsum(x for r, mine in enumerate(every) for x in (mine if r == 0 else mine[:1]))
    agree(comm, len(rows) == comm.size + 1, f"{len(rows)} rows: {rows}")
    tie = [r for r in rows if len(r.ranks) == 2]
    agree(comm, len(tie) == 1 and tie[0].name == "embed / head" and tie[0].counted_on == 0, str(tie))
    agree(comm, math.isclose(math.fsum(r.power for r in rows), total, rel_tol=1e-12), str(rows))
    if comm.rank == comm.size - 1:
        arrays[1][2] *= 1.5  # the head drifts from the embedding
    with pytest.raises(gclip.GclipValueError) as info:
        gclip.check_replicas(arrays, replicated=entries, names=names)
    messages = comm.allgather(str(info.value))
    agree(comm, len(set(messages)) == 1, str(messages))
    agree(comm, f"'embed / head' differ: rank {comm.size - 1}" in messages[0], messages[0])
    tied.Free()


def test_explain_gives_every_rank_the_same_table(comm):
    mesh = Mesh(comm, dp=1, tp=comm.size) if comm.size in (1, 2, 4) else Mesh(comm, pp=comm.size)
    arrays, entries, names, pieces = transformer.clip_arguments(mesh)
    rows = gclip.explain(arrays, replicated=entries, names=names)
    every = comm.allgather([tuple(r) for r in rows])
    agree(comm, all(e == every[0] for e in every), "ranks got different tables")
    unique = layout_oracle.unique_pieces(gathered_pieces(comm, pieces))
    agree(comm, len(rows) == len(unique), f"{len(rows)} rows for {len(unique)} tensor shards")
    agree(comm, math.isclose(math.fsum(r.share for r in rows), 1.0, rel_tol=1e-12), "shares do not add to 1")
    mesh.free()
