"""Mystery B of the gclip lab: what is wrong with this clip? Predict, then ask the judge:

    python -m gclip.conformance lab/mystery_b.py:clip_shards
"""

import math


def clip_shards(shards, limit):
    total = sum(v * v for shard in shards for v in shard)  # the all-reduce of the sums of squares
    norm = math.sqrt(total)
    scale = min(1.0, limit / (norm + 1e-6))  # no division by zero
    return [[round(v * scale, 12) for v in shard] for shard in shards]
