"""fairscale's OSS.clip_grad_norm: each rank's shard norm in float32, the p-th powers all-reduced.

Source: facebookresearch/fairscale, fairscale/optim/oss.py (OSS.clip_grad_norm) and
fairscale/internal/params.py (calc_grad_norm) at 146f160241651e1211c4247979f159a4ef43b54a.
Adapted to the judge's form: the parameters are this rank's shard (``self._local_params``, one
device), no ``filter_params_fn``, ``dist.group.WORLD`` is the judge's group.
"""

from math import inf

import torch
import torch.distributed as dist


def calc_grad_norm(parameters, p):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(filter(lambda par: par.grad is not None, parameters))

    if len(parameters) == 0:
        return torch.tensor(0.0)
    p = float(p)
    if p == inf:
        local_norm = max(par.grad.detach().abs().max() for par in parameters)
    else:
        # Compute the norm in full precision no matter what
        local_norm = torch.norm(
            torch.stack([torch.norm(par.grad.detach(), p, dtype=torch.float32) for par in parameters]), p
        ).to(dtype=parameters[0].dtype)
    return local_norm


def clip(parameters, max_norm, group, norm_type=2.0):
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    local_norm = calc_grad_norm(parameters, norm_type)
    if norm_type == inf:
        total_norm = local_norm
        dist.all_reduce(total_norm, op=torch.distributed.ReduceOp.MAX, group=group)
    else:
        total_norm = local_norm**norm_type
        dist.all_reduce(total_norm, group=group)
        total_norm = total_norm ** (1.0 / norm_type)

    clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype, device=total_norm.device) / (total_norm + 1e-6)
    if clip_coef < 1:
        for p in filter(lambda x: x.grad is not None, parameters):
            p.grad.detach().mul_(clip_coef.to(p.grad.device))
    return total_norm
