"""DeepSpeed's fp16 optimizer before its fix in PR #5411: only tensor-parallel rank 0's gradients in the norm.

Source: deepspeedai/DeepSpeed, deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer.step and
unscale_and_clip_grads) and deepspeed/runtime/utils.py (get_grad_norm, get_global_norm,
is_model_parallel_parameter) at 258e500f3fcd33fa42871ff87612d135399017ac, the parent of
0896503e2f4d3b12583dfe267e52db3a1d63b88d ("Fix a convergence issues in TP topology caused by
incorrect grad_norm. (#5411)").

The step flattens each parameter group's gradients into one float32 tensor, and get_grad_norm skips
on tensor-parallel ranks > 0 every tensor not marked model-parallel: the flat tensor never is, so only
tp-rank 0's gradients enter the norm (PR #5411: "only tp_rank0 grad participating in grad_norm
computation"). Adapted to the judge's form: the judge's group is the model-parallel group and every
rank a tensor-parallel rank holding its own shards (the plain form has no copies, so the gallery's
``tp-rank0-only`` reads here as ``rank0-norm``: rank 0's shards alone); one parameter group, no
experts, no pipeline copies, loss scale 1 with no overflow (the overflow check passes), and the
clipped flat gradient is written back into each ``.grad`` (the real step hands it to the optimizer).
``clip_grad > 0`` gates the clip, as in DeepSpeed: judged with ``--positive-max-norm``; the
gradients are fp16: ``--dtype float16``; flattening an empty group raises (every tensor-parallel rank
holds its shards): ``--nonempty-ranks``.
"""

from math import sqrt

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

inf = float("inf")


def is_model_parallel_parameter(p) -> bool:
    if hasattr(p, "model_parallel") and p.model_parallel:
        return True
    if hasattr(p, "tensor_model_parallel") and p.tensor_model_parallel:
        return True
    return False


def get_grad_norm(parameters, group, norm_type=2):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(filter(lambda p: p.grad is not None, parameters))
    norm_type = float(norm_type)
    total_norm = 0.0
    tensor_mp_rank = dist.get_rank(group=group)  # bwc_tensor_model_parallel_rank(mpu)
    for p in parameters:
        # Filter to avoid over-counting replicated tensors from tensor
        # model parallelism
        if (tensor_mp_rank > 0) and not is_model_parallel_parameter(p):
            continue
        param_norm = p.grad.data.float().norm(norm_type)
        total_norm += param_norm.item() ** norm_type
    # Sum across all model parallel GPUs.
    total_norm_cuda = torch.FloatTensor([float(total_norm)])
    dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=group)
    total_norm = total_norm_cuda[0].item() ** (1.0 / norm_type)
    if total_norm == float("inf") or total_norm == -float("inf") or total_norm != total_norm:
        total_norm = -1
    return total_norm


def get_global_norm(norm_list):
    total_norm = 0.0
    for norm in norm_list:
        total_norm += norm**2.0
    return sqrt(total_norm)


def unscale_and_clip_grads(grad_groups_flat, total_norm, cur_scale, clip_grad):
    combined_scale = cur_scale
    if clip_grad > 0.0:
        # norm is in fact norm*scale
        clip = ((total_norm / cur_scale) + 1e-6) / clip_grad
        if clip > 1:
            combined_scale = clip * cur_scale
    for grad in grad_groups_flat:
        grad.data.mul_(1.0 / combined_scale)
    return combined_scale


class _Flat:
    """fp32_groups_flat[i]: the group's flat float32 copy, whose .grad the step sets."""

    def __init__(self, grad):
        self.grad = grad


def clip(parameters, max_norm, group):
    group_params = [p for p in parameters]
    data_type = torch.float32  # self.fp32_groups_flat[i].dtype
    grads_group_flat = _flatten_dense_tensors(
        [
            torch.zeros(p.size(), dtype=data_type, device=p.device)
            if p.grad is None
            else p.grad.to(data_type)
            for p in group_params
        ]
    )
    flat = _Flat(grads_group_flat)
    non_experts_grads_for_norm = [flat]
    all_groups_norm = get_grad_norm(non_experts_grads_for_norm, group)
    scaled_global_grad_norm = get_global_norm(norm_list=[all_groups_norm])
    unscale_and_clip_grads([grads_group_flat], scaled_global_grad_norm, 1.0, max_norm)
    # simplified: the clipped flat gradient back into each .grad (the real step updates the params)
    for p, g in zip(group_params, _unflatten_dense_tensors(grads_group_flat, [p.grad for p in group_params])):
        p.grad.copy_(g)
    return scaled_global_grad_norm
