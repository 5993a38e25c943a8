"""A correct clip written against torch.distributed (run with --torch, on a gloo group).

python -m gclip.conformance examples/judge/torch_good.py:clip_grad_norm --ranks 3 --torch
"""

import torch
import torch.distributed as dist


def clip_grad_norm(parameters, max_norm, group):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        total += g.double().pow(2).sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)  # every rank's squares, once
    norm = total.sqrt().item()
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    for g in grads:
        g.mul_(scale)
    return norm
