"""Mystery A of the gclip lab: what is wrong with this clip? Predict, then ask the judge:

    python -m gclip.conformance lab/mystery_a.py:clip_shards
"""

import math


def clip_shards(shards, limit):
    # every rank computes the norm of its shard, and one all-reduce (SUM) combines them
    local = [math.sqrt(sum(v * v for v in shard)) for shard in shards]
    norm = sum(local)
    scale = min(1.0, limit / norm) if norm > 0 else 1.0
    return [[round(v * scale, 12) for v in shard] for shard in shards]
