"""The trainer's training, replayed by hand in numpy: the oracle of the trainer's report.

Each rank keeps its contiguous slice of the weights and its own copy of the
replicated bias b2 (a per-rank bug makes the copies drift apart, as on real
ranks); the loss and gradient are the model's (tested on their own against
finite differences). It never uses the trainer's loop, report or gclip.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from gclip import train


@cache
def replay(ranks: int, mode: str, steps: int, limit: float, seed: int = 0, lr: float = 1.0) -> dict:
    """Per step: losses, the norm each rank used, the true global norm, the update's norm, its
    cosine with the gradient, how many ranks scaled down; and the final loss."""
    x, y = train.make_data(seed)
    flat, b2 = train.init_params(seed)
    n = flat.size
    cuts = [slice(n * r // ranks, n * (r + 1) // ranks) for r in range(ranks)]
    assert [c.stop - c.start for c in cuts] == [n // ranks] * ranks  # 96 weights split evenly
    copies = [b2.copy() for _ in range(ranks)]
    out: dict = {"losses": [], "used": [], "true": [], "update": [], "cosine": [], "scaled": []}
    for _ in range(steps):
        views = [train.loss_and_grad(flat, c, x, y) for c in copies]
        shards = [views[r][1][cuts[r]] for r in range(ranks)]
        biases = [v[2] for v in views]
        raw = np.concatenate([*shards, biases[0]])
        true = math.sqrt(float(raw @ raw))
        if mode == "global":
            used = [true] * ranks
        elif mode == "per-rank":  # its own slice and its own copy of the bias
            used = [math.sqrt(float(s @ s) + float(b @ b)) for s, b in zip(shards, biases)]
        else:
            raise ValueError(mode)
        scales = [min(1.0, limit / u) for u in used]
        update = np.concatenate([s * k for s, k in zip(shards, scales)] + [biases[0] * scales[0]])
        out["losses"].append(views[0][0])
        out["used"].append(used)
        out["true"].append(true)
        out["update"].append(float(np.linalg.norm(update)))
        out["cosine"].append(float(update @ raw / (np.linalg.norm(update) * np.linalg.norm(raw))))
        out["scaled"].append(sum(k < 1 for k in scales))
        for r in range(ranks):
            flat[cuts[r]] -= lr * scales[r] * shards[r]
            copies[r] = copies[r] - lr * scales[r] * biases[r]
    out["final"] = train.loss_and_grad(flat, copies[0], x, y)[0]
    return out
