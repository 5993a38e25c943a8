"""A small model trained with sharded parameters and global-norm clipping.

usage:: mpirun -n R python -m gclip.train [--steps 200] [--seed 0] [--lr 1.0] [--max-norm 0.05]
            [--buggy [NAME]] [--reproducible] [--json] [--plot FILE.png]
         python -m gclip.train --ranks R ...   (R simulated ranks in one process, no MPI)

A 2-layer MLP (2 -> 16 tanh -> 3 softmax) learns a synthetic 3-class spiral,
numpy only. Its weights live as one flat vector split into R contiguous
slices, one per rank, as in ZeRO-3 or FSDP: each step gathers the vector
(``Allgatherv``, a pure copy), computes the loss and the gradient, and each
rank keeps the gradient of its own slice. The output bias is replicated on
every rank, as biases are under tensor parallelism, and counts once in the
norm. The gradient slices are then clipped by ``gclip.clip_by_global_norm``
(active on most early steps) and each rank updates its slice.

With ``--reproducible`` every number that crosses ranks is either a copy or
an exact (integer) sum, so the loss trajectory has the same bits for any R.
``--buggy NAME`` clips with a gallery bug instead (alone: ``per-rank``, the
bug of the incident report this project grew from) and also trains the
correct run, to show where the two part. ``--ranks R`` trains on R simulated
ranks in this one process (``gclip.clip_simulated``, the same engine; under
``--reproducible`` the same losses as R real ranks).

The report names every norm for what it is: the norm the clip used (per rank:
a per-rank bug gives each rank its own), the true global norm of the
gradient, the norm of the update applied, how many ranks scaled down, and how
many steps went above ``max_norm``. When a bug ends at a lower loss it says
why: it took larger steps than the limit allows, a different experiment.

The parts: ``model`` (the MLP and its data), ``loop`` (training on the
ranks), ``report`` (text and JSON), ``figure`` (``--plot``), ``command``
(the entry point). The p-norm and the cosine are the lab's
(``gclip._lab.vectors``): a cosine is undefined (None; null in the JSON)
for a zero or non-finite vector.

"""

from .._lab.vectors import cosine, vector_norm
from .command import main
from .loop import Config, Run, train, train_simulated
from .model import Model, init_params, loss_and_grad, make_data, shard_bounds

__all__ = [
    "Config",
    "Model",
    "Run",
    "cosine",
    "init_params",
    "loss_and_grad",
    "main",
    "make_data",
    "shard_bounds",
    "train",
    "train_simulated",
    "vector_norm",
]
