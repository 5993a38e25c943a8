"""The gallery of bugs: how a global-norm clip goes wrong, each with where it was seen.

Each bug is the correct clip (local -> combine -> finish -> scale) departing from it
in the fields that make one idea (typed, so a typo is an error, not a new behaviour);
``gclip.gallery.program`` runs it as the lab's own program over the core's drivers
and local sums:

``scope``            whose sums combine: every rank's (``ALL``), this rank's only
                     (``SELF``: the seed's per-rank clip), or rank 0's (``ROOT``).
``share``            what a rank contributes: its sum of |x|**p (``POWER``) or its
                     local norm (``NORM``), which ``norm_op`` combines (SUM or MAX).
``finish_norm``      combined number -> the norm (sqrt, divide by the count...).
``epsilon``          the scale is ``max_norm / (norm + epsilon)``.
``local_epsilon``    added to each rank's own norm before the norms combine (as the p-norm of
                     the ranks' norms): a DTensor's Partial norm plus a Python float.
``count_replicated`` replicated tensors are counted on every rank.
``accumulate``       the dtype the local sum of squares is accumulated in.
``untouched_if_nonfinite`` gclip leaves gradients alone when the norm is inf/NaN;
                     frameworks compute max_norm / inf = 0 and wipe them.
``nan_if_nonfinite`` an inf/NaN norm masked by arithmetic (0 x inf = NaN): the scale is
                     NaN and every gradient becomes NaN.
``total_dtype``      the dtype the combined sum is cast to (float32: it overflows above a
                     norm of 1.8e19, where the float64 sum does not).
``data_scale``       the demo's default data times this: a bug that shows only on an
                     overflow is shown on data that overflows.

So sum-of-norms is (share NORM, norm_op SUM), max-of-norms (share NORM,
norm_op MAX), mean-of-norms adds a finish that divides by the ranks, and
fp16-sumsq accumulates in float16 and, as frameworks do, wipes a gradient
whose norm overflowed.

The same table drives the lab's entry (``gclip.gallery``'s ``mode=``), the
demo (``--buggy NAME``), the conformance judge (which names the bug an
implementation has), the trainer and the bench. The layout bugs (a correct
clip told the wrong layout) and the usage bugs (a correct clip called at the
wrong moment) are here too.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import policy
from ..engine import NormOp
from ..errors import GclipValueError
from .usage_bugs import USAGE_BUG_NAMES, USAGE_BUGS, UsageBug

__all__ = [
    "BUGS",
    "GLOBAL",
    "LAYOUT_BUGS",
    "LAYOUT_BUG_NAMES",
    "STRATEGIES",
    "TORCH_EPS",
    "USAGE_BUGS",
    "USAGE_BUG_NAMES",
    "Accumulate",
    "LayoutBug",
    "NormOp",
    "Scope",
    "Share",
    "Strategy",
    "UsageBug",
    "card",
    "exact_norm",
    "get",
    "unknown",
]

TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ and Megatron-LM: max_norm / (norm + 1e-6)


class Scope(enum.Enum):
    ALL = "all"
    SELF = "self"
    ROOT = "root"


class Share(enum.Enum):
    POWER = "power"
    NORM = "norm"


class Accumulate(enum.Enum):
    FLOAT64 = "float64"
    FLOAT16 = "float16"


def exact_norm(norm: float, **_: object) -> float:
    """The correct finish: the combined norm as it is."""
    return norm


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cheap cache key
class Strategy:
    name: str
    summary: str
    incident: str = ""
    explanation: str = ""
    scope: Scope = Scope.ALL
    share: Share = Share.POWER
    finish_norm: Callable[..., float] = field(default=exact_norm, repr=False)
    epsilon: float = 0.0
    local_epsilon: float = 0.0  # each rank's norm + this, then the p-norm of the ranks' norms
    count_replicated: bool = False
    accumulate: Accumulate = Accumulate.FLOAT64
    norm_op: NormOp = NormOp.SUM  # with share NORM: how local norms combine
    untouched_if_nonfinite: bool = True  # False: scale = max_norm / inf = 0, as frameworks do
    norm_type: float | None = None  # the norm type that makes the bug show (inf-pow: inf)
    nan_if_nonfinite: bool = False  # an inf/NaN norm becomes a NaN scale (0 x inf in a mask)
    total_dtype: str = "float64"  # the combined sum cast to this dtype before its root
    data_scale: float = 1.0  # the demo's default data times this (the data the bug shows on)

    def __post_init__(self) -> None:
        for name, kind in (
            ("scope", Scope),
            ("share", Share),
            ("norm_op", NormOp),
            ("accumulate", Accumulate),
        ):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"Strategy {self.name!r}: {name} must be a {kind.__name__}")

    @property
    def correct(self) -> bool:
        return self.name == "global"

    def enters(self, rank: int) -> bool:
        """Does this rank's partial enter the combine? (scope root: rank 0's only)."""
        return self.scope is Scope.ALL or (self.scope is Scope.ROOT and rank == 0)

    @property
    def has_epsilon(self) -> bool:
        """Does this bug add an epsilon of its own (so torch's is not added again)?"""
        return self.epsilon > 0 or self.local_epsilon > 0

    @property
    def finishes(self) -> bool:
        """Does this bug change the combined norm before the scale?"""
        return self.finish_norm is not exact_norm or self.total_dtype != "float64"

    def finish(
        self, norm: float, *, p: float, count: int, ranks: int, power: tuple[float, int] | None = None
    ) -> float:
        if self.total_dtype != "float64" and math.isfinite(norm) and math.isfinite(p):
            if norm > float(np.finfo(self.total_dtype).max) ** (1.0 / p):  # its sum of |x|^p overflows
                norm = math.inf
        if self.finish_norm is exact_norm:  # the common case, without the keyword call
            return norm
        return self.finish_norm(norm=norm, p=p, count=count, ranks=ranks, power=power)

    def scale(self, norm: float, max_norm: float) -> float:
        """The scale rule (``gclip.policy``) on norm + epsilon; a framework's
        max_norm / inf = 0 where it does not leave a non-finite gradient alone."""
        if not math.isfinite(norm) and self.nan_if_nonfinite:
            return math.nan
        if not math.isfinite(norm) and not self.untouched_if_nonfinite:
            return min(1.0, max_norm / (norm + self.epsilon))
        return policy.scale(norm + self.epsilon, max_norm)

    def as_dict(self) -> dict[str, Any]:
        return card(self, norm_type=self.norm_type)


def card(bug: Any, **more: Any) -> dict[str, Any]:
    """A gallery entry as a dict: name, summary, where it was seen, why it is wrong (and more)."""
    return {
        "name": bug.name,
        "summary": bug.summary,
        "incident": bug.incident,
        "explanation": bug.explanation,
        **more,
    }


def _rms(*, norm: float, p: float, count: int, power: tuple[float, int] | None, **_: object) -> float:
    if not count:
        return 0.0
    if power is not None and power[1] == 0 and math.isfinite(p):
        mant = power[0] / count
        return math.sqrt(mant) if p == 2.0 else float(mant ** (1.0 / p))
    return norm / math.pow(count, 1.0 / p)


def _mean(*, norm: float, ranks: int, **_: object) -> float:
    return norm / ranks


def _pow_inf(*, norm: float, p: float, **_: object) -> float:
    # total ** (1 / norm_type) with norm_type = inf is total ** 0 == 1.0
    return norm ** (1.0 / p) if math.isinf(p) else norm


GLOBAL = Strategy(
    "global",
    "the global norm: local sums of |x|^p, one all-reduce, the same scale on every rank",
    explanation="Each rank sums the squares of its own shard; one all-reduce adds them up; every "
    "rank takes the square root of the same total and applies the same scale.",
)

BUGS: tuple[Strategy, ...] = (
    Strategy(
        "per-rank",
        "each rank clips its shard by its own local norm",
        incident="the incident report this project grew from: each shard clipped by its own norm",
        explanation="No all-reduce: each shard ends at most at the limit, so the whole gradient "
        "reaches sqrt(R) x limit, and shards get different scales, so its direction changes.",
        scope=Scope.SELF,
    ),
    Strategy(
        "rms",
        "the global root-mean-square instead of the L2 norm",
        incident="the incident report this project grew from: its failed fix (an RMS, not a norm)",
        explanation="Dividing the global sum of squares by the element count gives the RMS, "
        "sqrt(N) times smaller than the norm: the gradient is clipped far too little.",
        finish_norm=_rms,
    ),
    Strategy(
        "sum-of-norms",
        "local norms all-reduced with SUM instead of the squares",
        incident="fastmoe PR #65 (review: the all_reduce must add the squared norms, not the norms)",
        explanation="sqrt(a^2 + b^2) <= a + b: adding norms overestimates the global norm (up to "
        "sqrt(R) times), so the gradient is clipped too hard.",
        share=Share.NORM,
    ),
    Strategy(
        "mean-of-norms",
        "local norms averaged over ranks",
        incident="DeepSpeed #8475 (AutoEP FP32 clipping averages rank-local norms across ranks that own "
        "different experts)",
        explanation="The mean of the R local norms is between sqrt(R) and R times below the global "
        "norm, so clipping starts too late and clips too little.",
        share=Share.NORM,
        finish_norm=_mean,
    ),
    Strategy(
        "rank0-norm",
        "rank 0's local norm used by every rank",
        incident="",  # no public incident confirmed: a teaching example
        explanation="The scale is the same everywhere, but computed from one shard: the other "
        "shards' contribution is missing, so the gradient is clipped too little.",
        scope=Scope.ROOT,
    ),
    Strategy(
        "max-of-norms",
        "local norms all-gathered and the largest one taken",
        incident="",  # no public incident confirmed: a teaching example
        explanation="The largest shard norm is below the global norm whenever another shard is "
        "non-zero: the gradient is clipped too little.",
        share=Share.NORM,
        norm_op=NormOp.MAX,
    ),
    Strategy(
        "epsilon",
        "max_norm / (norm + 1e-6), as PyTorch and Megatron-LM do",
        incident="torch.nn.utils.clip_grad_norm_ and Megatron-LM clip_grads: clip_coef = "
        "max_norm / (total_norm + 1e-6)",
        explanation="The epsilon avoids a division by zero but moves every scale by ~1e-6/norm: "
        "the clipped norm is slightly below the limit, and not the exact contract.",
        epsilon=TORCH_EPS,
    ),
    Strategy(
        "double-count",
        "replicated tensors summed over every rank",
        incident="pytorch PR #88955 (FSDP NO_SHARD: each gradient counted world_size times)",
        explanation="Tensors replicated on R ranks (biases, norms under tensor parallelism) enter "
        "the all-reduce R times: their share of the norm is counted R times over.",
        count_replicated=True,
    ),
    Strategy(
        "inf-pow",
        "the inf-norm computed as total ** (1 / inf)",
        incident="torchrec PR #3199 (FSDP2 inf-norm: total ** (1 / inf) is always 1.0)",
        explanation="x ** (1/inf) = x ** 0 = 1.0 whatever the gradient: the inf-norm always reads 1, "
        "so the gradient is clipped as if its largest entry were 1.",
        finish_norm=_pow_inf,
        norm_type=math.inf,
    ),
    Strategy(
        "fp16-sumsq",
        "the sum of squares accumulated in float16",
        incident="fairscale PR #263 (fp16: 5000**2 overflows, the norm is inf); pytorch #46849 (an inf "
        "norm silently zeroes the gradients)",
        explanation="float16 overflows at 65504: a sum of squares above it becomes inf, the scale "
        "max_norm / inf becomes 0 and the step's gradient is wiped out (or skipped).",
        accumulate=Accumulate.FLOAT16,
        untouched_if_nonfinite=False,
    ),
    Strategy(
        "nan-mask",
        "an overflowing norm masked by arithmetic: 0 x inf makes every gradient NaN",
        incident="DeepSpeed PR #7171 (ZeRO-1/2's get_grad_norm_direct: total_norm = inf_or_nan * err + "
        "inf_or_nan.logical_not() * total_norm is NaN for an inf norm; fixes issue #5242, grad_norm and "
        "loss NaN)",
        explanation="The mask was meant to turn an inf norm into -1 (skip the clip), but 0 x inf is NaN: "
        "the norm stays NaN, the scale becomes NaN and every gradient is NaN. It shows only when the "
        "norm overflows (here the total is cast to float32, which overflows above 1.8e19, as DeepSpeed's "
        "is): --buggy shows it on the default data times 1e18.",
        total_dtype="float32",
        nan_if_nonfinite=True,
        data_scale=1e18,
    ),
    Strategy(
        "epsilon-per-rank",
        "torch's 1e-6 added to each rank's own norm of a Partial norm, not once to the total",
        incident="pytorch #149768 (FSDP2/DTensor: in clip_coef = max_norm / (total_norm + 1e-6) each "
        "rank adds 1e-6 to its local value of the Partial norm instead of adding it once; closed, "
        "torch 2.13 reduces the norm before the add)",
        explanation="The Partial norm's ranks each hold their own norm n_r; adding 1e-6 to it on every "
        "rank before the reduction gives sqrt(sum (n_r + 1e-6)^2), up to sqrt(R) x 1e-6 above the norm: "
        "torch's epsilon counted up to sqrt(R) times. The scale is the same on every rank and off only by "
        "~sqrt(R) x 1e-6 / norm: far off only for tiny norms.",
        local_epsilon=TORCH_EPS,
    ),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (GLOBAL, *BUGS)}


# ---------------------------------------------------------------------------
# layout bugs: a correct global clip, told the wrong layout


@dataclass(frozen=True)
class LayoutBug:
    """A bug of parallel layouts: the clip itself is right, what it is told is wrong.

    Real frameworks get layouts wrong in what they declare (a copy declared as
    a shard, a shard as a copy, a tie forgotten), over which ranks they reduce
    (one pipeline stage, one expert group), what they leave out (the experts),
    or whether a rank takes part at all. Each field is one of those, applied to
    every tensor's :class:`gclip.layout.Placement`:

    ``drop``     axes removed from where copies are declared identical: copies
                 along them count once each (summed as if they were shards).
    ``add``      axes added to a sharded tensor's copies: its shards along them
                 count on one rank only (the others' shards are missed).
    ``untie``    a tensor tied across stages is counted on each stage.
    ``apart``    the all-reduce leaves out this axis: ranks that differ along it
                 never combine, each slice clips by its own norm.
    ``omit``     tensors sharded along this axis are scaled but not counted.
    ``within``   ``drop`` and ``add`` apply only to tensors sharded along this axis (the experts).
    ``split``    tensors sharded along this axis and the others are two clips: each set is
                 clipped by its own global norm (two optimizers, each with its own clip).
    ``mp_rank0`` tensors duplicated over tp are counted on model-parallel rank 0 only (rank 0 of
                 tp x pp, where tensor-parallel rank 0 was meant): those of every pipeline stage but
                 the first are scaled but not counted.
    ``skips_collective`` a rank with nothing to clip returns before the all-reduce.
    ``shows_on`` a layout where the bug shows (the lab demonstrates it there).
    """

    name: str
    summary: str
    incident: str
    explanation: str
    drop: tuple[str, ...] = ()
    add: tuple[str, ...] = ()
    untie: bool = False
    apart: str | None = None
    omit: str | None = None
    skips_collective: bool = False
    within: str | None = None
    split: str | None = None
    mp_rank0: bool = False
    shows_on: str = "pp=2,dp=2,tp=2"

    def declare(self, placement: Any) -> Any:
        """The placement this bug declares for a tensor that lies at ``placement``."""
        mine = self.within is None or self.within in placement.sharded
        drop, add = (self.drop, self.add) if mine else ((), ())
        reps = tuple(a for a in placement.replicated if a not in drop and a != self.apart)
        reps += tuple(a for a in add if a in placement.sharded and a not in reps)
        tied = None if self.untie or placement.tied == self.apart else placement.tied
        return placement._replace(replicated=reps, tied=tied)

    def omits(self, shape: Any) -> bool:
        """Whether on a mesh of this ``shape`` some tensors are scaled but not counted."""
        return (self.omit is not None and self.omit in shape) or (self.mp_rank0 and shape.get("pp", 1) > 1)

    def left_out(self, placement: Any, coords: Any) -> bool:
        """Whether a tensor at ``placement``, on the rank at ``coords``, is scaled but not counted."""
        if self.omit is not None and self.omit in placement.sharded:
            return True
        duplicate = "tp" in placement.replicated and not placement.sharded
        return self.mp_rank0 and duplicate and coords.get("pp", 0) != 0

    def as_dict(self) -> dict[str, Any]:
        return card(self, shows_on=self.shows_on)

    def axes(self) -> set[str]:
        """The axes this bug acts on: it changes nothing unless each is in the mesh, > 1."""
        named = (self.apart, self.omit, self.within, self.split)
        staged = {"pp"} if self.untie or self.mp_rank0 else set()
        return {*self.drop, *self.add, *(a for a in named if a)} | staged


LAYOUT_BUGS: tuple[LayoutBug, ...] = (
    LayoutBug(
        "dp-replicas-summed",
        "data-parallel replicas summed as if they were shards",
        "twinkle PR #290 (pure DDP: a norm of 0.8 reported as 1.131 on 2 ranks); VeOmni #184 (HSDP: "
        "the norm reduced over the replicas too)",
        "Every DP replica holds the same gradient, so adding their squares counts the model dp times: "
        "the norm comes out sqrt(dp) times too large and the gradient is clipped too hard. The scale is "
        "the same on every rank, so the direction is kept: the step is too short.",
        drop=("dp",),
    ),
    LayoutBug(
        "tp-duplicates-summed",
        "tensors duplicated on every TP rank (norms, biases) counted tp times",
        "NeMo RL PR #3788 (TP-replicated gradients counted tp_size times); ROCm TransformerEngine "
        "PR #715 (replicated weights marked tensor-parallel: 1.36-1.52x the norm at TP=8)",
        "Layer norms and biases are whole on every TP rank: summing each rank's copy counts them tp "
        "times, so their share is inflated: the norm grows by sqrt(1 + (tp - 1) d), d their share of the "
        "sum of squares, and clipping fires too early. It grows with tp and with d (wider norms, more of "
        "them): on the lab's model d is about 1%, under --model incidents 16% (1.08x at tp = 2, 1.22x at "
        "tp = 4, 1.46x at tp = 8). The scale is the same on every rank, so the direction is kept.",
        drop=("tp",),
    ),
    LayoutBug(
        "tp-rank0-only",
        "only tensor-parallel rank 0's shards counted",
        "DeepSpeed PR #5411 (TP and non-TP parameters in one group: only tp_rank 0's gradients in the "
        "norm, about 2x off at TP=4)",
        "Treating TP shards as copies counts only rank 0's shard of each weight: the other shards are "
        "missing, the norm is too small and the gradient is clipped too little. The scale is the same "
        "on every rank, so the direction is kept: the step is too long.",
        add=("tp",),
    ),
    LayoutBug(
        "duplicates-on-mp-rank0-only",
        "tensors duplicated over tp (norms, biases) counted on model-parallel rank 0 only",
        "DeepSpeed issue #1839 (open: clip_grad_norm_ does not handle model parallelism correctly, it "
        "uses get_model_parallel_rank() instead of bwc_tensor_model_parallel_rank())",
        "The duplicates should count on tensor-parallel rank 0 of each stage; asking for the "
        "model-parallel rank (tp x pp) counts them on the first stage only, so the layer norms and "
        "biases of every other stage are missing: the norm is too small and the gradient is clipped "
        "too little. The scale is the same on every rank, so the direction is kept: the step is too "
        "long.",
        mp_rank0=True,
    ),
    LayoutBug(
        "pp-stages-apart",
        "each pipeline stage clips by its own norm",
        "torchtitan #596 (clip_grad_norm_ sees only the current stage), fixed by PR #649 (an extra "
        "all-reduce over the pipeline mesh)",
        "Each stage holds different layers; without a reduction across stages every stage computes "
        "the norm of its own layers and applies its own scale: each stage's part ends at the limit, so "
        "the whole update reaches up to sqrt(pp) x the limit. The direction changes only as much as the "
        "stages' scales differ: stages of similar norms (as on the lab's model) keep it almost exactly. "
        "The tied embedding's copies on the first and last stage get different scales and drift apart.",
        apart="pp",
    ),
    LayoutBug(
        "tied-counted-twice",
        "an embedding tied between the first and last stage counted on both",
        "Megatron-LM PR #7227 (Megatron-FSDP with PP=2: 40 instead of 28.28, the shared weight counted "
        "on both stages)",
        "The embedding and the output head are one tensor living on two stages: counting both copies "
        "adds its squares twice and inflates the norm: it grows by sqrt(1 + s), s the embedding's share "
        "of the sum of squares, which a large vocabulary makes large. On the lab's model s is about 2%, "
        "under --model incidents 50% (1.22x); a tied weight that is the whole gradient gives sqrt(2). "
        "The scale is the same on every rank, so the direction is kept: the gradient is clipped too "
        "hard.",
        untie=True,
    ),
    LayoutBug(
        "ep-groups-apart",
        "each expert-parallel group clips by its own norm",
        "NeMo Automodel #3816 (a different 'global' norm on every EP group: 40.20 and 4.02; shared "
        "weights drift apart)",
        "Ranks of different expert groups hold different experts but the same dense weights; without "
        "a reduction across the groups each applies its own scale, and the copies of the dense "
        "weights, identical until then, drift apart. Each group's part ends at the limit, so the "
        "update reaches up to sqrt(ep) x the limit; groups of similar norms keep the direction almost "
        "exactly, yet the ranks no longer hold the same model.",
        apart="ep",
        shows_on="dp=2,ep=2,tp=2",
    ),
    LayoutBug(
        "experts-left-out",
        "expert gradients scaled but left out of the norm",
        "DeepSpeed PR #8613 (unfused fp16 optimizer: expert gradients dropped, 6.0 instead of 10.0)",
        "The norm covers the dense weights only, so it is too small and the experts, often most of "
        "a mixture-of-experts model, are clipped too little. The scale is the same on every rank, so "
        "the direction is kept: the step is too long.",
        omit="ep",
        shows_on="dp=2,ep=2,tp=2",
    ),
    LayoutBug(
        "expert-tp-shards-dropped",
        "expert weights sharded over tp counted on tp-rank 0 only",
        "Megatron-LM PR #5916 (EP > 1 and TP > 1: expert weights not marked tensor-parallel, so the norm "
        "omits the expert shards held on tp-ranks > 0)",
        "The experts' tp shards are taken for copies: only tp-rank 0's shard of each expert counts, the "
        "others are missing, so the norm is too small and the gradient is clipped too little. The scale "
        "is the same on every rank, so the direction is kept: the step is too long.",
        add=("tp",),
        within="ep",
        shows_on="dp=2,ep=2,tp=2",
    ),
    LayoutBug(
        "dense-expert-apart",
        "dense and expert gradients clipped by separate norms",
        "Megatron-LM commit abf10f85 (fix dual-optimizer gradient clipping: before it ChainedOptimizer "
        "stepped its dense and expert optimizers one by one, each clipping by its own norm); Megatron-LM "
        "#785 (the two optimizers perform grad-norm for their own parameters)",
        "The dense weights and the experts each end at the limit, so the whole update reaches up to "
        "sqrt(2) x the limit, and the two parts get different scales: the direction changes.",
        split="ep",
        shows_on="dp=2,ep=2,tp=2",
    ),
    LayoutBug(
        "skip-collective",
        "a rank with nothing to clip returns before the all-reduce: the others wait forever",
        "AReaL PR #1139 (ranks with no gradients returned early from the norm; ranks with gradients "
        "hung in the all_reduce)",
        "An all-reduce completes only when every rank enters it. A rank that holds no gradient this "
        "step must still contribute zero: returning early leaves every other rank waiting.",
        skips_collective=True,
    ),
)

LAYOUT_BUG_NAMES: dict[str, LayoutBug] = {b.name: b for b in LAYOUT_BUGS}


def get(name: str) -> Strategy:
    """The strategy called ``name``, or a one-line error listing the choices."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise GclipValueError(unknown(name)) from None


def unknown(name: Any) -> str:
    """The error message for a mode that is not in the gallery."""
    return f"unknown mode {name!r}; choose from {', '.join(STRATEGIES)}"
