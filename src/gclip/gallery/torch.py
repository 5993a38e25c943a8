"""``gclip.torch.clip_grad_norm_`` with ``mode=``: a gallery bug, on torch tensors."""

from __future__ import annotations

from typing import Any

from .. import torch as gclip_torch
from .bugs import steps_for

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    mode: str = "global",
    **kwargs: Any,
) -> Any:
    """:func:`gclip.torch.clip_grad_norm_` as bug ``mode`` clips (``"global"``: the correct one)."""
    return gclip_torch.clip_grad_norm_by(
        steps_for(mode),
        parameters,
        max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        **kwargs,
    )
