"""A clip that hangs the job: a rank with nothing to clip returns before the all-reduce.

python -m gclip.conformance examples/judge/dist_skip.py:clip --ranks 3 --timeout 2
"""

import numpy as np
from mpi4py import MPI


def clip(grads, max_norm, comm):
    if not grads:
        return None  # "nothing to do here"... but every other rank waits for this rank's share
    local = float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
    norm = comm.allreduce(local, op=MPI.SUM) ** 0.5
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g *= scale
