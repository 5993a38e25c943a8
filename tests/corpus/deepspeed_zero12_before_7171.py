"""DeepSpeed ZeRO-1/2 before its fix in PR #7171: an overflowing norm masked by arithmetic, 0 x inf = NaN.

Source: deepspeedai/DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py (get_grad_norm_direct,
scaled_global_norm, unscale_and_clip_grads) at b8cc1eb078095347b46ef83c441203803bb52418, the parent of
1f706621f15b5df83f3bcff1e21dd0bbcfc1614b ("Fix issue #5242 grad_norm and loss is nan (#7171)"). The
masking line came with 61daaa1ea211e3a114250a7cf7117cd0c8fecd5e (#4974).

The line ``total_norm = inf_or_nan * err + inf_or_nan.logical_not() * total_norm`` was meant to turn
an inf or NaN norm into -1; for an inf norm ``False * inf`` is NaN, so the norm stays NaN, the clip
factor is NaN (``torch.clamp`` keeps a NaN) and every gradient becomes NaN. The total is cast to
float32 before the all-reduce, so a norm above 1.8e19 overflows: the judge's "huge values" case
(float64 values near 1e100) shows it. Adapted as deepspeed_zero12.py is: the judge's group is the
data-parallel group, each rank's arrays its partitions, one parameter group, no experts, no pipeline
copies, tensor-parallel size 1, no CPU offload, loss scale 1, the device the CPU. ``clip_grad > 0``
gates the clip: judged with ``--positive-max-norm`` (every dtype, so that the float64 case is in).
"""

import torch
import torch.distributed as dist

inf = float("inf")


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

    norm_is_inf = total_norm.isinf()
    norm_is_nan = total_norm.isnan()
    inf_or_nan = norm_is_nan.logical_or(norm_is_inf)

    err = torch.tensor(-1.0, dtype=torch.float)
    total_norm = inf_or_nan * err + inf_or_nan.logical_not() * total_norm
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
