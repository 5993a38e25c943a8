"""The lab's gallery of clipping bugs, and the entry that runs them.

The bugs (``BUGS``: how the norm is combined; ``LAYOUT_BUGS``: a correct clip
told the wrong layout; ``USAGE_BUGS``: a correct clip called at the wrong
moment), each with where it was seen, live in :mod:`gclip.gallery.bugs`.

The functions here are gclip's, plus ``mode=``: ``"global"`` (the correct
clip) or a bug's name. They install the bug through the engine's hook
(``gclip.engine.Steps``): the production functions have no such argument.
The demo, the trainer, the judge and the bench call these; ``gclip.gallery.torch``
does the same for ``gclip.torch.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import clip
from . import bugs
from .bugs import *  # noqa: F403 - the gallery's names, as bugs.__all__ lists them
from .bugs import steps_for

__all__ = [*bugs.__all__, "clip_by_global_norm", "clip_simulated", "global_norm"]


def global_norm(grads: Any, *, mode: str = "global", **kwargs: Any) -> float:
    """:func:`gclip.global_norm` as bug ``mode`` computes it (``"global"``: the correct one)."""
    return clip.norm_by(steps_for(mode), grads, **kwargs)


def clip_by_global_norm(
    grads: Any, max_norm: float, *, mode: str = "global", **kwargs: Any
) -> clip.ClipResult:
    """:func:`gclip.clip_by_global_norm` with bug ``mode``'s steps."""
    return clip.clip_by(steps_for(mode), grads, max_norm, **kwargs)


def clip_simulated(
    ranks: Sequence[Any], max_norm: float, *, mode: str = "global", **kwargs: Any
) -> list[clip.ClipResult]:
    """:func:`gclip.clip_simulated` with bug ``mode``'s steps."""
    return clip.clip_simulated_by(steps_for(mode), ranks, max_norm, **kwargs)
