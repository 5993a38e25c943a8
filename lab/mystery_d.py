"""Mystery D of the gclip lab: what is wrong with this clip? Predict, then ask the judge:

    python -m gclip.conformance lab/mystery_d.py:clip_shards
"""

import math


def clip_shards(shards, limit):
    total = sum(v * v for shard in shards for v in shard)  # the all-reduce of the sums of squares
    norm = math.sqrt(total)
    scale = min(1.0, limit / norm) if norm > 0 else 1.0
    return [[v * scale for v in shard] for shard in shards]
