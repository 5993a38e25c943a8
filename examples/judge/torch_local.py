"""A broken torch clip: torch's own clip_grad_norm_ on this rank's shard, with no all-reduce.

python -m gclip.conformance examples/judge/torch_local.py:clip_grad_norm --ranks 3 --torch
"""

import torch


def clip_grad_norm(parameters, max_norm, group):
    # clip_grad_norm_ sees only the parameters it is given: here, this rank's shards
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
