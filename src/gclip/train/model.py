"""The model: a 2-layer MLP on a 3-class spiral, pure functions of the full parameters.

The same on every rank: the data and the first draw of the weights depend on
the seed only, whatever the rank count.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "CLASSES",
    "HIDDEN",
    "POINTS_PER_CLASS",
    "Model",
    "init_params",
    "loss_and_grad",
    "make_data",
    "shard_bounds",
]

HIDDEN = 16
CLASSES = 3
POINTS_PER_CLASS = 100


class Model(NamedTuple):
    """Shapes of the sharded flat vector (W1, b1, W2) and the replicated bias b2."""

    inputs: int = 2
    hidden: int = HIDDEN
    classes: int = CLASSES

    @property
    def flat_size(self) -> int:
        return self.inputs * self.hidden + self.hidden + self.hidden * self.classes

    def unpack(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i, h, c = self
        w1 = flat[: i * h].reshape(i, h)
        b1 = flat[i * h : i * h + h]
        w2 = flat[i * h + h :].reshape(h, c)
        return w1, b1, w2


def make_data(seed: int, per_class: int = POINTS_PER_CLASS) -> tuple[np.ndarray, np.ndarray]:
    """A noisy 3-arm spiral: not linearly separable, so the hidden layer has work to do."""
    rng = np.random.default_rng([seed, 1])
    xs, ys = [], []
    for k in range(CLASSES):
        r = np.linspace(0.1, 1.0, per_class)
        t = np.linspace(k * 4.0, (k + 1) * 4.0, per_class) + rng.normal(0.0, 0.25, per_class)
        xs.append(np.column_stack([r * np.sin(t), r * np.cos(t)]))
        ys.append(np.full(per_class, k))
    return np.concatenate(xs) * 2.0, np.concatenate(ys)


def init_params(seed: int, model: Model | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(flat W1|b1|W2, b2): the same draw on every rank, whatever R."""
    model = model or Model()
    rng = np.random.default_rng([seed, 2])
    w1 = rng.normal(0.0, 1.0, (model.inputs, model.hidden))
    b1 = np.zeros(model.hidden)
    w2 = rng.normal(0.0, 1.0 / math.sqrt(model.hidden), (model.hidden, model.classes))
    return np.concatenate([w1.ravel(), b1, w2.ravel()]), np.zeros(model.classes)


def loss_and_grad(
    flat: np.ndarray, b2: np.ndarray, x: np.ndarray, y: np.ndarray, model: Model | None = None
) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy and its gradient w.r.t. (flat, b2)."""
    model = model or Model()
    w1, b1, w2 = model.unpack(flat)
    n = x.shape[0]
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -float(logp[np.arange(n), y].mean())
    d = np.exp(logp)
    d[np.arange(n), y] -= 1.0
    d /= n
    gw2 = h.T @ d
    gb2 = d.sum(axis=0)
    dh = (d @ w2.T) * (1.0 - h * h)
    gw1 = x.T @ dh
    gb1 = dh.sum(axis=0)
    return loss, np.concatenate([gw1.ravel(), gb1, gw2.ravel()]), gb2


def shard_bounds(n: int, ranks: int) -> tuple[list[int], list[int]]:
    """(counts, displacements) of n elements split into contiguous, near-equal slices."""
    counts = [n // ranks + (r < n % ranks) for r in range(ranks)]
    displs = [sum(counts[:r]) for r in range(ranks)]
    return counts, displs
