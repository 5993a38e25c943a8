"""A correct single-process clip: the contract's (shards, limit) -> shards, written with numpy.

python -m gclip.conformance examples/judge/good_clip.py:clip_shards
"""

import numpy as np


def clip_shards(shards, limit):
    arrays = [np.asarray(s, dtype=np.float64) for s in shards]
    norm = float(np.sqrt(sum(float(np.sum(a * a)) for a in arrays)))  # every shard's squares, once
    scale = min(1.0, limit / norm) if norm > 0 else 1.0
    return [np.round(a * scale, 12) for a in arrays]  # arrays are fine: the same layout
