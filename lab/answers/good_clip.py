"""The answer to exercise 4 of the gclip lab: lab/my_clip.py, fixed.

    python -m gclip.conformance lab/answers/good_clip.py:clip_shards

Each rank reduces its shard to ONE number, its sum of squares (phase 1); the
sum over every rank of those numbers is what one all-reduce gives each rank
(phase 2); every rank takes the square root of the same total and applies the
same scale (phase 3).
"""

import math


def clip_shards(shards, limit):
    local = [math.fsum(v * v for v in shard) for shard in shards]  # 1. local: one number per rank
    norm = math.sqrt(math.fsum(local))  # 2. all-reduce (SUM), then the root
    scale = min(1.0, limit / norm) if norm > 0 else 1.0  # 3. the same scale on every rank
    return [[round(v * scale, 12) for v in shard] for shard in shards]


solve = clip_shards  # the judge's default function name
