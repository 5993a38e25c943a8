"""The gallery's bugs of the limits (``gclip.limits``): adaptive, unit-wise and per-group clips.

These bugs live over more than one call (an adaptive clipper's history) or more than one
limit (units, groups), so they are not strategies of the one-call program
(``gclip.gallery.bugs``): the judge grades them on a recorded run
(:mod:`gclip.conformance.limits`), the audit names the adaptive ones in a real training step
(``gclip.audit --adaptive``). ``kind`` says what goes wrong: the norm an adaptive limit is fed
(``adaptive``), the units of a unit-wise limit (``unit``), or how the training loop applies
the limit to its groups (``usage``: the clip is right, its scope is not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .bugs import card

__all__ = [
    "ADAPTIVE_LOCAL",
    "AGC_SHARDS",
    "LIMIT_BUGS",
    "LIMIT_BUG_NAMES",
    "MUON_GLOBAL",
    "ZCLIP_WORLD",
    "LimitBug",
]

ADAPTIVE_LOCAL = "adaptive-local-norm"
ZCLIP_WORLD = "zclip-world-sum"
AGC_SHARDS = "agc-shard-units"
MUON_GLOBAL = "muon-global-clip"


@dataclass(frozen=True)
class LimitBug:
    """A bug of a clip's limit, with where it was seen and the layout it shows on."""

    name: str
    summary: str
    incident: str
    explanation: str
    kind: str  # "adaptive", "unit" or "usage"
    shows_on: str

    def as_dict(self) -> dict[str, Any]:
        return card(self, kind=self.kind, shows_on=self.shows_on)


LIMIT_BUGS: tuple[LimitBug, ...] = (
    LimitBug(
        ADAPTIVE_LOCAL,
        "an adaptive clipper (ZClip, AutoClip) fed each rank's local norm: its history drifts per rank",
        "bluorion-com/ZClip zclip.py (its distributed branch recognises FSDP1 modules only; FSDP2 and "
        "DTensor gradients take the non-distributed branch, the norm of the rank's own shards)",
        "The threshold is a function of the norms seen so far. Fed the rank's own shard norm, each "
        "rank keeps a history of its own: the ranks' means, variances and percentiles drift apart, "
        "they flag spikes on different steps and scale their shards by different factors, so the "
        "update's direction changes and a spike that only some shards carry goes through elsewhere. "
        "Feed the clipper the global norm (one all-reduce, the same float on every rank).",
        "adaptive",
        "fsdp2",
    ),
    LimitBug(
        ZCLIP_WORLD,
        "ZClip's FSDP branch sums the squares over the whole world: under HSDP the replicas are counted",
        "bluorion-com/ZClip zclip.py (_compute_grad_norm: the local sums of squares all-reduced over the "
        "default group, whatever the FSDP sharding strategy)",
        "Under HSDP each shard is held by every replica group: an all-reduce over the world adds it "
        "once per replica, so the norm is sqrt(replicas) times too large (TP-replicated tensors are "
        "counted tp times). ZClip's z-score is free of scale, so a uniform inflation leaves its spike "
        "decisions alone; what it moves is every comparison with a number: the max_grad_norm cap, and "
        "the warmup's fixed clip, fire sqrt(replicas) times too early (and where only some tensors "
        "are replicated, the mix and with it the z-scores change). The scale is the same on every "
        "rank, so the direction is kept. Reduce over the shard group only, or read the placements.",
        "adaptive",
        "hsdp",
    ),
    LimitBug(
        AGC_SHARDS,
        "AGC on a row-parallel shard: each shard clipped by its own part of the unit's norm",
        "timm utils/agc.py (unitwise_norm reduces the tensor it is given over dims 1..n, with no process "
        "group: given a row-parallel Linear's local slice it returns the slice's part of each row)",
        "A unit of AGC is a row of a Linear weight. A row-parallel Linear (TP Shard(1)) holds a slice "
        "of every row on each rank: each slice's weight and gradient norms are parts of the row's, so "
        "each rank compares its own ratio with the limit, clips on its own, and the row's pieces get "
        "different factors, or none. Sum the units' squares over the ranks that split them.",
        "unit",
        "tp (Shard(1))",
    ),
    LimitBug(
        MUON_GLOBAL,
        "one clip over every parameter group, Muon's included, where each group needs its own",
        "DeepSpeed #8439 (open: the default gradient_clipping=1.0 divides every Muon update by its own "
        "norm, 4.22x at hidden 128 to 85.6x at 8192); Megatron-LM PR #5395 (open: one global clip over "
        "the Muon model, a clip coefficient near 2e-8, training frozen)",
        "Muon orthogonalises its gradients, so their norm says nothing a clip should act on; one global "
        "clip over every group still lets the weights' large norm shrink every other group's gradient "
        "(measured in docs/limits.md: the biases' step 2.8x to 7.3x smaller at hidden 64 to 1024), and "
        "a clip after the orthogonalisation divides Muon's update by its own norm (11.6x to 42x). Clip "
        "per group: gclip.torch.clip_groups_(opt.param_groups, [None, 1.0]).",
        "usage",
        "any (one process too)",
    ),
)

LIMIT_BUG_NAMES: dict[str, LimitBug] = {b.name: b for b in LIMIT_BUGS}
