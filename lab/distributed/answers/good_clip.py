"""The answer to the distributed exercise 4: lab/distributed/my_clip.py, fixed.

    python -m gclip.conformance lab/distributed/answers/good_clip.py:clip --ranks 4

1. local: this rank's sum of squares, one number; 2. one all-reduce (SUM) gives
every rank the total; 3. every rank takes the root and applies the same scale.
"""

import numpy as np
from mpi4py import MPI


def clip(grads, max_norm, comm):
    local = float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))  # 1. local
    norm = comm.allreduce(local, op=MPI.SUM) ** 0.5  # 2. all-reduce, then the root
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0  # 3. the same scale on every rank
    return [g * scale for g in grads]
