"""fairscale's OSS.clip_grad_norm before PR #263: the norm of float16 gradients taken in float16.

Source: facebookresearch/fairscale, fairscale/optim/oss.py (OSS.clip_grad_norm) at
2d9243bf421d0d3dabf24e8722d546aac183bd09, the parent of
2df5ca2d2de671fbef45c168727012ec1c93264b ("[fix] OSS - resolve fp16 overflow in clip grad norm
(#263)"), which adds ``dtype=torch.float32`` to the per-parameter ``torch.norm``. In float16 the
local norm's square overflows above 65504 (a norm above 256): the total is inf, the scale
max_norm / inf is 0 and the gradients are wiped out. Adapted to the judge's form: the
parameters are this rank's shard (one device), ``self.group`` is ``dist.group.WORLD`` (the
judge's group), ``self._device`` the CPU. ``torch.stack`` needs a parameter with a gradient on
every rank, and the bug shows on float16 gradients: judged with ``--dtype float16
--nonempty-ranks``.
"""

from math import inf

import torch
import torch.distributed as dist


def clip(parameters, max_norm, group, norm_type=2.0):
    max_norm = float(max_norm)
    norm_type = float(norm_type)

    local_params = list(filter(lambda x: x.grad is not None, parameters))

    if norm_type == inf:
        total_norm = max(p.grad.detach().abs().max().to("cpu") for p in local_params)
        dist.all_reduce(total_norm, op=torch.distributed.ReduceOp.MAX, group=group)
    else:
        local_norm = torch.norm(
            input=torch.stack(
                [torch.norm(input=p.grad.detach(), p=norm_type).to("cpu") for p in local_params]
            ),
            p=norm_type,
        )
        total_norm = local_norm**norm_type
        dist.all_reduce(total_norm, group=group)
        total_norm = total_norm ** (1.0 / norm_type)

    clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype, device=total_norm.device) / (total_norm + 1e-6)

    if clip_coef < 1:
        for p in filter(lambda x: x.grad is not None, parameters):
            p.grad.detach().mul_(clip_coef.to("cpu"))

    return total_norm
