"""One table of strategies: the correct global-norm clip and the gallery of bugs.

Each strategy is local -> combine -> finish. A bug departs from the correct
one in the fields that make one idea (typed, so a typo is an error, not a new
behaviour):

``scope``            whose sums combine: every rank's (``ALL``), this rank's only
                     (``SELF``: the seed's per-rank clip), or rank 0's (``ROOT``).
``share``            what a rank contributes: its sum of |x|**p (``POWER``) or its
                     local norm (``NORM``), which ``norm_op`` combines (SUM or MAX).
``finish_norm``      combined number -> the norm (sqrt, divide by the count...).
``epsilon``          the scale is ``max_norm / (norm + epsilon)``.
``count_replicated`` replicated tensors are counted on every rank.
``accumulate``       the dtype the local sum of squares is accumulated in.
``untouched_if_nonfinite`` gclip leaves gradients alone when the norm is inf/NaN;
                     frameworks compute max_norm / inf = 0 and wipe them.

So sum-of-norms is (share NORM, norm_op SUM), max-of-norms (share NORM,
norm_op MAX), mean-of-norms adds a finish that divides by the ranks, and
fp16-sumsq accumulates in float16 and, as frameworks do, wipes a gradient
whose norm overflowed.

The same table drives the library (``mode=``), the demo (``--buggy NAME``),
the conformance judge (which names the bug an implementation has), the
trainer and the bench.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import GclipValueError

__all__ = [
    "BUGS",
    "GLOBAL",
    "STRATEGIES",
    "TORCH_EPS",
    "Accumulate",
    "NormOp",
    "Scope",
    "Share",
    "Strategy",
    "get",
]

TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ and Megatron-LM: max_norm / (norm + 1e-6)


class Scope(enum.Enum):
    ALL = "all"
    SELF = "self"
    ROOT = "root"


class Share(enum.Enum):
    POWER = "power"
    NORM = "norm"


class NormOp(enum.Enum):
    SUM = "sum"
    MAX = "max"


class Accumulate(enum.Enum):
    FLOAT64 = "float64"
    FLOAT16 = "float16"


def _exact(norm: float, **_: object) -> float:
    return norm


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    incident: str = ""
    explanation: str = ""
    scope: Scope = Scope.ALL
    share: Share = Share.POWER
    finish_norm: Callable[..., float] = field(default=_exact, repr=False)
    epsilon: float = 0.0
    count_replicated: bool = False
    accumulate: Accumulate = Accumulate.FLOAT64
    norm_op: NormOp = NormOp.SUM  # with share NORM: how local norms combine
    untouched_if_nonfinite: bool = True  # False: scale = max_norm / inf = 0, as frameworks do
    norm_type: float | None = None  # the norm type that makes the bug show (inf-pow: inf)

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

    def finish(
        self, *, norm: float, p: float, count: int, ranks: int, power: tuple[float, int] | None = None
    ) -> float:
        if self.finish_norm is _exact:  # the common case, without the keyword call
            return norm
        return self.finish_norm(norm=norm, p=p, count=count, ranks=ranks, power=power)

    def scale(self, norm: float, max_norm: float) -> float:
        """min(1, max_norm / norm); 1 for a zero norm; 1 (untouched) for inf/NaN."""
        if not math.isfinite(norm) and self.untouched_if_nonfinite:
            return 1.0
        denom = norm + self.epsilon
        if denom == 0.0:
            return 1.0
        return min(1.0, max_norm / denom)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "incident": self.incident,
            "explanation": self.explanation,
            "norm_type": self.norm_type,
        }


def _rms(*, norm: float, p: float, count: int, power: tuple[float, int] | None, **_: object) -> float:
    if not count:
        return 0.0
    if power is not None and power[1] == 0 and math.isfinite(p):
        mant = power[0] / count
        return math.sqrt(mant) if p == 2.0 else mant ** (1.0 / p)
    return norm / count ** (1.0 / p)


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
        incident="Failure Map FA-99266 (the seed record): shards clipped independently",
        explanation="No all-reduce: each shard ends at most at the limit, so the whole gradient "
        "reaches sqrt(R) x limit, and shards get different scales, so its direction changes.",
        scope=Scope.SELF,
    ),
    Strategy(
        "rms",
        "the global root-mean-square instead of the L2 norm",
        incident="Failure Map FA-99266: the failed fix",
        explanation="Dividing the global sum of squares by the element count gives the RMS, "
        "sqrt(N) times smaller than the norm: the gradient is clipped far too little.",
        finish_norm=_rms,
    ),
    Strategy(
        "sum-of-norms",
        "local norms all-reduced with SUM instead of the squares",
        incident="fastmoe PR #65 (review: all_reduce(grad_norm) must reduce the squared norms)",
        explanation="sqrt(a^2 + b^2) <= a + b: adding norms overestimates the global norm (up to "
        "sqrt(R) times), so the gradient is clipped too hard.",
        share=Share.NORM,
    ),
    Strategy(
        "mean-of-norms",
        "local norms averaged over ranks",
        incident="DeepSpeed #8475",
        explanation="The mean of the local norms is below the global norm (up to sqrt(R) times), "
        "so clipping starts too late and clips too little.",
        share=Share.NORM,
        finish_norm=_mean,
    ),
    Strategy(
        "rank0-norm",
        "rank 0's local norm used by every rank",
        incident="ms-swift #6815, fixed by PR #8341: under ZeRO-0 the reported grad_norm was one "
        "rank's local value",
        explanation="The scale is the same everywhere, but computed from one shard: the other "
        "shards' contribution is missing, so the gradient is clipped too little.",
        scope=Scope.ROOT,
    ),
    Strategy(
        "max-of-norms",
        "local norms all-gathered and the largest one taken",
        incident="fairscale PR #167 (review: all_gather of local norms, then torch.max)",
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
        incident="pytorch PR #88955, NeMo RL #3788",
        explanation="Tensors replicated on R ranks (biases, norms under tensor parallelism) enter "
        "the all-reduce R times: their share of the norm is counted R times over.",
        count_replicated=True,
    ),
    Strategy(
        "inf-pow",
        "the inf-norm computed as total ** (1 / inf)",
        incident="torchrec #3199",
        explanation="x ** (1/inf) = x ** 0 = 1.0 whatever the gradient: the inf-norm always reads 1, "
        "so the gradient is clipped as if its largest entry were 1.",
        finish_norm=_pow_inf,
        norm_type=math.inf,
    ),
    Strategy(
        "fp16-sumsq",
        "the sum of squares accumulated in float16",
        incident="fairscale #263, pytorch #46849 (norms that overflow in half precision)",
        explanation="float16 overflows at 65504: a sum of squares above it becomes inf, the scale "
        "max_norm / inf becomes 0 and the step's gradient is wiped out (or skipped).",
        accumulate=Accumulate.FLOAT16,
        untouched_if_nonfinite=False,
    ),
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (GLOBAL, *BUGS)}


def get(name: str) -> Strategy:
    """The strategy called ``name``, or a one-line error listing the choices."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise GclipValueError(f"unknown mode {name!r}; choose from {', '.join(STRATEGIES)}") from None
