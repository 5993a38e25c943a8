"""A bug of no gallery: the last shard is left out of the norm (but still scaled).

python -m gclip.conformance examples/judge/drop_last_clip.py:clip_shards
"""

import numpy as np


def clip_shards(shards, limit):
    arrays = [np.asarray(s, dtype=np.float64) for s in shards]
    norm = float(np.sqrt(sum(float(np.sum(a * a)) for a in arrays[:-1])))  # the bug: [:-1]
    scale = min(1.0, limit / norm) if norm > 0 else 1.0
    return [np.round(a * scale, 12) for a in arrays]
