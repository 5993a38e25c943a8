"""The adaptive thresholds, as state machines fed by the agreed global norm alone.

ZClip (arXiv 2504.02507; its reference implementation, bluorion-com/ZClip ``zclip.py``)
and AutoClip (arXiv 2007.14469) turn the history of the gradient's norm into this step's
limit. Fed only by the global norm, which every rank receives from the same all-reduce,
the state is the same on every rank by construction: no rank drifts from another, and
no second collective is needed.

ZClip's arithmetic is written once, over "numbers" that are Python floats (the numpy
front end) or float64 0-d tensors on the gradients' device (gclip.torch's, so that
nothing is read on the host); ``where(cond, a, b)`` and ``sqrt`` are what differs.
Every branch that depends on a norm is a ``where``; the only host decision is the step
count (the warmup's end), which every rank knows without looking at a value.

Where gclip departs from the reference, on purpose: a non-finite norm leaves the
gradient untouched (gclip's scale rule), and the state does not take it either (a
warmup norm that is inf or NaN is left out of the mean and variance; the EMA keeps its
value), so one bad step cannot poison every later limit. On finite norms the rule is
the reference's, operation for operation.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from ..errors import GclipValueError

__all__ = ["FloatOps", "Ops", "ZClipRule", "check_int", "check_number"]


class Ops(Protocol):
    """The two operations the rule needs of its numbers (``math`` / ``torch`` shaped)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def sqrt(self, x: Any) -> Any: ...


class FloatOps:
    """The rule's operations on Python floats (the numpy front end)."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def sqrt(x: Any) -> Any:
        return math.sqrt(x) if x >= 0 else math.nan


def check_number(
    name: str, value: Any, *, low: float = 0.0, zero: bool = False, high: float = math.inf
) -> float:
    """A finite float in (low, high) ([low, high) with ``zero``), or a one-line error naming it."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise GclipValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or not (x >= low if zero else x > low) or not x < high:
        bounds = f"{'[' if zero else '('}{low:g}, {high:g})"
        raise GclipValueError(f"{name} must be in {bounds}, got {value!r}")
    return x


def check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GclipValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class ZClipRule:
    """ZClip's rule, as the reference implementation states it.

    The first ``warmup_steps`` norms start the EMA (their mean and population variance);
    meanwhile the limit is ``max_grad_norm``. From then on the norm's z-score against the
    EMA decides: above ``z_thresh`` the limit is ``mean + z_thresh * std / (z / z_thresh)``
    ("adaptive_scaling") or the mean ("mean"); mode "percentile" limits to
    ``mean + z_thresh * std`` whenever the norm is above it. ``max_grad_norm`` (None: no
    cap) caps the limit. The EMA then takes the limit where there was a spike, else the
    norm (the reference's ``clip_val if clip_val is not None else total_norm``).
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
        self.alpha = check_number("alpha", alpha, high=1.0)
        self.z_thresh = check_number("z_thresh", z_thresh)
        self.max_grad_norm = None if max_grad_norm is None else check_number("max_grad_norm", max_grad_norm)
        self.eps = check_number("eps", eps, zero=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.mode = str(mode).lower()
        if self.mode not in ("zscore", "percentile"):
            raise GclipValueError(f"mode must be 'zscore' or 'percentile', got {mode!r}")
        self.clip_option = str(clip_option).lower()
        if self.clip_option not in ("adaptive_scaling", "mean"):
            raise GclipValueError(f"clip_option must be 'adaptive_scaling' or 'mean', got {clip_option!r}")
        self.reset()

    def reset(self) -> None:
        self.step = 0  # norms seen: the warmup's end is a host decision, the same on every rank
        self.warmup: list[tuple[Any, Any]] = []  # (norm, finite) of the warmup's steps
        self.mean: Any = None
        self.var: Any = None

    @property
    def cap(self) -> float:
        return math.inf if self.max_grad_norm is None else self.max_grad_norm

    def limit(self, norm: Any, ops: Ops) -> tuple[Any, Any, Any]:
        """(this step's limit, whether it is a spike, the value the EMA takes) for the global
        ``norm``. The limit is ``cap`` (inf: none) where no spike clips."""
        cap = self.cap
        if self.mean is None:  # the warmup: the cap alone
            return cap, False, norm
        where = ops.where
        std = ops.sqrt(self.var)  # (the reference's var ** 0.5, correctly rounded)
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            spike = norm > threshold
        else:
            z = (norm - self.mean) / (std + self.eps)
            spike = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                eta = where(spike, z, self.z_thresh) / self.z_thresh  # (1 off a spike: never 0 / 0)
                threshold = self.mean + (self.z_thresh * std) / eta
            else:
                threshold = self.mean
        limit = where(spike, where(threshold < cap, threshold, cap), cap)
        return limit, spike, where(spike, threshold, norm)

    def update(self, seen: Any, finite: Any, ops: Ops) -> None:
        """Advance by ``seen`` (what :meth:`limit` gave the EMA); a non-finite norm changes nothing."""
        self.step += 1
        where = ops.where
        if self.mean is None:
            self.warmup.append((where(finite, seen, 0.0), finite))
            if self.step >= self.warmup_steps:
                self._start()
            return
        mean = self.alpha * self.mean + (1 - self.alpha) * seen
        var = self.alpha * self.var + (1 - self.alpha) * (seen - mean) ** 2
        self.mean = where(finite, mean, self.mean)
        self.var = where(finite, var, self.var)

    def _start(self) -> None:
        # the reference's sum(buffer) / len(buffer) and its population variance, left to
        # right; a non-finite warmup norm adds an exact 0 and is not counted
        (first, ok), rest = self.warmup[0], self.warmup[1:]
        total, count = first, 1.0 * ok
        for x, f in rest:
            total, count = total + x, count + 1.0 * f
        self.warmup = []
        if isinstance(count, float) and count == 0.0:  # no finite norm: no statistics (NaN, as on a device)
            self.mean = self.var = math.nan
            return
        mean = total / count
        sq = (first - mean) ** 2 * ok
        for x, f in rest:
            sq = sq + (x - mean) ** 2 * f
        self.mean, self.var = mean, sq / count

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "warmup": list(self.warmup), "mean": self.mean, "var": self.var}

    def load(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.warmup = [(x, f) for x, f in state["warmup"]]
        self.mean, self.var = state["mean"], state["var"]
