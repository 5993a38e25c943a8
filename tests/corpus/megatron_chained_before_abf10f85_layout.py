"""Megatron-LM's ChainedOptimizer before commit abf10f85, over a layout: the dense and the expert
optimizer each clip by the norm of their own gradients.

Source: NVIDIA/Megatron-LM, megatron/core/optimizer/optimizer.py (ChainedOptimizer.step,
MegatronOptimizer.get_main_grads_for_grad_norm and clip_grad_norm), megatron/core/optimizer/
distrib_optimizer.py (DistributedOptimizer: each rank's main parameters are views of its range of
the gradient buffer, with the tensor-parallel attributes and ``shared`` copied; its
``get_model_parallel_group`` returns None, the whole world), megatron/core/optimizer/__init__.py
(get_megatron_optimizer: one optimizer for the dense parameter groups over
``get_data_parallel_group(with_context_parallel=True)``, one for the expert ones, ``allreduce``
False, over ``get_data_modulo_expert_parallel_group()``), megatron/core/tensor_parallel/layers.py
(param_is_not_tensor_parallel_duplicate) and megatron/core/transformer/module.py
(param_is_not_shared), all at df324ee958779ee315f75762a69b48ce6a05f9b7, the parent of
abf10f85907ece699300edc2204649bbb47d4073 ("Fix dual-optimizer gradient clipping issue"). Each chained
optimizer's step clipped its own parameters by the norm of its own gradients; the fix computes both
norms first and clips both by the one total norm. Megatron-LM issue #785 asked about the same
behaviour. The norm and the clip are clip_grad_norm_fp32 as in megatron_chained_before_abf10f85.py
beside this file (apex's kernels by Megatron-LM's float32 fallbacks).

The plain form (megatron_chained_before_abf10f85.py) had to take the arrays at odd positions for
experts; here the layout form (``--layout dp=2,ep=2 --torch``) gives the real marks: the experts
are the parameters with ``allreduce`` False, as get_megatron_optimizer splits them, and ``layout``
stands for ``parallel_state`` (its data-parallel group dp x ep, its expert data-parallel group dp,
its tensor-parallel rank). Adapted: the distributed optimizer with float32 parameters (the main
gradient is the parameter's own ``.grad``), one parameter group per optimizer, each rank's range of
the flattened gradients split evenly over its data-parallel group in the parameters' order (the
real buffer's bucketing, padding and reversed order change which elements a rank owns, not that
each is owned once); after the clip, the ranges are all-gathered over the same group back into every
rank's ``.grad``, standing for the all-gather of the updated parameters. The device is the CPU. It
asserts float32 gradients: ``--dtype float32``; ``clip_grad > 0`` gates the clip:
``--positive-max-norm``.
"""

import math

import torch
import torch.distributed as dist
from megatron_chained_before_abf10f85 import clip_grad_norm_fp32


def param_is_not_shared(param):
    return not hasattr(param, "shared") or not param.shared


def param_is_not_tensor_parallel_duplicate(param, layout):
    return (hasattr(param, "tensor_model_parallel") and param.tensor_model_parallel) or (
        layout.get_tensor_model_parallel_rank() == 0
    )


_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor):
    for attribute in _MODEL_PARALLEL_ATTRIBUTES:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


class DistributedOptimizer:
    """One of the chained optimizers: its range of each parameter's gradient (a view, carrying the
    parameter's attributes), and the step's clip (MegatronOptimizer.clip_grad_norm)."""

    def __init__(self, params, clip_grad, data_parallel_group, layout):
        self.params = params
        self.clip_grad = clip_grad
        self.data_parallel_group = data_parallel_group
        self.layout = layout
        size = dist.get_world_size(data_parallel_group)
        rank = dist.get_rank(data_parallel_group)
        total = sum(p.numel() for p in params)
        self.per_rank = -(-total // size) if total else 0
        lo, hi = rank * self.per_rank, min((rank + 1) * self.per_rank, total)
        self.shard_main_params = []
        offset = 0
        for model_param in params:
            start, end = max(lo, offset), min(hi, offset + model_param.numel())
            if start < end:
                # fp32 parameters: shard_model_param = model_param.view(-1)[param_range]
                shard = model_param.detach().view(-1)[start - offset : end - offset]
                copy_tensor_model_parallel_attributes(shard, model_param)
                if hasattr(model_param, "shared"):
                    shard.shared = model_param.shared
                # _copy_model_grads_to_main_grads: shard_main_param.grad = shard_model_grad.float()
                shard.grad = model_param.grad.view(-1)[start - offset : end - offset].float()
                self.shard_main_params.append(shard)
            offset += model_param.numel()

    def get_parameters(self):
        return list(self.shard_main_params)

    def get_main_grads_for_grad_norm(self):
        params = self.get_parameters()
        grads_for_norm = []
        for param in params:
            grad = param.grad
            grad_not_none = grad is not None
            is_not_shared = param_is_not_shared(param)
            is_not_tp_duplicate = param_is_not_tensor_parallel_duplicate(param, self.layout)
            if grad_not_none and is_not_shared and is_not_tp_duplicate:
                grads_for_norm.append(grad)
        return grads_for_norm

    def get_model_parallel_group(self):
        """With the distributed optimizer, the model parallel group is the entire world."""
        return None

    def clip_grad_norm(self, clip_grad):
        params = self.get_parameters()
        grads_for_norm = self.get_main_grads_for_grad_norm()
        return clip_grad_norm_fp32(
            params, grads_for_norm, clip_grad, model_parallel_group=self.get_model_parallel_group()
        )

    def step(self):
        grad_norm = None
        if self.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.clip_grad)
        self._gather()
        return True, grad_norm, None

    def _gather(self):
        """Every rank's clipped range back into every rank's ``.grad`` (the all-gather of the
        updated parameters, here of the gradients the update would use)."""
        size = dist.get_world_size(self.data_parallel_group)
        if not self.params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        padded = torch.zeros(self.per_rank * size, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        parts = [torch.empty(self.per_rank, dtype=flat.dtype) for _ in range(size)]
        mine = padded[dist.get_rank(self.data_parallel_group) * self.per_rank :][: self.per_rank]
        dist.all_gather(parts, mine.contiguous(), group=self.data_parallel_group)
        gathered = torch.cat(parts)[: flat.numel()]
        offset = 0
        for p in self.params:
            p.grad.copy_(gathered[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()


def clip(parameters, max_norm, layout):
    params = list(parameters)
    # get_megatron_optimizer: _get_param_groups marks is_expert_parallel = not allreduce
    dense_params = [p for p in params if getattr(p, "allreduce", True)]
    moe_params = [p for p in params if not getattr(p, "allreduce", True)]
    optimizers = [DistributedOptimizer(dense_params, max_norm, layout.get_data_parallel_group(), layout)]
    if len(moe_params) > 0:  # if len(moe_param_groups) > 0
        optimizers.append(
            DistributedOptimizer(moe_params, max_norm, layout.get_expert_data_parallel_group(), layout)
        )
    # ChainedOptimizer.step before abf10f85
    update_successful, grad_norm, num_zeros_in_grad = True, 0, 0  # noqa: F841 - as Megatron-LM writes it
    grad_norms = []
    for optimizer in optimizers:
        _update_successful, _grad_norm, _num_zeros_in_grad = optimizer.step()
        update_successful &= _update_successful
        grad_norms += [_grad_norm if _grad_norm else 0.0]
    grad_norm = math.sqrt(sum([x**2 for x in grad_norms]))
    return grad_norm
