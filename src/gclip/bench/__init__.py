"""Benchmark: the clip step against its floor, and against torch.distributed.

usage:: mpirun -n 2 python -m gclip.bench [--sizes 1e3,1e4,1e5,1e6,1e7] [--dtypes float64,float32]
        [--repeat K] [--threads N] [--json [FILE]] [--plot FILE.png] [--no-torch] [--cold] [--quick]
usage:: python -m gclip.bench --ranks-sweep [--ranks 1,2,4] [--sizes ...] [--json FILE] [--plot FILE.png]

What is timed, per shard size (elements per rank) and dtype, with clipping
inactive (max_norm above the norm: nothing to write) and active:

- ``floor``: what no clip can beat on one rank, with no communication: a BLAS
  dot in the shard's dtype (``np.dot(x, x)``) plus, when active, one in-place
  scale (``np.multiply(x, s, out=x)``).
- ``bare``: the floor plus the one all-reduce (of a header-sized buffer),
  nothing checked: the least a distributed clip can cost.
- ``gclip``: ``gclip.clip_by_global_norm(x, max_norm, inplace=True)``.
- ``gclip-repro``: the same with ``reproducible=True``.
- ``torch``: with the ``[bench]`` extra, the FSDP-style clip over a gloo
  process group on the same memory (``torch.from_numpy``): vector_norm in the
  shard's dtype, squared, ``all_reduce``, sqrt, ``max_norm / (norm + 1e-6)``
  clamped to 1, ``mul_`` (torch always multiplies, even by 1). For float32
  shards, ``torch-f64acc`` also accumulates the norm in float64, as gclip does.

The implementations run interleaved, rep by rep, in a rotating order, so they
see the same machine state. Every timed call starts after a ``Barrier`` and
after an untimed call of the same op (warm caches: small shards would otherwise
time the previous op's cache pollution; ``--cold`` evicts L1/L2 instead, as a
backward pass would). A rep's time is the slowest rank's; a case's time is the
median over reps.

Active clipping without drift: ``max_norm`` is set ``DELTA`` (2**-20, about
1e-6) below the current global norm before every rep, so each rep scales by
about 1 - 1e-6 and really writes every element, while the data shrink by 0.1%
at most over a thousand reps: values never approach the subnormal range, where
arithmetic is slow and the timing would lie. The current norm is tracked from
what each implementation returns (gclip's total_norm and scale, torch's norm
and coefficient; the floor's known factor); every gclip rep re-reads the true
norm, and a rep that did not clip is counted in ``misses`` (expected 0).

Besides time: the collectives per clip (a counting proxy passed as ``comm``),
the time of a bare ``Allreduce`` of the clip's header (9 doubles), and the peak extra memory of an
in-place clip (tracemalloc, which numpy reports to; and the peak-RSS growth,
where Linux lets it be reset). BLAS and OpenMP threads are pinned to 1 per
rank unless the environment sets them (``--threads N`` overrides): ranks
already fill the cores.

``--ranks-sweep`` runs this benchmark under ``mpirun -n R`` for each R (with a
timeout) and tabulates step time against ranks and size.

The parts: ``workloads`` (sizes, reps, limits: the workload as data),
``targets`` (the performance targets as a table), ``options`` (flags, thread
pinning), ``timing``, ``ops`` (what is timed, torch included),
``collectives``, ``memory``, ``run`` (one run on the ranks), ``table``,
``sweep``, ``figure``, ``command``.
"""

from .collectives import CountingComm
from .command import main
from .options import parse_dtypes, parse_sizes

__all__ = ["CountingComm", "main", "parse_dtypes", "parse_sizes"]
