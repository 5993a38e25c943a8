"""A near miss: torch's epsilon, max_norm / (norm + 1e-6), in an otherwise correct clip.

python -m gclip.conformance examples/judge/epsilon_clip.py:clip_shards
"""

import numpy as np


def clip_shards(shards, limit):
    arrays = [np.asarray(s, dtype=np.float64) for s in shards]
    norm = float(np.sqrt(sum(float(np.sum(a * a)) for a in arrays)))
    scale = min(1.0, limit / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_ does
    return tuple(np.round(a * scale, 12) for a in arrays)
