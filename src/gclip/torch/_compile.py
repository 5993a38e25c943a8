"""What gclip.torch tells ``torch.compile``, without importing ``torch._dynamo``.

torch's own markers (``torch.compiler.assume_constant_result`` and ``torch.compiler.disable``)
import ``torch._dynamo`` when they are applied, at gclip.torch's import: 1.7 s of CPU on every
rank of every job, where torch, DTensor and FSDP2 import without it (FSDP2 loads it later, at
``fully_shard``). A job that compiles has it loaded by the time anything is traced, so the
marks wait until then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: the mark it sets, set here
    (tests/test_torch_device.py checks it is still the one torch's function sets)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def eagerly(fn: F) -> F:
    """``fn`` as ``torch.compiler.disable(fn)``, called from traced code only: the disabled
    function is made at the first such call (a graph break at that call, on the first trace only)."""
    made: list[Any] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)

    return run  # type: ignore[return-value]
