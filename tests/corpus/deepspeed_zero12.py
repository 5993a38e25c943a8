"""DeepSpeed ZeRO-1/2's norm and clip: per-tensor norms in float64, the total in float32, epsilon 1e-6.

Source: deepspeedai/DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py (get_grad_norm_direct,
scaled_global_norm, unscale_and_clip_grads) and deepspeed/runtime/utils.py
(mask_nan_or_inf_with_val_inplace) at edaa7221267243c7be7fb49c5d5f5c4fb97b4641.

Each rank takes the norm of each of its gradient partitions in float64, sums their squares, casts
the sum to float32 and all-reduces it over the data-parallel group; an inf or NaN norm is masked to
-1. The clip is ``grad *= 1 / clamp((norm / loss_scale + 1e-6) / clip_grad, min=1)``. Adapted to the
judge's form: the judge's group is the data-parallel group and each rank's arrays its partitions
(ZeRO-1/2: each rank holds different values), one parameter group, no experts, no pipeline copies,
tensor-parallel size 1 (every partition counted), no CPU offload, loss scale 1, the device the CPU.
``clip_grad > 0`` gates the clip: judged with ``--positive-max-norm``; the partitions ZeRO clips are
float32: ``--dtype float32``.
"""

import torch
import torch.distributed as dist

inf = float("inf")


def mask_nan_or_inf_with_val_inplace(input, device=None, val=-1.0):
    norm_is_inf = input.isinf()
    norm_is_nan = input.isnan()
    inf_or_nan = norm_is_nan.logical_or(norm_is_inf)
    err = torch.tensor(-1.0, device=device, dtype=torch.float)
    input.masked_fill_(inf_or_nan, err)


def get_grad_norm_direct(gradients, params, group, norm_type=2):
    norm_type = float(norm_type)
    all_norms = []
    model_parallel_rank = 0  # tensor-parallel size 1
    if norm_type == inf:
        for g in gradients:
            all_norms.append(g.data.abs().max().float())
        total_norm = torch.stack(all_norms).max()
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=group)
    else:
        for g, p in zip(gradients, params):  # noqa: B007 - as DeepSpeed writes it
            if model_parallel_rank == 0:
                all_norms.append(torch.linalg.vector_norm(g.data.double().detach(), ord=norm_type))
        if len(all_norms) > 0:
            total_norm = torch.stack(all_norms).square().sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32)
        # Sum across all model parallel Device.
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=group)
        total_norm = total_norm.pow(1.0 / norm_type)
    mask_nan_or_inf_with_val_inplace(total_norm, device=None)
    return total_norm


def scaled_global_norm(gradients, params, group, norm_type=2):
    norm_groups = [get_grad_norm_direct(gradients, params, group)]
    return torch.linalg.vector_norm(torch.stack(norm_groups), ord=norm_type)


def unscale_and_clip_grads(grad_groups_flat, total_norm, loss_scale, clip_grad):
    combined_scale = loss_scale
    if clip_grad > 0.0:
        # norm is in fact norm*scale
        clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * loss_scale
    for grad in grad_groups_flat:
        if isinstance(grad, list):
            sub_partitions = grad
            for g in sub_partitions:
                g.data.mul_(1.0 / combined_scale)
        else:
            grad.data.mul_(1.0 / combined_scale)


def clip(parameters, max_norm, group):
    params = [p for p in parameters if p.grad is not None]
    gradients = [p.grad for p in params]
    total_norm = scaled_global_norm(gradients, params, group)
    unscale_and_clip_grads([gradients], total_norm, 1.0, max_norm)
    return total_norm
