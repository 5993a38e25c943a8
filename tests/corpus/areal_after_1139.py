"""AReaL after PR #1139: a rank with no gradients still joins the all-reduce.

Source: inclusionAI/AReaL, areal/engine/fsdp_utils/grad.py at
595a3c4a3c9691498b11195a0795f4696465933e itself ("Fix grad norm hang when LoRA frozen ranks have no
gradients (#1139)"): ``fsdp2_clip_grad_norm``, ``get_grad_norm_fp32`` and
``clip_grad_by_total_norm_fp32`` with ``offload_params=True`` (the CPU path) and the local
``multi_tensor_scale`` of areal/engine/fsdp_utils/multi_tensor_apply.py. Adapted to the judge's
form: ``fsdp_group`` is the judge's group, no TP or PP group, plain tensors (no DTensor), the
device is the CPU.
"""

from collections import defaultdict

import torch
import torch.distributed as dist


def _local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)


def get_grad_norm_fp32(grads_for_norm, data_parallel_group=None, model_parallel_group=None, norm_type=2.0):
    grads_for_norm = [grad.detach() for grad in grads_for_norm]
    norm_type = float(norm_type)
    total_norm = 0.0

    device = "cpu"

    if not grads_for_norm:
        # Still participate in all_reduce with zero contribution so that
        # ranks with grads don't hang waiting for this rank (e.g. LoRA frozen ranks).
        total_norm_cuda = torch.tensor(0.0, dtype=torch.float, device=device)
        reduce_op = dist.ReduceOp.MAX if norm_type == torch.inf else dist.ReduceOp.SUM
        if data_parallel_group:
            dist.all_reduce(total_norm_cuda, op=reduce_op, group=data_parallel_group)
        if model_parallel_group is not None:
            dist.all_reduce(total_norm_cuda, op=reduce_op, group=model_parallel_group)
        total_norm = float(total_norm_cuda.item())
        if norm_type != torch.inf and total_norm > 0:
            total_norm = total_norm ** (1.0 / norm_type)
        return total_norm

    # offload_params: the CPU path
    total_norm = 0.0
    for grad in grads_for_norm:
        grad_norm = torch.norm(grad, norm_type).item()
        total_norm += grad_norm**norm_type
    total_norm_cuda = torch.tensor(float(total_norm), dtype=torch.float, device=device)

    if data_parallel_group:
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=data_parallel_group)
    if model_parallel_group is not None:
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=model_parallel_group)
    total_norm = float(total_norm_cuda.item()) ** (1.0 / norm_type)
    return total_norm


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm):
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    grads = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            grad = param.grad.detach()
            grads[grad.dtype].append(grad)
    if len(grads) == 0:
        return
    for _grads in grads.values():  # the CPU path
        _local_multi_tensor_scale(2048 * 32, None, [_grads, _grads], clip_coeff)


def clip(parameters, max_norm, group):
    grads_for_norm = [p.grad for p in parameters if p.grad is not None]  # tp rank 0: every grad
    grad_norm = get_grad_norm_fp32(grads_for_norm, group, None)
    if parameters:
        clip_grad_by_total_norm_fp32(parameters, max_norm, grad_norm)
    return grad_norm
