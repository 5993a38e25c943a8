"""gclip: global-norm gradient clipping across MPI ranks, done right.

When a gradient is sharded over R ranks, clipping must use the GLOBAL norm:
each rank's local sum of squares, one all-reduce, the same scale on every rank.
"""

from .clip import ClipResult, apply_scale, clip_by_global_norm, clip_simulated, global_norm
from .contract import clip_shards
from .errors import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError
from .strategies import BUGS, STRATEGIES

__all__ = [
    "BUGS",
    "STRATEGIES",
    "ClipResult",
    "GclipError",
    "GclipTypeError",
    "GclipValueError",
    "NonFiniteNormError",
    "apply_scale",
    "clip_by_global_norm",
    "clip_shards",
    "clip_simulated",
    "global_norm",
]

__version__ = "0.1.0"
