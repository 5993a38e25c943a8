"""DeepSpeed's fp16 optimizer before its fix in PR #5411, over a layout: only tensor-parallel rank 0's
gradients in the norm.

Source: deepspeedai/DeepSpeed, deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer.step and
unscale_and_clip_grads), deepspeed/runtime/utils.py (get_grad_norm, get_global_norm,
is_model_parallel_parameter) and deepspeed/utils/bwc.py (bwc_tensor_model_parallel_rank) at
258e500f3fcd33fa42871ff87612d135399017ac, the parent of 0896503e2f4d3b12583dfe267e52db3a1d63b88d
("Fix a convergence issues in TP topology caused by incorrect grad_norm. (#5411)").

The step flattens each parameter group's gradients into one float32 tensor (``fp32_groups_flat[i]``,
a fresh tensor that carries none of the parameters' attributes), and get_grad_norm skips on
tensor-parallel ranks > 0 every tensor that ``is_model_parallel_parameter`` does not mark: the flat
tensor never is, so only tp-rank 0's gradients enter the norm, the sharded ones included (PR #5411:
"only tp_rank0 grad participating in grad_norm computation"). The layout form (``--layout tp=2
--torch``) gives what the plain form (deepspeed_fp16_before_5411.py) could not: real tensor-parallel
ranks, with shards and duplicates, and ``mpu``, here ``layout`` (its
``get_tensor_model_parallel_rank`` and ``get_model_parallel_group`` are the layout's). Adapted: one
parameter group (every parameter of the rank), no MoE layers (``has_moe_layers`` False), loss scale 1
with no overflow (the overflow check passes), the device the CPU (``get_accelerator().FloatTensor``
a CPU float32 tensor), and the clipped flat gradient written back into each ``.grad`` (the real step
hands it to the optimizer and copies the updated weights back). ``clip_grad > 0`` gates the clip, as
in DeepSpeed: judged with ``--positive-max-norm``. The flat copy is float32 (the master copy of fp16
parameters), so float64 gradients would come back rounded to float32: ``--dtype float32`` (the layout
cases have no float16).
"""

from math import sqrt

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

PIPE_REPLICATED = "ds_pipe_replicated"


def is_model_parallel_parameter(p) -> bool:
    if hasattr(p, "model_parallel") and p.model_parallel:
        return True
    if hasattr(p, "tensor_model_parallel") and p.tensor_model_parallel:
        return True
    return False


def bwc_tensor_model_parallel_rank(mpu=None):
    if mpu is None:
        # No model parallelism in easy :)
        return 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        # New Megatron and DeepSpeed convention (post pipeline-parallelism release)
        return mpu.get_tensor_model_parallel_rank()
    elif hasattr(mpu, "get_slice_parallel_rank"):
        # Some DeepSpeed + pipeline parallelism versions
        return mpu.get_slice_parallel_rank()
    else:
        # Deprecated Megatron and DeepSpeed convention
        return mpu.get_model_parallel_rank()


def get_grad_norm(parameters, norm_type=2, mpu=None):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(filter(lambda p: p.grad is not None, parameters))

    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total_norm = max(p.grad.data.abs().max() for p in parameters)
        total_norm_cuda = torch.FloatTensor([float(total_norm)])
        # Take max across all GPUs.
        if mpu is not None:
            dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        total_norm = total_norm_cuda[0].item()
    else:
        total_norm = 0.0
        tensor_mp_rank = bwc_tensor_model_parallel_rank(mpu=mpu)
        for p in parameters:
            # Pipeline parallelism may replicate parameters. Avoid multi-counting.
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue

            # Filter to avoid over-counting replicated tensors from tensor
            # model parallelism
            if (tensor_mp_rank > 0) and not is_model_parallel_parameter(p):
                continue

            param_norm = p.grad.data.float().norm(norm_type)
            total_norm += param_norm.item() ** norm_type

        # Sum across all model parallel GPUs.
        total_norm_cuda = torch.FloatTensor([float(total_norm)])
        if mpu is not None:
            dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total_norm = total_norm_cuda[0].item() ** (1.0 / norm_type)

    if total_norm == float("inf") or total_norm == -float("inf") or total_norm != total_norm:
        total_norm = -1

    return total_norm


def get_global_norm(norm_list):
    """Compute total from a list of norms"""
    total_norm = 0.0
    for norm in norm_list:
        total_norm += norm**2.0
    return sqrt(total_norm)


class _Flat:
    """``fp32_groups_flat[i]``: the group's flat float32 master copy, whose ``.grad`` the step sets
    (a new tensor: none of the parameters' attributes)."""

    def __init__(self, numel):
        self.data = torch.zeros(numel, dtype=torch.float32)
        self.dtype = self.data.dtype
        self.grad = None


class FP16_Optimizer:
    def __init__(self, params, mpu, clip_grad):
        self.fp16_groups = [list(params)]
        self.fp32_groups_flat = [_Flat(sum(p.numel() for p in g)) for g in self.fp16_groups]
        self.mpu = mpu
        self.clip_grad = clip_grad
        self.cur_scale = 1.0
        self.has_moe_layers = False

    def step(self):
        # the overflow check: none (loss scale 1)
        grads_groups_flat = []
        non_experts_grads_for_norm = []
        for i, group in enumerate(self.fp16_groups):
            data_type = self.fp32_groups_flat[i].dtype

            grads_groups_flat.append(
                _flatten_dense_tensors(
                    [
                        torch.zeros(p.size(), dtype=data_type, device=p.device)
                        if p.grad is None
                        else p.grad.to(data_type)
                        for p in group
                    ]
                )
            )
            # (the step sets p.grad = None here; kept, to hand the clipped gradient back)
            self.fp32_groups_flat[i].grad = grads_groups_flat[i]
            non_experts_grads_for_norm.append(self.fp32_groups_flat[i])

        all_groups_norm = get_grad_norm(non_experts_grads_for_norm, mpu=self.mpu)
        scaled_global_grad_norm = get_global_norm(norm_list=[all_groups_norm])
        self._global_grad_norm = scaled_global_grad_norm / self.cur_scale
        self.unscale_and_clip_grads(grads_groups_flat, scaled_global_grad_norm)
        return grads_groups_flat

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm, apply_scale=True):
        # compute combined scale factor for this group
        combined_scale = self.cur_scale
        if self.clip_grad > 0.0:
            # norm is in fact norm*scale
            clip = ((total_norm / self.cur_scale) + 1e-6) / self.clip_grad
            if clip > 1:
                combined_scale = clip * self.cur_scale

        if apply_scale:
            for grad in grad_groups_flat:
                grad.data.mul_(1.0 / combined_scale)

        return combined_scale


def clip(parameters, max_norm, layout):
    optimizer = FP16_Optimizer(parameters, mpu=layout, clip_grad=max_norm)
    grads_groups_flat = optimizer.step()
    # simplified: the clipped flat gradient back into each .grad (the real step updates the params)
    for group, flat in zip(optimizer.fp16_groups, grads_groups_flat):
        for p, g in zip(group, _unflatten_dense_tensors(flat, [p.grad for p in group])):
            p.grad.copy_(g)
    return optimizer._global_grad_norm
