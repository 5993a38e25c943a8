"""PyTorch's FSDP1 FullyShardedDataParallel.clip_grad_norm_: each rank's shard norm in float32,
the p-th powers all-reduced over the FSDP process group, one clip by max_norm / (norm + 1e-6).

Source: pytorch/pytorch, torch/distributed/fsdp/fully_sharded_data_parallel.py
(``FullyShardedDataParallel.clip_grad_norm_`` and ``_get_grad_norm``) at
cf30153c4c131c8164ee7798e5022d810682e2cb (torch 2.13.0). Adapted to the judge's form: every
parameter is FSDP-managed with a sharded strategy and ``use_orig_params=True`` (so the
parameters are this rank's shards and their ``.grad`` the gradients to clip; no ``NO_SHARD``
handle, no parameter outside FSDP), ``self.process_group`` is the judge's group, the compute
device is the CPU, no CPU offload; the lazy init, root and state checks are left out.

``_get_grad_norm`` asks ``torch.linalg.vector_norm(grad, dtype=torch.float32)``, which refuses a
float64 gradient, and a rank with no gradient contributes a float32 zero: it supports the float32
family (``--dtype float32``).
"""

import functools
import math
import warnings

import torch
import torch.distributed as dist


def _get_grad_norm(params, norm_type, zero, device):
    params_with_grad = [param for param in params if param.grad is not None]
    if len(params_with_grad) == 0:
        # Reuse a tensor for zero to avoid a GPU sync
        return zero
    grads = [param.grad for param in params_with_grad]
    # Compute the gradient norm in FP32, where we treat the gradients as a
    # single vector. This naturally handles mixed-dtype gradients since we
    # cast each gradient to FP32 during the norm computation.
    grad_norm = torch.linalg.vector_norm(
        torch.stack(
            [torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32) for grad in grads],
        ),
        norm_type,
        dtype=torch.float32,
    )
    return grad_norm.to(device=device)


def clip(parameters, max_norm, group, norm_type=2.0):
    zero_scalar = torch.tensor(0.0, device="cpu")
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    sharded_params_set = set()
    sharded_params = []
    grads = []
    for param in parameters:  # one sharded handle, use_orig_params=True
        if param not in sharded_params_set:
            sharded_params_set.add(param)
            sharded_params.append(param)
            if param.grad is not None:
                grads.append(param.grad)
    local_sharded_norm = _get_grad_norm(sharded_params, norm_type, zero_scalar, "cpu")
    local_nonsharded_norm = None  # every parameter is FSDP-managed and sharded
    if norm_type == math.inf:
        total_norm = local_sharded_norm
        dist.all_reduce(total_norm, op=torch.distributed.ReduceOp.MAX, group=group)
    else:
        total_norm = local_sharded_norm**norm_type
        dist.all_reduce(total_norm, group=group)
        if local_nonsharded_norm is not None:
            total_norm += local_nonsharded_norm**norm_type
        total_norm = total_norm ** (1.0 / norm_type)
    clip_coef = max_norm / (total_norm + 1e-6)
    # Multiplying by the clamped coefficient is meaningless when it is
    # equal to 1, but it avoids the host-device sync that would result from
    # `if clip_coef < 1`
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for grad in grads:
        grad.mul_(clip_coef_clamped.to(grad.device, grad.dtype))
    if len(grads) == 0:
        warnings.warn("Called FSDP.clip_grad_norm_() with no gradients", stacklevel=2)
        return total_norm
    total_norm_dtype = functools.reduce(torch.promote_types, [grad.dtype for grad in grads])
    return total_norm.to(total_norm_dtype)
