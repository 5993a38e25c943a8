"""A broken single-process clip: each shard clipped by its own norm (the original incident).

python -m gclip.conformance examples/judge/per_rank_clip.py:clip_shards
"""

import math


def clip_shards(shards, limit):
    out = []
    for shard in shards:
        norm = math.sqrt(sum(v * v for v in shard))  # this shard's norm only: the bug
        scale = min(1.0, limit / norm) if norm > 0 else 1.0
        out.append([round(v * scale, 12) for v in shard])
    return out
