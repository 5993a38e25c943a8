"""Exercise 4, distributed: fix this clip until the judge passes it on real ranks.

Run the judge from the repository's folder (it starts its own MPI job of 4 ranks):

    python -m gclip.conformance lab/distributed/my_clip.py:clip --ranks 4

Each rank calls ``clip(grads, max_norm, comm)`` with ITS OWN part of the
gradient: ``grads`` is a list of numpy arrays, ``comm`` an mpi4py
communicator. Return the clipped arrays (or scale them in place and return
None): every value multiplied by min(1, max_norm / norm), where norm is the L2
norm of the WHOLE gradient, every rank's arrays together (a zero norm: scale 1).

This version is the code of the incident report the lab starts from: each rank
clips what it holds. Fix it with one collective call of comm.
"""

import numpy as np


def clip(grads, max_norm, comm):
    norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads)))
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [g * scale for g in grads]
