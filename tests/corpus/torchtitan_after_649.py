"""torchtitan after PR #649: the norm reduced across pipeline stages, then one clip.

Source: pytorch/torchtitan, torchtitan/utils.py, clip_grad_norm_ at
046de56949d8ba7f1931c411b6e29aa14828eede ("Fix PP clip_grad_norm (#649)"). Adapted to the judge's
form: every rank is one pipeline stage, so ``pp_mesh.get_group()`` is the judge's group; the
parameters are plain tensors, so the DTensor branch (``total_norm.full_tensor()``) never runs.
"""

import math

import torch
from torch import distributed as dist


@torch.no_grad()
def clip(parameters, max_norm, group, norm_type=2.0, error_if_nonfinite=False, foreach=True):
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)

    # pp_mesh is not None: every rank is a stage
    if math.isinf(norm_type):
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=group)
    else:
        total_norm **= norm_type
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=group)
        total_norm **= 1.0 / norm_type

    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm
