"""Exercise 4 of the gclip lab: fix this clip until the judge passes it.

Run the judge from the repository's root folder:

    python -m gclip.conformance lab/my_clip.py:clip_shards

``shards`` is one gradient cut into pieces, one list of numbers per rank (a
piece may be empty); ``limit`` is max_norm. Return the same pieces, each value
multiplied by min(1, limit / norm), where norm is the L2 norm of the WHOLE
gradient (a zero norm: scale 1), rounded to 12 decimals.

This version is the code of the incident report the lab starts from. Read it,
predict what the judge will say, run the judge, then fix it. Keep the loop
over the shards: on a real job each rank only ever sees its own shard.
"""

import math


def clip_shards(shards, limit):
    out = []
    for shard in shards:  # one iteration per rank
        norm = math.sqrt(sum(v * v for v in shard))
        scale = min(1.0, limit / norm) if norm > 0 else 1.0
        out.append([round(v * scale, 12) for v in shard])
    return out
