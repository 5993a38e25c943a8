"""Every bound the gallery's explanations state holds on the demo's data, on 2..8 simulated ranks.

The explanations are what the demo and the judge print under "Why:". Each one
that states a bound or a relation between the norm a bug uses and the true
global norm is checked here, on the demo's own data (``--seed`` 0 and a few
other seeds, with and without the replicated bias), by running the bug with
``gclip.clip_simulated`` and comparing with an oracle computed independently
from the shards: ``math.fsum`` of squares, numpy norms, hand-derived formulas.
Each test also checks that the sentence it guards is still the one the gallery
prints, so an edited explanation cannot drift from its check.

The layout bugs' quantitative claims are checked the same way on the lab's
transformer laid out over simulated meshes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import gclip
import gclip.gallery
from gclip import Mesh, demo
from gclip._lab import transformer
from gclip.gallery import LAYOUT_BUG_NAMES, STRATEGIES

LIMIT = 1.0
BIAS = np.array([30.0, -40.0])  # the demo's replicated tensor (norm 50)


class Data:
    """The demo's gradient on R ranks, and the oracle's numbers for it."""

    def __init__(self, seed: int, ranks: int, bias: bool, factor: float = 1.0):
        self.ranks = ranks
        self.shards = [factor * demo.random_shard(seed, r, demo.options.DEFAULT_SIZE) for r in range(ranks)]
        self.bias = BIAS.copy() if bias else None
        sq = [math.fsum(float(v) * float(v) for v in s) for s in self.shards]
        self.bias_sq = math.fsum(float(v) ** 2 for v in BIAS) if bias else 0.0
        self.local = [math.sqrt(sq[0] + self.bias_sq)] + [math.sqrt(x) for x in sq[1:]]  # counted once
        self.own = [math.sqrt(x + self.bias_sq) for x in sq]  # each rank's shard and its bias copy
        self.local_sq = [sq[0] + self.bias_sq, *sq[1:]]
        self.norm = math.sqrt(math.fsum(sq) + self.bias_sq)
        self.count = sum(s.size for s in self.shards) + (BIAS.size if bias else 0)
        self.original = np.concatenate(self.shards + ([self.bias] if bias else []))

    def run(self, mode: str, norm_type: float = 2.0) -> tuple[list, np.ndarray]:
        grads = [[s.copy()] + ([self.bias.copy()] if self.bias is not None else []) for s in self.shards]
        flags = [False, True] if self.bias is not None else [False]
        res = gclip.gallery.clip_simulated(grads, LIMIT, mode=mode, norm_type=norm_type, replicated=flags)
        parts = [r.grads[0] for r in res] + ([res[0].grads[1]] if self.bias is not None else [])
        return res, np.concatenate(parts)


# (seed, ranks, bias): the cases on which the bounds can fail differently, each for its reason
CASES = {
    "demo": (0, 4, True),  # what `mpirun -n 4 python -m gclip.demo` prints: the explanations' own data
    "demo-nobias": (0, 4, False),  # nothing replicated: per-rank reaches its bound, double-count is harmless
    "fewest-ranks": (0, 2, True),  # R = 2: sqrt(R) and R closest, the tightest sum-/mean-of-norms bounds
    "most-ranks": (0, 8, False),  # R = 8: the widest bounds, rms's N largest, repeated shard norms
    "other-seed": (7, 3, True),  # another draw of the data and an odd R: bounds not fitted to seed 0
    "small-norms": (3, 2, False),  # every rank's sum of squares fits float16: fp16-sumsq's finite side
}


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def data(request) -> Data:
    return Data(*request.param)


def says(name: str, *phrases: str) -> None:
    """The explanation still states what the test checks."""
    text = " ".join(STRATEGIES[name].explanation.split())
    for phrase in phrases:
        assert phrase in text, (name, phrase, text)


def norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(x))


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_per_rank(data):
    says("per-rank", "each shard ends at most at the limit", "reaches sqrt(R) x limit", "direction changes")
    res, clipped = data.run("per-rank")
    for r, got in enumerate(res):
        assert got.total_norm == pytest.approx(data.own[r], rel=1e-12)  # its own shard (and bias copy)
        own = np.concatenate(list(got.grads))
        assert norm(own) <= LIMIT * (1 + 1e-12)  # each shard ends at most at the limit
    assert norm(clipped) <= math.sqrt(data.ranks) * LIMIT * (1 + 1e-12)
    if data.bias is None:  # every shard is far above the limit: the bound is reached
        assert norm(clipped) == pytest.approx(math.sqrt(data.ranks) * LIMIT, rel=1e-12)
    assert len({r.scale for r in res}) > 1  # the shards' norms differ, so do the scales...
    assert cos(clipped, data.original) < 1 - 1e-6  # ...and the direction changed


def test_rms(data):
    says("rms", "sqrt(N) times smaller than the norm", "clipped far too little")
    res, clipped = data.run("rms")
    assert res[0].total_norm == pytest.approx(data.norm / math.sqrt(data.count), rel=1e-12)
    # the norm read is above the limit here, so the clip lets sqrt(N) x limit through
    assert norm(clipped) == pytest.approx(min(data.norm, math.sqrt(data.count) * LIMIT), rel=1e-12)
    assert norm(clipped) > 10 * LIMIT


def test_sum_of_norms(data):
    says("sum-of-norms", "sqrt(a^2 + b^2) <= a + b", "(up to sqrt(R) times)", "clipped too hard")
    res, clipped = data.run("sum-of-norms")
    used = res[0].total_norm
    assert used == pytest.approx(math.fsum(data.local), rel=1e-12)
    assert data.norm < used <= math.sqrt(data.ranks) * data.norm * (1 + 1e-12)
    assert norm(clipped) < LIMIT


def test_mean_of_norms(data):
    says("mean-of-norms", "between sqrt(R) and R times below the global norm", "clips too little")
    res, clipped = data.run("mean-of-norms")
    used = res[0].total_norm
    assert used == pytest.approx(math.fsum(data.local) / data.ranks, rel=1e-12)
    r = data.ranks
    assert data.norm / r * (1 - 1e-12) <= used <= data.norm / math.sqrt(r) * (1 + 1e-12)
    assert norm(clipped) > LIMIT


def test_rank0_norm(data):
    says("rank0-norm", "The scale is the same everywhere", "computed from one shard", "clipped too little")
    res, clipped = data.run("rank0-norm")
    assert {r.scale for r in res} == {res[0].scale}
    assert res[0].total_norm == pytest.approx(data.local[0], rel=1e-12)
    assert res[0].total_norm < data.norm
    assert norm(clipped) > LIMIT


def test_max_of_norms(data):
    says("max-of-norms", "largest shard norm is below the global norm whenever another shard is non-zero")
    res, clipped = data.run("max-of-norms")
    assert res[0].total_norm == pytest.approx(max(data.local), rel=1e-12)
    assert res[0].total_norm < data.norm  # every other shard is non-zero here
    assert norm(clipped) > LIMIT


def test_epsilon(data):
    says("epsilon", "moves every scale by ~1e-6/norm", "slightly below the limit")
    res, clipped = data.run("epsilon")
    assert res[0].total_norm == pytest.approx(data.norm, rel=1e-12)
    right = LIMIT / data.norm
    shift = (right - res[0].scale) / right  # relative: 1e-6 / (norm + 1e-6)
    assert shift == pytest.approx(1e-6 / data.norm, rel=1e-3)
    assert LIMIT * (1 - 2e-6 / data.norm) < norm(clipped) < LIMIT


def test_epsilon_per_rank(data):
    says("epsilon-per-rank", "sqrt(sum (n_r + 1e-6)^2), up to sqrt(R) x 1e-6 above the norm",
         "The scale is the same on every rank")  # fmt: skip
    res, clipped = data.run("epsilon-per-rank")
    used = math.sqrt(math.fsum((n + 1e-6) ** 2 for n in data.local))  # each rank's norm + 1e-6
    assert {r.scale for r in res} == {res[0].scale}
    assert res[0].total_norm == pytest.approx(used, rel=1e-12)
    assert data.norm < used <= data.norm + math.sqrt(data.ranks) * 1e-6 * (1 + 1e-9)
    assert res[0].scale == pytest.approx(LIMIT / used, rel=1e-12)
    assert norm(clipped) < LIMIT


def test_double_count(data):
    says("double-count", "enter the all-reduce R times", "counted R times over")
    res, clipped = data.run("double-count")
    if (
        data.bias is None
    ):  # nothing replicated, nothing to count twice: the bug is the correct clip, bit for bit
        right = gclip.clip_simulated([[s.copy()] for s in data.shards], LIMIT, replicated=[False])
        assert [r.total_norm for r in res] == [r.total_norm for r in right]
        assert clipped.tobytes() == np.concatenate([r.grads[0] for r in right]).tobytes()
        assert res[0].total_norm == pytest.approx(data.norm, rel=1e-12)
        return
    # the bias's squares counted on every rank: R times instead of once, so it clips too hard
    want = math.sqrt(data.norm**2 + (data.ranks - 1) * data.bias_sq)
    assert res[0].total_norm == pytest.approx(want, rel=1e-12) and want > data.norm
    assert norm(clipped) == pytest.approx(LIMIT * data.norm / want, rel=1e-9) and norm(clipped) < LIMIT


def test_inf_pow(data):
    says("inf-pow", "the inf-norm always reads 1", "as if its largest entry were 1")
    res, clipped = data.run("inf-pow", norm_type=math.inf)
    assert {r.total_norm for r in res} == {1.0}
    # limit 1 and a norm read as 1: scale 1, so the largest entry stays what it was
    assert float(np.max(np.abs(clipped))) == float(np.max(np.abs(data.original)))
    assert float(np.max(np.abs(data.original))) > LIMIT


def test_fp16_sumsq(data):
    says("fp16-sumsq", "overflows at 65504", "becomes inf", "the scale max_norm / inf becomes 0")
    check_fp16_sumsq(data)


@pytest.mark.parametrize("share", [0.97, 1.0, 1.03])
def test_fp16_sumsq_next_to_float16s_largest_value(share):
    """The largest rank's sum of squares at 97%, 100% and 103% of 65504: float16's rounding of the
    squares and the sums decides on which side it falls, and either side must be what the
    explanation says."""
    base = Data(0, 2, False)
    check_fp16_sumsq(Data(0, 2, False, math.sqrt(share * 65504 / max(base.local_sq))))


def check_fp16_sumsq(data: Data) -> None:
    res, clipped = data.run("fp16-sumsq")
    biggest = max(data.local_sq)
    wiped = {r.total_norm for r in res} == {math.inf} and not np.any(clipped)
    kept = all(r.total_norm == pytest.approx(data.norm, rel=1e-2) for r in res)  # only float16 rounding
    kept = kept and norm(clipped) == pytest.approx(
        min(LIMIT, LIMIT * data.norm / res[0].total_norm), rel=1e-2
    )
    if biggest > 65504 * 1.05:  # a rank's sum of squares is far past float16's largest value
        assert wiped, [r.total_norm for r in res]
    elif biggest < 65504 * 0.95:
        assert kept, [r.total_norm for r in res]
    else:  # next to it: float16's roundings decide; either outcome, whole, on every rank
        assert wiped or kept, [r.total_norm for r in res]


def test_nan_mask(data):
    says("nan-mask", "0 x inf is NaN", "every gradient is NaN", "overflows above 1.8e19")
    res, clipped = data.run("nan-mask")  # the demo's data as it is: no overflow, the correct clip
    assert res[0].total_norm == pytest.approx(data.norm, rel=1e-12)
    assert norm(clipped) == pytest.approx(LIMIT, rel=1e-9)
    factor = STRATEGIES["nan-mask"].data_scale  # the data --buggy nan-mask runs on
    big = [[s * factor] + ([data.bias.copy()] if data.bias is not None else []) for s in data.shards]
    flags = [False, True] if data.bias is not None else [False]
    want = math.sqrt(
        (data.norm**2 - data.bias_sq) * factor**2 + data.bias_sq
    )  # the shards scaled, not the bias
    assert want**2 > float(np.finfo(np.float32).max)  # its float32 total overflows
    got = gclip.gallery.clip_simulated(big, LIMIT, mode="nan-mask", replicated=flags)
    assert all(math.isinf(r.total_norm) and math.isnan(r.scale) for r in got)
    assert all(np.all(np.isnan(g)) for r in got for g in r.grads)
    right = gclip.clip_simulated(big, LIMIT, replicated=flags)  # gclip: exact, and clipped to the limit
    assert right[0].total_norm == pytest.approx(want, rel=1e-9)


def test_every_combine_bug_has_a_check():
    checked = {name.removeprefix("test_").replace("_", "-") for name in globals() if name.startswith("test_")}
    assert {b.name for b in gclip.gallery.BUGS} <= checked


# ---------------------------------------------------------------------------
# the layout bugs, on the lab's transformer over simulated meshes


LAYOUTS = [
    dict(dp=2),
    dict(dp=3),
    dict(pp=2, dp=2),
    dict(dp=2, tp=2),
    dict(dp=5),
    dict(dp=2, tp=3),
    dict(dp=7),
    dict(pp=2, dp=2, tp=2),
    dict(tp=2),
    dict(tp=3),
    dict(tp=4),
    dict(pp=2, tp=3),
    dict(tp=8),
    dict(pp=2),
    dict(pp=3),
    dict(pp=2, tp=2),
    dict(pp=4, dp=2),
    dict(ep=2),
    dict(ep=3),
    dict(dp=2, ep=2),
    dict(ep=6),
    dict(dp=2, ep=2, tp=2),
]


def _size(axes: dict) -> int:
    return math.prod(axes.values())


def _layout_norms(axes: dict, bug: str | None) -> tuple[float, float, dict[str, float]]:
    """(the norm the bug's declarations give, the model's true norm, each tensor's sum of
    squares), on simulated ranks; the truth from the model's definition, each tensor once."""
    size = _size(axes)
    placements = None
    if bug is not None:
        placements = {pl: LAYOUT_BUG_NAMES[bug].declare(pl) for pl in transformer.PLACEMENTS}
    ranks, entries = [], []
    omit = LAYOUT_BUG_NAMES[bug].omit if bug else None
    for r in range(size):
        arrays, reps, _, mine = transformer.clip_arguments(Mesh((r, size), **axes), np.float64, placements)
        if omit in axes:
            keep = [i for i in range(len(mine)) if omit not in mine[i].placement.sharded]
            arrays, reps = [arrays[i] for i in keep], [reps[i] for i in keep]
        ranks.append(arrays)
        entries.append(reps)
    used = gclip.clip_simulated(ranks, 1.0, replicated=entries)[0].total_norm
    whole = transformer.model_shapes("ep" in axes)
    squares = {
        n: math.fsum(float(v) ** 2 for v in transformer.full_tensor(n, s).ravel()) for n, s in whole.items()
    }
    return used, math.sqrt(math.fsum(squares.values())), squares


def _layouts(axis: str) -> list[dict]:
    return [a for a in LAYOUTS if a.get(axis, 1) > 1 and 2 <= _size(a) <= 8]


def _explains(name: str, *phrases: str) -> None:
    text = " ".join(LAYOUT_BUG_NAMES[name].explanation.split())
    for phrase in phrases:
        assert phrase in text, (name, phrase)


@pytest.mark.parametrize("axes", _layouts("dp"), ids=str)
def test_dp_replicas_summed(axes):
    _explains("dp-replicas-summed", "sqrt(dp) times too large", "clipped too hard")
    used, true, _ = _layout_norms(axes, "dp-replicas-summed")
    assert used == pytest.approx(math.sqrt(axes["dp"]) * true, rel=1e-12)


@pytest.mark.parametrize("axes", _layouts("tp"), ids=str)
def test_tp_duplicates_summed(axes):
    _explains("tp-duplicates-summed", "counts them tp times", "inflated")
    used, true, squares = _layout_norms(axes, "tp-duplicates-summed")
    dup = math.fsum(v for n, v in squares.items() if n.endswith(("ln1", "ln2", "final_ln", "router")))
    assert used == pytest.approx(math.sqrt(true**2 + (axes["tp"] - 1) * dup), rel=1e-12)
    assert used > true


@pytest.mark.parametrize("axes", _layouts("tp"), ids=str)
def test_tp_rank0_only(axes):
    _explains("tp-rank0-only", "the norm is too small", "clipped too little")
    used, true, _ = _layout_norms(axes, "tp-rank0-only")
    assert used < true


@pytest.mark.parametrize("axes", _layouts("pp"), ids=str)
def test_tied_counted_twice(axes):
    _explains("tied-counted-twice", "adds its squares twice and inflates the norm")
    used, true, squares = _layout_norms(axes, "tied-counted-twice")
    assert used == pytest.approx(math.sqrt(true**2 + squares["embed"]), rel=1e-12)


@pytest.mark.parametrize("axes", _layouts("ep"), ids=str)
def test_experts_left_out(axes):
    _explains("experts-left-out", "it is too small", "clipped too little")
    used, true, squares = _layout_norms(axes, "experts-left-out")
    experts = math.fsum(v for n, v in squares.items() if ".experts." in n)
    assert used == pytest.approx(math.sqrt(true**2 - experts), rel=1e-12)


def _expert_squares(axes: dict, kept_tp0: bool) -> float:
    """The experts' sum of squares over the correct layout's pieces: every shard once (the rank of
    dp 0 holding it), or only the shards on tp-rank 0."""
    size, total = _size(axes), []
    for r in range(size):
        mesh = Mesh((r, size), **axes)
        if mesh.coords.get("dp", 0) or (kept_tp0 and mesh.coords.get("tp", 0)):
            continue
        for piece in transformer.clip_arguments(mesh, np.float64)[3]:
            if ".experts." in piece.name:
                total.append(math.fsum(float(v) ** 2 for v in piece.array.ravel()))
    return math.fsum(total)


@pytest.mark.parametrize("axes", [a for a in _layouts("ep") if a.get("tp", 1) > 1], ids=str)
def test_expert_tp_shards_dropped(axes):
    _explains("expert-tp-shards-dropped", "only tp-rank 0's shard of each expert counts", "too small")
    used, true, squares = _layout_norms(axes, "expert-tp-shards-dropped")
    experts = math.fsum(v for n, v in squares.items() if ".experts." in n)
    assert _expert_squares(axes, False) == pytest.approx(experts, rel=1e-12)  # the pieces are the model
    kept = _expert_squares(axes, True)
    assert 0 < kept < experts
    assert used == pytest.approx(math.sqrt(true**2 - experts + kept), rel=1e-12)


@pytest.mark.parametrize("axes", _layouts("ep"), ids=str)
def test_dense_expert_apart(axes):
    _explains("dense-expert-apart", "each end at the limit", "up to sqrt(2) x the limit")
    from gclip._lab import layout_run

    whole = transformer.model_shapes(True)
    squares = {
        n: math.fsum(float(v) ** 2 for v in transformer.full_tensor(n, s).ravel()) for n, s in whole.items()
    }
    experts = math.fsum(v for n, v in squares.items() if ".experts." in n)
    dense = math.fsum(v for n, v in squares.items() if ".experts." not in n)
    runs = layout_run.clip_model_simulated(axes, LIMIT, bug="dense-expert-apart")
    for run in runs:
        (dn, ds), (en, es) = run.split
        assert dn == pytest.approx(math.sqrt(dense), rel=1e-12)
        assert en == pytest.approx(math.sqrt(experts), rel=1e-12)
        assert ds == pytest.approx(LIMIT / math.sqrt(dense), rel=1e-12) and es != pytest.approx(ds)


def test_the_expert_tp_factor_docs_give_is_the_runs():
    used, true, _ = _layout_norms(dict(dp=2, ep=2, tp=2), "expert-tp-shards-dropped")
    text = (Path(__file__).resolve().parent.parent / "docs" / "layouts.md").read_text()
    assert f"{used / true:.3f}x the norm on the lab's model at `dp=2,ep=2,tp=2`" in text
