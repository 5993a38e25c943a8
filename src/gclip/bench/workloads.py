"""What the bench measures, as data: sizes, dtypes, reps, the clip's limits, the collective-count cases.

Every number the bench runs with is named here, so that a reader (and a
test) can see the workload without reading the timing code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "ALLREDUCE_REPS",
    "BUSY_LOAD",
    "CACHE_EVICT_BYTES",
    "COLLECTIVE_CASES",
    "COUNT_SIZE",
    "DEFAULT_DTYPES",
    "DEFAULT_LISTS",
    "DEFAULT_RANKS",
    "DEFAULT_SIZES",
    "DELTA",
    "DTYPES",
    "GPT2_SMALL",
    "INACTIVE_FACTOR",
    "LISTS",
    "LIST_SCALE",
    "MAX_ELEMENTS",
    "MAX_RANKS",
    "MEMORY_HEADROOM",
    "OVERHEAD_LIMITS",
    "OVERHEAD_LISTS",
    "QUICK_REPEAT",
    "QUICK_SIZES",
    "REPS_MAX",
    "REPS_MIN",
    "REP_ELEMENTS",
    "SHARD_SEED",
    "SWEEP_TIMEOUT",
    "TORCH_LISTS",
    "CountCase",
    "ListWorkload",
    "auto_repeat",
    "list_arrays",
    "shard",
]

# sizes: elements per rank
DEFAULT_SIZES = "1e3,1e4,1e5,1e6,1e7"
QUICK_SIZES = "1e3,1e4"
MAX_ELEMENTS = 2 * 10**9
DTYPES = ("float32", "float64")  # the two training dtypes
DEFAULT_DTYPES = "float64,float32"
SHARD_SEED = 20240  # rank r's shard: standard normal values from seed SHARD_SEED + r

# reps: ~REPS_MAX for small shards, fewer for big ones, never fewer than REPS_MIN
REPS_MAX = 300
REPS_MIN = 7
REP_ELEMENTS = 3e8  # elements a case may walk in all its reps (sets the count for big shards)
QUICK_REPEAT = 5  # --quick: a smoke run
ALLREDUCE_REPS = 300  # reps of the bare header-sized Allreduce

# the clip's limit relative to the current global norm
DELTA = 2.0**-20  # active: max_norm this far (relative) below the norm, so every rep writes
INACTIVE_FACTOR = 2.0  # inactive: max_norm this many times the norm, never reached

CACHE_EVICT_BYTES = 8 << 20  # --cold: a write this large evicts L1 and L2
MEMORY_HEADROOM = 0.8  # refuse sizes that need more than this share of the available memory
BUSY_LOAD = 0.5  # a 1-minute load average above this at the start: warn that timings are noisy

# the ranks sweep
DEFAULT_RANKS = "1,2,4,8"
MAX_RANKS = 64
SWEEP_TIMEOUT = 1800  # seconds per mpirun of the sweep


class CountCase(NamedTuple):
    """One clip whose collectives are counted: its array's dtype and limit (x the norm);
    ``replicated``: a second, small array held by every rank of the communicator (the
    count-once rule of the parallel layouts), given as a flag or as that communicator."""

    name: str
    dtype: str
    limit_factor: float
    reproducible: bool = False
    replicated: str | None = None  # None, "flag" or "communicator"


COUNT_SIZE = 1000  # elements per rank of the counted clips
COLLECTIVE_CASES = (
    CountCase("default_inactive", "float64", INACTIVE_FACTOR),
    CountCase("default_active", "float64", 0.5),
    CountCase("default_float32", "float32", 0.5),
    CountCase("reproducible", "float64", 0.5, reproducible=True),
    CountCase("layout_flag", "float64", 0.5, replicated="flag"),
    CountCase("layout_communicator", "float64", 0.5, replicated="communicator"),
)


# lists of many arrays: a model's gradient, one array per parameter, every rank holding
# its own list (as data-parallel ranks hold gradients of their own batches)


class ListWorkload(NamedTuple):
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    repeat: int  # timed reps


def _gpt2_small() -> tuple[tuple[int, ...], ...]:
    """GPT-2 small's 148 parameters (124,439,808 values): token and position embeddings,
    12 blocks of (layer norm, attention, layer norm, MLP), the final layer norm."""
    vocab, positions, d, blocks = 50257, 1024, 768, 12
    block = [
        (d,),
        (d,),
        (d, 3 * d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (d, 4 * d),
        (4 * d,),
        (4 * d, d),
        (d,),
    ]
    return ((vocab, d), (positions, d), *(block * blocks), (d,), (d,))


GPT2_SMALL = _gpt2_small()
LISTS = (
    ListWorkload("gpt2-small", GPT2_SMALL, "float32", 7),
    ListWorkload("tiny", ((64,),) * 2000, "float32", 200),
)
# gclip.torch against torch's own clip, on torch parameters of GPT-2 small's shapes
TORCH_LISTS = (
    ListWorkload("gpt2-small-torch", GPT2_SMALL, "float32", 5),
    ListWorkload("gpt2-small-torch-bf16", GPT2_SMALL, "bfloat16", 5),
)
# one process: gclip.torch against torch's own clip_grad_norm_(foreach=True), per-call overhead
# included (``--lists overhead`` names all three)
OVERHEAD_LISTS = (
    ListWorkload("overhead-1", ((1000,),), "float32", 400),
    ListWorkload("overhead-2000x64", ((64,),) * 2000, "float32", 40),
    ListWorkload("overhead-gpt2-small", GPT2_SMALL, "float32", 7),
)
OVERHEAD_LIMITS = {"overhead-gpt2-small": (1.0, 1.05)}  # (off, active) ratio targets; others 1.0
DEFAULT_LISTS = "gpt2-small,tiny,gpt2-small-torch,gpt2-small-torch-bf16"
LIST_SCALE = 1e-3  # gradient-like magnitudes


def auto_repeat(n: int) -> int:
    """Reps for a shard of n elements: REPS_MAX for small shards, fewer for big ones."""
    return max(REPS_MIN, min(REPS_MAX, int(REP_ELEMENTS // n)))


def shard(n: int, dtype: str, rank: int) -> Any:
    """Rank ``rank``'s shard of n elements: standard normal values, seeded by the rank."""
    import numpy as np

    rng = np.random.default_rng(SHARD_SEED + rank)
    return rng.standard_normal(n, dtype=np.dtype(dtype).type)


def list_arrays(workload: ListWorkload, rank: int) -> list[Any]:
    """Rank ``rank``'s list: one separately allocated array per shape, standard normal
    values times LIST_SCALE, seeded by the rank."""
    import numpy as np

    rng = np.random.default_rng(SHARD_SEED + rank)
    kind = np.dtype(workload.dtype).type
    return [rng.standard_normal(shape, dtype=kind) * kind(LIST_SCALE) for shape in workload.shapes]
