"""Megatron-LM's ChainedOptimizer before commit abf10f85: dense and expert parameters clipped apart.

Source: NVIDIA/Megatron-LM, megatron/core/optimizer/optimizer.py (ChainedOptimizer.step,
MegatronOptimizer.clip_grad_norm, get_main_grads_for_grad_norm) and
megatron/core/optimizer/clip_grads.py (clip_grad_norm_fp32) at
df324ee958779ee315f75762a69b48ce6a05f9b7, the parent of abf10f85907ece699300edc2204649bbb47d4073
("Fix dual-optimizer gradient clipping issue", merge request !1276). With expert parallelism
get_megatron_optimizer builds one optimizer for the dense parameter groups and one for the expert
ones (``allreduce=False``); ChainedOptimizer.step stepped them one by one, and each step clipped its
own parameters by the norm of its own gradients. The fix computes both norms first, combines them and
clips both by the one total norm. Megatron-LM issue #785 asked about the same behaviour.

Adapted to the judge's form: the distributed optimizer's model-parallel group is the whole world
(``get_model_parallel_group`` returns None), here the judge's group; the parameters have no
``allreduce`` attribute in the plain form, so a convention stands in for it: the arrays at odd
positions of each rank's list are the experts', the others dense (a model whose layers alternate a
dense and an expert block). TP = 1 (no duplicates), nothing shared; apex's ``multi_tensor_l2norm``
and ``multi_tensor_scale`` by Megatron-LM's own local float32 fallbacks (megatron/core/utils.py, as
tests/corpus/megatron_clip_grads.py uses), the device the CPU. It asserts float32 gradients:
``--dtype float32``; ``clip_grad > 0`` gates the clip: ``--positive-max-norm``.
"""

import math

import torch
from torch import inf


def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    l2 = [[(torch.norm(tensor)) for tensor in tensor_list] for tensor_list in tensor_lists]
    l2_reduced = torch.norm(torch.tensor(l2))
    return torch.tensor([float(l2_reduced)], dtype=torch.float, device="cpu"), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)


def clip_grad_norm_fp32(parameters, grads_for_norm, max_norm, norm_type=2, model_parallel_group=None):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = []
    for param in parameters:
        if param.grad is not None:
            assert param.grad.type() == "torch.FloatTensor"
            grads.append(param.grad.detach())
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    total_norm = 0.0
    if norm_type == inf:
        total_norm = max(grad.abs().max() for grad in grads_for_norm)
        total_norm_cuda = torch.tensor([float(total_norm)], dtype=torch.float, device="cpu")
        torch.distributed.all_reduce(
            total_norm_cuda, op=torch.distributed.ReduceOp.MAX, group=model_parallel_group
        )
        total_norm = total_norm_cuda[0].item()
    else:
        if norm_type == 2.0:
            dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cpu")
            if grads_for_norm:
                grad_norm, _ = multi_tensor_applier(
                    multi_tensor_l2norm,
                    dummy_overflow_buf,
                    [grads_for_norm],
                    False,  # no per-parameter norm
                )
            else:
                grad_norm = torch.tensor([0], dtype=torch.float, device="cpu")
            # Since we will be summing across data parallel groups,
            # we need the pow(norm-type).
            total_norm = grad_norm**norm_type
        else:
            for grad in grads_for_norm:
                grad_norm = torch.norm(grad, norm_type)
                total_norm += grad_norm**norm_type
        # Sum across all model-parallel GPUs.
        torch.distributed.all_reduce(
            total_norm, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group
        )
        total_norm = total_norm.item() ** (1.0 / norm_type)
    # Scale.
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cpu")
        multi_tensor_applier(multi_tensor_scale, dummy_overflow_buf, [grads, grads], clip_coeff)
    return total_norm


class _Optimizer:
    """One of the chained optimizers: its parameters, and the step's clip (MegatronOptimizer)."""

    def __init__(self, params, clip_grad, group):
        self.params = params
        self.clip_grad = clip_grad
        self.group = group

    def get_main_grads_for_grad_norm(self):
        grads_for_norm = []
        for param in self.params:
            grad = param.grad
            is_not_shared = not hasattr(param, "shared") or not param.shared
            is_not_tp_duplicate = True  # TP = 1
            if grad is not None and is_not_shared and is_not_tp_duplicate:
                grads_for_norm.append(grad)
        return grads_for_norm

    def clip_grad_norm(self, clip_grad):
        return clip_grad_norm_fp32(
            self.params, self.get_main_grads_for_grad_norm(), clip_grad, model_parallel_group=self.group
        )

    def step(self):
        grad_norm = None
        if self.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.clip_grad)
        return True, grad_norm, None


def clip(parameters, max_norm, group):
    params = list(parameters)
    dense = _Optimizer([p for i, p in enumerate(params) if i % 2 == 0], max_norm, group)
    experts = _Optimizer([p for i, p in enumerate(params) if i % 2 == 1], max_norm, group)
    # ChainedOptimizer.step before abf10f85
    update_successful, grad_norm, num_zeros_in_grad = True, 0, 0  # noqa: F841 - as Megatron-LM writes it
    grad_norms = []
    for optimizer in (dense, experts):
        _update_successful, _grad_norm, _num_zeros_in_grad = optimizer.step()
        update_successful &= _update_successful
        grad_norms += [_grad_norm if _grad_norm else 0.0]
    grad_norm = math.sqrt(sum([x**2 for x in grad_norms]))
    return grad_norm
