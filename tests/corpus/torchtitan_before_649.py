"""torchtitan before PR #649: each pipeline stage clips its gradients by its own norm.

Source: pytorch/torchtitan, train.py at 3247841423429faf37bdf6918204350db293e482 (the parent of
046de56949d8ba7f1931c411b6e29aa14828eede, "Fix PP clip_grad_norm (#649)", issue #596):

    # clip gradients
    for m in model_parts:
        torch.nn.utils.clip_grad_norm_(
            m.parameters(), job_config.training.max_norm, foreach=True
        )

torch.nn.utils.clip_grad_norm_ reduces along the DTensor meshes of the parameters (DP/FSDP/TP) and
never across pipeline stages. Adapted to the judge's form: each rank is one pipeline stage and its
parameters are plain tensors, so each stage's norm is its own.
"""

import torch


def clip(parameters, max_norm, group):
    torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
