"""What one clip over Muon's and AdamW's groups does, against a limit per group.

    python examples/muon_groups.py [--hidden 64 128 256 512]

One step of a model of 4 square Linear layers (weights: Muon, Newton-Schulz orthogonalised
updates; biases: plain SGD standing in for AdamW's group), lr 0.02, the same seeded batch,
measured three ways (DeepSpeed #8439's set-up, on one process):

- ``none``: no clip;
- ``update``: the default ``gradient_clipping=1.0`` applied after Muon's orthogonalisation,
  as DeepSpeed's ZeRO 1/2 does: the update divided by its own norm;
- ``global``: one clip at 1.0 over every raw gradient: the weights' large norm scales
  the biases' gradients down too;
- ``groups``: ``gclip.torch.clip_groups_`` with no limit on Muon's group (its norm
  reported) and 1.0 on the biases', each by its own norm, in one all-reduce.

It prints, per hidden size, |dW| (the weights' step) and |db| (the biases' step) under each,
and the attenuations (none / clipped).
"""

from __future__ import annotations

import argparse
import json

import torch

import gclip.torch as gt

LR, LIMIT = 0.02, 1.0


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation (KellerJordan/Muon's zeropower_via_newtonschulz5), in float32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x


def grads(hidden: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(4)])
    model(torch.randn(2 * hidden, hidden)).square().mean().mul(hidden).backward()  # a full-rank gradient
    weights = [m.weight for m in model]
    biases = [m.bias for m in model]
    return weights, biases


def step(hidden: int, how: str) -> tuple[float, float]:
    """(|dW|, |db|) of one step under ``how``."""
    weights, biases = grads(hidden)
    if how == "global":
        torch.nn.utils.clip_grad_norm_([*weights, *biases], LIMIT)
    if how == "groups":
        gt.clip_groups_([weights, biases], [None, LIMIT])
    updates = [newton_schulz(w.grad) for w in weights]
    if how == "update":  # the clip after the orthogonalisation, over the whole update
        squares = [*(u.square().sum() for u in updates), *(b.grad.square().sum() for b in biases)]
        total = torch.sqrt(sum(squares))
        coef = min(1.0, LIMIT / float(total + 1e-6))
        updates = [u * coef for u in updates]
        for b in biases:
            b.grad.mul_(coef)
    dw = LR * torch.sqrt(sum(u.square().sum() for u in updates))
    db = LR * torch.sqrt(sum(b.grad.square().sum() for b in biases))
    return float(dw), float(db)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for h in args.hidden:
        got = {how: step(h, how) for how in ("none", "update", "global", "groups")}
        rows.append({"hidden": h, **{k: {"dW": v[0], "db": v[1]} for k, v in got.items()}})
    if args.json:
        print(json.dumps(rows))
        return
    print(
        "hidden  |dW| none  update (atten.)      global (atten.)     groups   "
        "|db| none   global (atten.)     groups (atten.)"
    )
    for r in rows:
        n, u, g, p = r["none"], r["update"], r["global"], r["groups"]
        print(
            f"{r['hidden']:6d}  {n['dW']:9.5f}  {u['dW']:9.5f} ({n['dW'] / u['dW']:6.2f}x)  "
            f"{g['dW']:9.5f} ({n['dW'] / g['dW']:6.2f}x)  {p['dW']:8.5f}  {n['db']:9.6f}  "
            f"{g['db']:9.6f} ({n['db'] / g['db']:6.1f}x)  {p['db']:9.6f} ({n['db'] / p['db']:5.1f}x)"
        )


if __name__ == "__main__":
    main()
