"""gclip: global-norm gradient clipping across MPI ranks, done right.

When a gradient is sharded over R ranks, clipping must use the GLOBAL norm:
each rank's local sum of squares, one all-reduce, the same scale on every rank.

The core is the modules here (``clip``, ``reader``, ``engine``, ``drivers``,
``layout``, ``replicas``, ``policy``, ``partials``, ``errors``, ``contract``); two
library packages sit over it: ``torch`` (gclip.torch, the torch front end) and
``limits``. The lab is the other subpackages: ``gallery`` (the bugs), and, each run
as ``python -m gclip.X``, ``demo``, ``train``, ``conformance`` (the judge), ``audit``
and ``bench``. See docs/architecture.md.
"""

from .clip import (
    ClipResult,
    apply_scale,
    clip_by_global_norm,
    clip_scale,
    clip_simulated,
    clip_with_norm,
    global_norm,
)
from .contract import clip_shards
from .errors import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError
from .layout import Group, Mesh, Placement
from .limits import AGC, AutoClip, GroupsResult, ZClip, clip_groups
from .replicas import check_replicas, explain

__all__ = [
    "AGC",
    "AutoClip",
    "ClipResult",
    "GclipError",
    "GclipTypeError",
    "GclipValueError",
    "Group",
    "GroupsResult",
    "Mesh",
    "NonFiniteNormError",
    "Placement",
    "ZClip",
    "apply_scale",
    "check_replicas",
    "clip_by_global_norm",
    "clip_groups",
    "clip_scale",
    "clip_shards",
    "clip_simulated",
    "clip_with_norm",
    "explain",
    "global_norm",
]

__version__ = "0.2.0"
