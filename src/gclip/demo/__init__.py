"""The teaching demo: one gradient sharded over the MPI ranks, clipped by its global norm.

Each rank holds one shard of a gradient (seeded random values, of a different
magnitude on each rank, or ``--shards``), plus a small tensor replicated on every
rank, like a bias. Rank 0 prints the three phases of a correct clip, on every
rank: local (each rank's sum of squares) -> all-reduce (the global norm) ->
scale (the same factor everywhere). ``--buggy NAME`` runs a bug of the gallery
on the same data next to the correct clip and shows what it breaks.

usage:: mpiexec -n 4 python -m gclip.demo [--buggy [NAME]] [--shards JSON] [--max-norm X]
                                          [--json] [--plot FILE.png] [--list-bugs]

The default data makes every bug of the gallery visible on 4 ranks: the
ranks' shards differ by up to 8x in norm (so per-rank, rank-0, mean and max
norms all differ), rank 1's sum of squares (160000) overflows float16, every
value is far above the default limit 1 (so the inf-norm bug shows too), and
the replicated bias (norm 50) is counted once.

``--json`` prints one JSON object on one line (rank 0). Non-finite floats are
written as the strings "inf", "-inf" and "nan" (strict JSON has no such
numbers; Python's ``float()`` reads them back). ``global_norm`` and ``scale``
are the values rank 0 used; ``same_on_all_ranks`` says whether every rank
used the same (the per-rank bug does not), and ``per_rank`` lists them all.

The parts: ``options`` (flags), ``ranks`` (the data, the clip on the ranks, the
report), ``text`` (the learner's report), ``gallery`` (``--list-bugs``),
``figure`` (``--plot``), ``command`` (the entry point).
"""

from .command import main
from .figure import sweep
from .options import Options, parse_args, parse_data
from .ranks import random_shard, run

__all__ = ["Options", "main", "parse_args", "parse_data", "random_shard", "run", "sweep"]
