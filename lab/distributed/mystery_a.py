"""Distributed mystery A: what is wrong with this clip? Predict, then ask the judge:

    python -m gclip.conformance lab/distributed/mystery_a.py:clip --ranks 4
"""

import numpy as np
from mpi4py import MPI


def clip(grads, max_norm, comm):
    local = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads)))
    norm = comm.allreduce(local, op=MPI.SUM)  # one all-reduce, as the tutorial says
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [g * scale for g in grads]
