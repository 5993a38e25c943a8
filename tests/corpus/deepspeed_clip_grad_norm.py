"""DeepSpeed's ``clip_grad_norm_`` today (the engine's fp32 clip, ``clip_fp32_gradients``), over a
layout with ``mpu`` the layout.

Source: deepspeedai/DeepSpeed, deepspeed/runtime/utils.py (clip_grad_norm_,
is_model_parallel_parameter), deepspeed/utils/groups.py (_get_data_parallel_group) and
deepspeed/runtime/engine.py (clip_fp32_gradients, _take_model_step) at
edaa7221267243c7be7fb49c5d5f5c4fb97b4641. The engine calls it with ``mpu=self.mpu`` when
``gradient_clipping() > 0`` and neither fp16, bf16, AMP nor ZeRO is on.

It counts a gradient where ``mpu.get_model_parallel_rank() == 0`` or the parameter is
model-parallel, sums over ``mpu.get_model_parallel_group()`` and averages over the data-parallel
group. Two things in it differ from its sibling ``get_grad_norm`` in the same file: it asks for the
*model*-parallel rank (tp x pp: with Megatron-LM's ``parallel_state`` or DeepSpeed's
PipelineParallelGrid as ``mpu``, rank 0 of both) where get_grad_norm asks for the tensor-parallel
rank, so with pp > 1 the tensors duplicated over tp on the other stages are counted on no rank; and
it does not skip ``ds_pipe_replicated`` copies, so a tied embedding is counted on both of its
stages. The first is DeepSpeed issue #1839 (open: "clip_grad_norm_ ... does not handle model
parallelism correctly (uses get_model_parallel_rank() instead of bwc_tensor_model_parallel_rank()");
the second, and what the two do to the norm on ``--layout pp=2,tp=2`` (the tie's copy counted twice,
the second stage's layer norms never: 1.006 times the global norm on the lab's model), is the judge's
finding, not a cited incident: no DeepSpeed issue or pull request describing it was found. With the
tensor-parallel rank and the ``ds_pipe_replicated`` skip of get_grad_norm it passes on the same layout;
with the rank alone it is ``tied-counted-twice``. As it is, the judge names the two together: FAIL,
``duplicates-on-mp-rank0-only + tied-counted-twice``.

Adapted to the judge's layout form (``--layout --torch``): ``mpu`` is ``layout``, which is also
what ``groups.mpu`` holds (deepspeed.initialize sets it; ``layout`` has no
``initialize_sequence_parallel``, so ``_get_data_parallel_group`` returns
``mpu.get_data_parallel_group()``); ``get_accelerator()`` is the CPU; ``deepspeed.comm`` is
``torch.distributed``. The engine clips only for ``gradient_clipping() > 0``: judged with
``--positive-max-norm``; it reads ``parameters[0].device`` after the collectives, which raises on a
rank with no gradient: ``--nonempty-ranks``.
"""

import torch
import torch.distributed as dist
from torch import inf


def is_model_parallel_parameter(p) -> bool:
    if hasattr(p, "model_parallel") and p.model_parallel:
        return True

    if hasattr(p, "tensor_model_parallel") and p.tensor_model_parallel:
        return True

    return False


def _get_data_parallel_group(mpu):
    """groups._get_data_parallel_group, groups.mpu being the engine's mpu (no mesh_device)."""
    if mpu is not None:
        if hasattr(mpu, "initialize_sequence_parallel"):
            return None
        else:
            return mpu.get_data_parallel_group()
    return dist.group.WORLD


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(filter(lambda p: p.grad is not None, parameters))
    norm_type = float(norm_type)
    all_norms = []
    if norm_type == inf:
        for p in parameters:
            all_norms.append(p.grad.data.abs().max().float())
        total_norm = torch.stack(all_norms).max()
        # Take max across all GPUs.
        if mpu is not None:
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        total_norm = 0
        for p in parameters:
            if mpu is not None:
                if (mpu.get_model_parallel_rank() == 0) or is_model_parallel_parameter(p):
                    param_norm = p.grad.data.detach().float().norm(norm_type)
                    all_norms.append(param_norm)
            else:
                param_norm = p.grad.data.detach().float().norm(norm_type)
                all_norms.append(param_norm)
        if len(all_norms) > 0:
            total_norm = torch.stack(all_norms).square().sum().float()
        else:
            total_norm = torch.FloatTensor([0.0])
        # Sum across all model parallel GPUs.
        if mpu is not None:
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total_norm = total_norm.pow(1.0 / norm_type)

    # Need to average total_norm across different GPUs due to the presence of moe params
    pg = _get_data_parallel_group(mpu)
    scaled_norm = total_norm * 1.0 / float(dist.get_world_size(group=pg))
    scaled_norm_tensor = scaled_norm

    dist.all_reduce(scaled_norm_tensor, group=pg)
    total_norm = scaled_norm_tensor
    total_norm = total_norm.to(parameters[0].device)

    max_norm = torch.tensor([float(max_norm)], device=total_norm.device)
    clip_coef = max_norm / (total_norm + 1e-6)
    tmp_tensor = torch.tensor([1.0], device=clip_coef.device)
    clip_coef = torch.min(tmp_tensor, clip_coef)
    for p in parameters:
        p.grad.data.mul_(clip_coef)
    return total_norm


def clip(parameters, max_norm, layout):
    # engine.clip_fp32_gradients:
    # clip_grad_norm_(parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu)
    return float(clip_grad_norm_(parameters=parameters, max_norm=max_norm, mpu=layout))
