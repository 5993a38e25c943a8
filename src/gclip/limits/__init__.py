"""The limit a clip applies: per group, adaptive, unit-wise, over MPI for numpy arrays.

``clip_groups`` gives every parameter group its own limit (or none), all groups' norms
from the one header all-reduce (``gclip.limits.groups``).

Each clipper is called as the reference implementations are, after the backward and
before the optimizer's step: ``clipper.step(grads, ...)``. ZClip and AutoClip take their
limit from the history of the GLOBAL norm (``gclip.global_norm``: one all-reduce, the
same float on every rank), so their state is the same on every rank by construction;
``state_dict()`` / ``load_state_dict()`` carry it across a restart, on any layout. AGC is
stateless and unit-wise: where a sharding splits a unit, its partial sums are summed over
the ranks that hold its pieces. The same names in ``gclip.torch`` clip tensors.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..clip import apply_scale, clip_scale, global_norm
from .groups import GroupsResult, clip_groups
from .rules import FloatOps, ZClipRule, check_int, check_number
from .units import AGC

__all__ = ["AGC", "AutoClip", "Clipped", "GroupsResult", "ZClip", "clip_groups"]


class Clipped(NamedTuple):
    """What a clipper's ``step`` returns (the same on every rank but ``grads``)."""

    grads: Any  # the arrays, scaled, in the layout given
    total_norm: float  # the global norm before clipping
    limit: float  # this step's limit (inf: none)
    scale: float  # the factor applied: min(1, limit / total_norm); 1 if not finite

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


def _clip(grads: Any, norm: float, limit: float, inplace: bool) -> Clipped:
    scale = 1.0 if math.isinf(limit) else clip_scale(norm, limit)
    return Clipped(apply_scale(grads, scale, inplace=inplace), norm, limit, scale)


class ZClip:
    """ZClip (arXiv 2504.02507) over the global norm: the reference implementation's
    arguments, defaults and rule (``gclip.adaptive.rules.ZClipRule``), with gclip's exact
    scale ``min(1, limit / norm)`` where the reference divides by ``norm + 1e-6``.

    ``step(grads, **options)`` takes :func:`gclip.global_norm`'s options (``comm``,
    ``replicated``, ``norm_type``, ``reproducible``) and ``inplace``.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
    ) -> None:
        self.rule = ZClipRule(alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode, clip_option)

    def step(self, grads: Any, *, inplace: bool = False, **options: Any) -> Clipped:
        norm = global_norm(grads, **options)
        return _clip(grads, norm, self.decide(norm), inplace)

    def decide(self, norm: float) -> float:
        """This step's limit for a global norm computed elsewhere (inf: none); the state advances."""
        limit, _, seen = self.rule.limit(norm, FloatOps)
        self.rule.update(seen, math.isfinite(norm), FloatOps)
        return float(limit)

    def state_dict(self) -> dict[str, Any]:
        state = self.rule.state()
        state["warmup"] = [[float(x), bool(f)] for x, f in state["warmup"]]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rule.load(state)
        self.rule.warmup = [(float(x), bool(f)) for x, f in self.rule.warmup]
        if self.rule.mean is not None:
            self.rule.mean, self.rule.var = float(self.rule.mean), float(self.rule.var)


class AutoClip:
    """AutoClip (arXiv 2007.14469) over the global norm: the limit is the ``percentile``-th
    percentile (numpy's linear interpolation, as the paper's code) of every finite global
    norm seen, this step's included; ``window`` keeps only the last ``window`` norms."""

    def __init__(self, percentile: float = 10.0, window: int | None = None) -> None:
        self.percentile = check_number("percentile", percentile, zero=True, high=math.nextafter(100.0, 101.0))
        self.window = None if window is None else check_int("window", window, 1)
        self.history: list[float] = []

    def step(self, grads: Any, *, inplace: bool = False, **options: Any) -> Clipped:
        norm = global_norm(grads, **options)
        return _clip(grads, norm, self.decide(norm), inplace)

    def decide(self, norm: float) -> float:
        """This step's limit for a global norm computed elsewhere (inf: none); the history grows."""
        if math.isfinite(norm):
            self.history.append(norm)
            if self.window is not None and len(self.history) > self.window:
                del self.history[0]
        return float(np.percentile(self.history, self.percentile)) if self.history else math.inf

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "percentile": self.percentile, "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = [float(x) for x in state["history"]]
        if self.window is not None:
            history = history[-self.window :]
        self.history = history
