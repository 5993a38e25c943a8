"""3-D layouts on 8 real ranks: mpiexec -n 8 python layouts_8.py (run by test_layout.py).

For the layouts (pp, dp, tp) = (1,8,1), (2,2,2), (2,1,4), (1,2,4), (2,4,1) of one
model, and three MoE layouts of the model with experts: the norm equals the
oracle (every rank's pieces gathered, one per tensor shard, math.fsum) within
1e-12, reproducible=True gives identical bits across the layouts, every array
is scaled exactly once, and every rank agrees. Then: a diverged replica is
named by check_replicas on every rank, and a bad mesh is refused on every rank.
Any failure aborts the job (nobody waits).
"""

from __future__ import annotations

import math
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gclip
import layout_oracle
from gclip import Mesh
from gclip._lab import transformer

DENSE = [
    dict(pp=1, dp=8, tp=1),
    dict(pp=2, dp=2, tp=2),
    dict(pp=2, dp=1, tp=4),
    dict(pp=1, dp=2, tp=4),
    dict(pp=2, dp=4, tp=1),
]
MOE = [dict(pp=2, dp=2, ep=2), dict(dp=2, ep=2, tp=2), dict(ep=4, tp=2)]

comm = MPI.COMM_WORLD


def agree(ok: bool, what: str) -> None:
    verdicts = comm.allgather((bool(ok), what))
    bad = [f"rank {r}: {w}" for r, (good, w) in enumerate(verdicts) if not good]
    if bad:
        raise AssertionError("; ".join(bad))


def one_layout(axes: dict) -> str:
    mesh = Mesh(comm, **axes)
    arrays, entries, _, pieces = transformer.clip_arguments(mesh)
    everyone = [p for mine in comm.allgather([p._replace(replicated=None) for p in pieces]) for p in mine]
    ref = layout_oracle.norm(everyone)
    got = gclip.global_norm(arrays, replicated=entries)
    agree(math.isclose(got, ref, rel_tol=1e-12), f"{axes}: {got!r} vs oracle {ref!r}")
    exact = gclip.global_norm(arrays, replicated=entries, reproducible=True)
    agree(len(set(comm.allgather(exact.hex()))) == 1, f"{axes}: ranks disagree on the bits")
    before = [np.array(p.array) for p in pieces]
    result = gclip.clip_by_global_norm(arrays, 0.5, replicated=entries, inplace=True)
    once = all(np.array_equal(p.array, old * result.scale) for p, old in zip(pieces, before))
    agree(once and result.scale < 1, f"{axes}: an array was not scaled exactly once")
    agree(len(set(comm.allgather(result.scale.hex()))) == 1, f"{axes}: ranks used different scales")
    mesh.free()
    return exact.hex()


def main() -> None:
    dense = {one_layout(axes) for axes in DENSE}
    agree(len(dense) == 1, f"reproducible bits differ across the dense layouts: {dense}")
    moe = {one_layout(axes) for axes in MOE}
    agree(len(moe) == 1, f"reproducible bits differ across the MoE layouts: {moe}")

    # a replica that drifted: rank 6's copy of a layer norm (held by ranks 4..7 under pp=2,dp=2,tp=2)
    mesh = Mesh(comm, pp=2, dp=2, tp=2)
    arrays, entries, names, _ = transformer.clip_arguments(mesh)
    gclip.check_replicas(arrays, replicated=entries, names=names)  # all copies agree
    if comm.rank == 6:
        target = next(i for i, n in enumerate(names) if n.endswith(".ln2"))
        arrays[target][3] += 1e-9
    try:
        gclip.check_replicas(arrays, replicated=entries, names=names)
        message = "no error"
    except gclip.GclipValueError as exc:
        message = str(exc)
    every = comm.allgather(message)
    agree(
        len(set(every)) == 1 and "rank 6 hold other values than rank 4" in message, f"check_replicas: {every}"
    )
    mesh.free()

    # a bad mesh: the same one-line error on every rank
    try:
        Mesh(comm, pp=2, dp=3, tp=2)
        message = "no error"
    except gclip.GclipValueError as exc:
        message = str(exc)
    every = comm.allgather(message)
    agree(len(set(every)) == 1 and "but the world has 8" in message, f"bad mesh: {every}")

    if comm.rank == 0:
        print(
            f"ok: {len(DENSE)} dense layouts and {len(MOE)} MoE layouts, one norm each; bits {dense.pop()}",
            flush=True,
        )


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - one rank's failure ends the job
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
