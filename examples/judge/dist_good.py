"""Correct distributed clips: every rank's sum of squares, one all-reduce, one scale.

python -m gclip.conformance examples/judge/dist_good.py:clip --ranks 3
python -m gclip.conformance examples/judge/dist_good.py:clip_buffer --ranks 3
"""

import numpy as np
from mpi4py import MPI


def _sum_of_squares(grads):
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))  # a float even for []


def clip(grads, max_norm, comm):
    """In place, with mpi4py's pickled allreduce (returns None)."""
    norm = comm.allreduce(_sum_of_squares(grads), op=MPI.SUM) ** 0.5
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g *= scale


def clip_buffer(grads, max_norm, comm):
    """Returning new arrays, with the buffer Allreduce."""
    total = np.zeros(1)
    comm.Allreduce(np.array([_sum_of_squares(grads)]), total, op=MPI.SUM)
    norm = float(np.sqrt(total[0]))
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [g * scale for g in grads]  # a Python float keeps float32 arrays float32
