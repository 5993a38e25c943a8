"""The teaching demo: one gradient sharded over the MPI ranks, clipped by its global norm.

Each rank holds one shard of a gradient (seeded random values, of a different
magnitude on each rank, or ``--shards``), plus a small tensor replicated on every
rank, like a bias. Rank 0 prints the three phases of a correct clip, on every
rank: local (each rank's sum of squares) -> all-reduce (the global norm) ->
scale (the same factor everywhere). ``--buggy NAME`` runs a bug of the gallery
on the same data next to the correct clip and shows what it breaks.

usage:: mpirun -n 4 python -m gclip.demo [--buggy [NAME] | --mystery K] [--shards JSON]
                                         [--max-norm X] [--seed S] [--json [--values]]
                                         [--plot FILE.png] [--list-bugs]
         python -m gclip.demo --ranks 4 ...   (4 simulated ranks in one process, no MPI)

The default data makes every bug of the gallery visible on 4 ranks: the
ranks' shards differ by up to 8x in norm (so per-rank, rank-0, mean and max
norms all differ), the largest shard's sum of squares overflows float16,
every value is far above the default limit 1 (so the inf-norm bug shows too),
and the replicated bias (norm 50) is counted once. ``--seed 0`` gives the
tutorial's norms (100, 400, 50, 200); every other seed its own whole-number
norms, so each student of a lab gets their own numbers (any 67 consecutive
seeds have different global norms).

``--ranks R`` runs R simulated ranks in this one process with
``gclip.clip_simulated`` (the same engine; the all-reduce is a sum over a
list) and says so; under mpirun with several ranks it is refused. On one real
rank without ``--ranks`` the report says how to start more. ``--mystery K``
runs the K-th bug of the seed's own order of the mystery pool
(``options.mysteries``) under the name "mystery K": its name, summary and
incident are kept out of the text and the JSON. Mysteries 1 and 2 are the
seed's pair of distinct bugs: any 36 consecutive seeds get 36 different pairs,
consecutive seeds pairs with no bug in common.

``--layout AXES`` lays the lab's transformer out over the ranks (real, or
``--ranks R`` simulated: the same report); ``--model incidents`` gives it the
incidents' proportions; ``--mystery K --layout AXES`` is a layout mystery
(``options.layout_mysteries``), whose model values come from the seed.

``--json`` prints one JSON object on one line (rank 0). Non-finite floats are
written as the strings "inf", "-inf" and "nan" (strict JSON has no such
numbers; Python's ``float()`` reads them back). ``true_global_norm`` is the
norm of the input; ``norms_used`` and ``scales`` what each rank used (a bug's
run has no ``global_norm`` of its own: under most bugs rank 0's number is not
a global norm); ``same_on_all_ranks`` says whether every rank used the same,
and ``per_rank`` lists them all. ``values_per_rank`` counts each rank's
shard values (the bias apart). The clipped values themselves (``clipped``,
``clipped_replicated``) only with ``--values``.

The parts: ``options`` (flags), ``ranks`` (the data, the clip on the ranks, the
report), ``text`` (the learner's report), ``gallery`` (``--list-bugs``),
``figure`` (``--plot``), ``command`` (the entry point).
"""

from .command import main
from .figure import sweep
from .options import (
    LAYOUT_MYSTERY_POOL,
    MYSTERY_POOL,
    Options,
    layout_mysteries,
    mysteries,
    parse_args,
    parse_data,
)
from .ranks import random_shard, run, run_simulated, shard_norm

__all__ = [
    "LAYOUT_MYSTERY_POOL",
    "MYSTERY_POOL",
    "Options",
    "layout_mysteries",
    "main",
    "mysteries",
    "parse_args",
    "parse_data",
    "random_shard",
    "run",
    "run_simulated",
    "shard_norm",
    "sweep",
]
