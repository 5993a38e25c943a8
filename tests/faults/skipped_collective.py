"""A job that hangs: one rank skips a collective the others wait in.

usage:: mpiexec -n N python skipped_collective.py [--skipper R]

Every rank clips once; then rank R skips the second clip (the classic early
``return`` on one rank) and goes on to finish, while the others wait in that
clip's all-reduce for a contribution that never comes. Nothing inside the job
can notice: only a watchdog outside it (``MPIEXEC_TIMEOUT``, or ``timeout``
around mpirun) ends it. Rank 0 first prints every rank's pid (``pids: 0=...
1=...``) so that a test can check no rank outlives the job. With
``--skipper -1`` nobody skips and rank 0 prints ``finished``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

import gclip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skipper", type=int, default=1, help="the rank that skips (-1: none)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    pids = comm.gather(os.getpid())
    if comm.rank == 0:
        print("pids: " + " ".join(f"{r}={pid}" for r, pid in enumerate(pids)), flush=True)
    grads = np.full(10, comm.rank + 1.0)
    gclip.clip_by_global_norm(grads, 1.0, comm=comm)
    if comm.rank != args.skipper:
        gclip.clip_by_global_norm(grads, 1.0, comm=comm)
    if comm.rank == 0:
        print("finished", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
