"""A broken layout clip: every copy counted (the replicated declaration ignored).

python -m gclip.conformance examples/judge/layout_all_copies.py:clip --layout pp=2,tp=2
"""

import numpy as np
from mpi4py import MPI


def clip(grads, max_norm, comm, mesh, replicated):
    local = float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))  # copies too
    norm = comm.allreduce(local, op=MPI.SUM) ** 0.5
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g *= scale
