"""Megatron-core's clip functions on its own gloo groups (TP 2 x DP 2), on the CPU.

    torchrun --nproc-per-node 4 fw_megatron.py

``parallel_state.initialize_model_parallel`` makes its groups on gloo; the clip is what its
optimizer's ``clip_grad_norm`` runs, ``get_grad_norm_fp32`` over the model-parallel group
then ``clip_grad_by_total_norm_fp32``, before plain SGD steps. The scaling is tried first
alone, with the norm computed here: each rank prints the error it raises
(``megatron scaling refused: ...``) and goes on to the optimizer's path, whose error ends it.
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.distributed as dist
from layouts import MAX_NORM


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel = parallel_state.get_model_parallel_group()
    torch.manual_seed(dist.get_rank())
    weight = torch.nn.Parameter(torch.randn(4, 3))  # this TP rank's shard
    weight.tensor_model_parallel = True
    optimizer = torch.optim.SGD([weight], lr=1.0)
    for _ in range(2):
        weight.grad = torch.randn(4, 3)
        dist.all_reduce(weight.grad, group=parallel_state.get_data_parallel_group())
        squares = weight.grad.double().square().sum()
        dist.all_reduce(squares, group=model_parallel)
        try:
            clip_grad_by_total_norm_fp32([weight], MAX_NORM, math.sqrt(float(squares)))
        except AssertionError as refused:
            failing = traceback.extract_tb(refused.__traceback__)[-1].line
            print(f"megatron scaling refused: {failing}", flush=True)
        norm = get_grad_norm_fp32([weight.grad], grad_stats_parallel_group=model_parallel)
        clip_grad_by_total_norm_fp32([weight], MAX_NORM, norm)
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
