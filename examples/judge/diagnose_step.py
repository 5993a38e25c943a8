"""Diagnose the clip of a real training step: gradients before and after, on every rank.

    mpirun -n 3 python examples/judge/diagnose_step.py            # a per-rank clip: named
    mpirun -n 3 python examples/judge/diagnose_step.py --correct  # the global clip: correct

A small linear model is sharded over the ranks (each holds a slice of the
weights); the training step below clips as much hand-written code does: by
the norm of the gradient this rank holds. gclip.testing.diagnose is called on
the gradients before and after that clip, without changing the training code.
"""

import sys

import numpy as np
from mpi4py import MPI

import gclip
from gclip.testing import diagnose

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
rng = np.random.default_rng(0)
features, per_rank = 64, 20
x = rng.standard_normal((256, per_rank * size))
y = x @ rng.standard_normal(per_rank * size)
mine = slice(rank * per_rank, (rank + 1) * per_rank)
w = np.zeros(per_rank)  # this rank's slice of the weights
max_norm = 1.0


def gradient(w):
    partial = x[:, mine] @ w
    prediction = comm.allreduce(partial)  # the model's output needs every slice
    return x[:, mine].T @ (prediction - y) / len(y)


for step in range(3):
    grads = [gradient(w)]
    before = [g.copy() for g in grads]
    if "--correct" in sys.argv:
        gclip.clip_by_global_norm(grads, max_norm, comm=comm, inplace=True)
    else:  # the bug: this rank's own norm
        norm = float(np.linalg.norm(grads[0]))
        grads[0] *= min(1.0, max_norm / norm) if norm > 0 else 1.0
    if step == 0:
        report = diagnose(before, grads, max_norm, comm=comm)
        if rank == 0:
            print(report, flush=True)
    w -= 0.1 * grads[0]
