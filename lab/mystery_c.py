"""Mystery C of the gclip lab: what is wrong with this clip? Predict, then ask the judge:

    python -m gclip.conformance lab/mystery_c.py:clip_shards
"""

import math


def clip_shards(shards, limit):
    total = sum(v * v for shard in shards for v in shard)  # the all-reduce of the sums of squares
    count = sum(len(shard) for shard in shards)
    norm = math.sqrt(total / count) if count else 0.0  # normalised, so big models are not penalised
    scale = min(1.0, limit / norm) if norm > 0 else 1.0
    return [[round(v * scale, 12) for v in shard] for shard in shards]
