"""A correct clip over a parallel layout: copies count once, on their group's first rank.

python -m gclip.conformance examples/judge/layout_good.py:clip --layout pp=2,tp=2
"""

import numpy as np
from mpi4py import MPI


def clip(grads, max_norm, comm, mesh, replicated):
    local = 0.0
    for g, copies in zip(grads, replicated):
        # False: a shard, counted here; a communicator: the ranks holding identical copies
        if copies is False or copies.Get_rank() == 0:
            local += float(np.sum(np.square(g, dtype=np.float64)))
    norm = comm.allreduce(local, op=MPI.SUM) ** 0.5
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g *= scale
