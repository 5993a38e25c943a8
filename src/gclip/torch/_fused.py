"""The clip folded into the optimizer's own pass: one read of the gradients for the norm, none to scale.

::

    from gclip.torch import clip_step

    loss.backward()
    clip_step(optimizer, max_norm=1.0)  # instead of clip_grad_norm_(...); optimizer.step()

    scaler.scale(loss).backward()  # with a GradScaler: no unscale_ call
    clip_step(optimizer, max_norm=1.0, scaler=scaler)
    scaler.update()

torch's fused Adam, AdamW and SGD (``fused=True``) take two tensors, ``grad_scale`` and
``found_inf``, that ``GradScaler`` sets: the kernel divides each gradient by ``grad_scale`` as
it reads it, and ``found_inf`` skips the step. :func:`clip_step` reads the global norm of the
gradients as they are (gclip's ``get_total_norm``: one read, one small all-reduce), and hands
the optimizer ``grad_scale = loss scale / clip coefficient``, so the gradients are never
written. With a GradScaler the norm of the scaled gradients divided by the loss scale is the
true norm, so ``unscale_``'s read and write fold in too, and the skip decision is the global
norm's: the same on every rank. Other optimizers get today's in-place clip (said once).

See docs/performance.md for what it saves and docs/torch.md for the API.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..clip import clip_scale

__all__ = ["make_clip_step"]

_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_warned: set[type] = set()  # optimizer types already told they have no fused path


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Does optimizer.step() read grad_scale and found_inf (torch's fused Adam, AdamW, SGD)?"""
    return (
        isinstance(optimizer, _FUSED_TYPES)
        and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        and all(group.get("fused") for group in optimizer.param_groups)
    )


def _float32_up(x: float) -> float:
    """x rounded to float32 toward +inf: the optimizer divides by it, so the gradient's
    scale never rounds up (as gclip's own in-place clip, which rounds the scale toward zero)."""
    x32 = np.float32(x)
    if float(x32) < x:
        x32 = np.nextafter(x32, np.float32(np.inf))
    return float(x32)


def _float32_down(x: float) -> float:
    x32 = np.float32(x)
    if float(x32) > x:
        x32 = np.nextafter(x32, np.float32(0.0))
    return float(x32)


def _record_found_inf(scaler: Any, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Tell the GradScaler what this step found, as its own step() would, so that update()
    backs the loss scale off (or grows it) on the global decision."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.STEPPED


def _loss_scale(scaler: Any, optimizer: torch.optim.Optimizer) -> float:
    """The scaler's current loss scale (1.0 without an enabled scaler)."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    from torch.amp.grad_scaler import OptState

    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is not OptState.READY:
        what = "unscale_() was already called" if stage is OptState.UNSCALED else "step() was already called"
        raise RuntimeError(
            f"clip_step: {what} for this optimizer since the last update(); clip_step reads the scaled "
            "gradients itself (drop the unscale_ call)"
        )
    return float(scaler.get_scale())


def make_clip_step(
    get_total_norm: Callable[..., torch.Tensor], clip_grads_with_norm_: Callable[..., None]
) -> Any:
    """gclip.torch's ``clip_step``, over gclip.torch's own norm and in-place clip (given here, so
    this module never imports gclip.torch, which exports the result)."""

    @functools.wraps(_clip_step)
    def clip_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _clip_step(*args, **kwargs, _norm=get_total_norm, _clip=clip_grads_with_norm_)

    clip_step.__name__ = clip_step.__qualname__ = "clip_step"
    return clip_step


@torch.no_grad()
def _clip_step(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    *,
    scaler: Any = None,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
    reproducible: bool = False,
    _norm: Callable[..., torch.Tensor],
    _clip: Callable[..., None],
) -> torch.Tensor:
    """Clip the optimizer's gradients by their GLOBAL norm and step, the clip folded into the step.

    Does what ``clip_grad_norm_(params, max_norm, ...)`` then ``optimizer.step()`` do (with a
    scaler: ``scaler.unscale_(optimizer)``, the clip, ``scaler.step(optimizer)``), reading each
    gradient once for the norm and leaving the scaling to the optimizer's fused pass.

    Args:
        optimizer: its parameters' gradients are clipped (those without one are skipped).
            torch's Adam, AdamW or SGD with ``fused=True``: folded. Any other: the gradients are
            scaled in place first (a warning, once per optimizer type), then ``step()``.
        max_norm: the limit on the global norm (finite, >= 0).
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` made the gradients;
            call ``scaler.update()`` after, not ``unscale_``/``step``. A non-finite global norm
            skips the step on every rank (the norm is global, so is the decision) and update()
            backs the scale off.
        norm_type, error_if_nonfinite, comm, replicated, reproducible: as in
            ``gclip.torch.clip_grad_norm_`` (one replicated entry per parameter of the optimizer,
            in its param_groups' order). With an enabled scaler a non-finite norm is a skipped
            step, never an error: ``error_if_nonfinite`` applies without one.

    Returns:
        The global norm of the (unscaled) gradients before clipping: a float64 0-d tensor on the
        first gradient's device, the same on every rank.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    have = [i for i, p in enumerate(params) if p.grad is not None]
    grads = [params[i].grad for i in have]
    entries = replicated  # None, or one entry alone: gclip.torch applies it to every gradient
    if isinstance(replicated, (list, tuple)):  # one per parameter: those with a gradient
        if len(replicated) != len(params):
            raise ValueError(
                f"replicated has {len(replicated)} entries for {len(params)} parameters of the optimizer"
            )
        entries = [replicated[i] for i in have]
    loss_scale = _loss_scale(scaler, optimizer)
    amp = scaler is not None and scaler.is_enabled()
    norm_t = _norm(
        grads,
        norm_type,
        error_if_nonfinite and not amp,  # with a scaler, an inf is a skip, not an error
        comm=comm,
        replicated=entries,
        reproducible=reproducible,
    )
    scaled_norm = float(norm_t)
    norm = scaled_norm / loss_scale  # the true norm (exact for a power-of-two loss scale)
    finite = math.isfinite(norm)
    coef = clip_scale(norm, max_norm) if finite else 1.0
    device = grads[0].device if grads else torch.device("cpu")
    if amp:
        where = scaler._scale.device if scaler._scale is not None else torch.device(scaler._device)
        found_inf = torch.full((), 0.0 if finite else 1.0, dtype=torch.float32, device=where)
        _record_found_inf(scaler, optimizer, found_inf)
    if _fused(optimizer):
        if not amp and coef == 1.0:
            optimizer.step()  # nothing to hand over: exactly a plain step
        else:
            divisor = _float32_up(loss_scale / coef) if coef > 0.0 else math.inf
            optimizer.grad_scale = torch.full((), divisor, dtype=torch.float32, device=device)
            optimizer.found_inf = found_inf if amp else torch.zeros((), dtype=torch.float32, device=device)
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
    else:
        if type(optimizer) not in _warned:
            _warned.add(type(optimizer))
            warnings.warn(
                f"gclip.torch.clip_step: {type(optimizer).__name__} has no fused step taking grad_scale "
                "(torch's Adam, AdamW and SGD with fused=True have one); clipping the gradients in place",
                stacklevel=3,
            )
        if not amp:
            _clip([params[i] for i in have], max_norm, norm)
            optimizer.step()
        elif finite:
            factor = _float32_down(coef / loss_scale)
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                groups.setdefault((g.device, g.dtype), []).append(g)
            for (dev, dtype), group in groups.items():
                f = factor if dtype != torch.float64 else coef / loss_scale
                torch._foreach_mul_(
                    group,
                    torch.full((), f, dtype=torch.float32 if dtype != torch.float64 else dtype, device=dev),
                )
            optimizer.step()
    return torch.full((), norm, dtype=torch.float64, device=device)
