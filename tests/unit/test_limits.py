"""gclip.adaptive (ZClip, AutoClip, AGC) on one process, against the references' own rules.

The oracles are transcriptions, in this file, of:
- ZClip's reference implementation (bluorion-com/ZClip, ``zclip.py``: ``ZClip.step``,
  ``_compute_clip_val``, ``_initialize_ema``, ``_update_ema``, ``_apply_clipping``), run
  over a given norm instead of a model's gradients;
- AutoClip's rule (arXiv 2007.14469, its code: ``np.percentile(grad_history, p)`` of every
  norm seen, this one included);
- AGC as timm (``timm/utils/agc.py``) and optax (``adaptive_grad_clip``) compute it.

One array ``[norm]`` on COMM_SELF has global norm ``norm`` exactly, so the clippers see the
very sequence the reference does.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mpi4py import MPI

from gclip import GclipValueError
from gclip.limits import AGC, AutoClip, ZClip


class ReferenceZClip:
    """bluorion-com/ZClip's rule, transcribed; ``step(norm)`` -> (effective limit or None, coef)."""

    def __init__(
        self,
        alpha=0.97,
        z_thresh=2.5,
        max_grad_norm=1.0,
        eps=1e-6,
        warmup_steps=25,
        mode="zscore",
        clip_option="adaptive_scaling",
    ):
        self.alpha, self.z_thresh, self.max_grad_norm = alpha, z_thresh, max_grad_norm
        self.eps, self.warmup_steps, self.mode, self.clip_option = eps, warmup_steps, mode, clip_option
        self.buffer, self.initialized, self.mean, self.var = [], False, None, None

    def _initialize_ema(self):
        self.mean = sum(self.buffer) / len(self.buffer)
        self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
        self.initialized, self.buffer = True, []

    def _update_ema(self, grad_norm):
        self.mean = self.alpha * self.mean + (1 - self.alpha) * grad_norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (grad_norm - self.mean) ** 2

    def _compute_clip_val(self, grad_norm):
        std = self.var**0.5
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            if grad_norm > threshold:
                return threshold
        else:
            z = (grad_norm - self.mean) / (std + self.eps)
            if z > self.z_thresh:
                if self.clip_option == "adaptive_scaling":
                    eta = z / self.z_thresh
                    return self.mean + (self.z_thresh * std) / eta
                return self.mean
        return None

    def step(self, total_norm):
        if not self.initialized:
            self.buffer.append(total_norm)
            if len(self.buffer) >= self.warmup_steps:
                self._initialize_ema()
            if self.max_grad_norm is None or total_norm <= self.max_grad_norm:
                return None, 1.0  # torch's clip_grad_norm_: max / (norm + 1e-6), clamped to 1
            return self.max_grad_norm, min(1.0, self.max_grad_norm / (total_norm + 1e-6))
        clip_val = self._compute_clip_val(total_norm)
        adaptive = clip_val if clip_val is not None else total_norm
        effective = min(adaptive, self.max_grad_norm) if self.max_grad_norm is not None else adaptive
        coef = effective / (total_norm + 1e-6) if total_norm > effective else 1.0
        self._update_ema(clip_val if clip_val is not None else total_norm)
        return (effective if total_norm > effective else None), coef


def norms(steps=200, seed=0, spikes=12):
    """A norm sequence around 1 with spikes 5-60x, after a 25-step warmup."""
    rng = np.random.default_rng(seed)
    seq = np.exp(rng.normal(0.0, 0.15, steps))
    at = rng.choice(np.arange(30, steps), spikes, replace=False)
    seq[at] *= rng.uniform(5, 60, spikes)
    return [float(x) for x in seq]


SETTINGS = [
    dict(max_grad_norm=None),
    dict(max_grad_norm=1.4),
    dict(max_grad_norm=None, clip_option="mean"),
    dict(max_grad_norm=None, mode="percentile"),
    dict(max_grad_norm=3.0, z_thresh=2.0, alpha=0.9, warmup_steps=10),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_zclip_makes_the_reference_rules_decisions_step_for_step(settings):
    ours, ref = ZClip(**settings), ReferenceZClip(**settings)
    clipped = 0
    for t, norm in enumerate(norms()):
        got = ours.step(np.array([norm]), comm=MPI.COMM_SELF)
        limit, coef = ref.step(norm)
        assert got.total_norm == norm
        assert got.clipped == (limit is not None), t
        if limit is not None:
            clipped += 1
            assert math.isclose(got.limit, limit, rel_tol=4e-16), (t, got.limit, limit)
            # gclip's scale is limit / norm; the reference divides by norm + 1e-6
            assert abs(got.scale - coef) <= 1.1e-6 / norm * coef + 1e-16, (t, got.scale, coef)
            assert math.isclose(float(got.grads[0]), norm * got.scale, rel_tol=1e-15)
        else:
            assert got.scale == 1.0 and float(got.grads[0]) == norm
    assert 0 < clipped < 150  # the spikes (at least) were clipped, and not every step


def test_zclip_leaves_a_non_finite_norm_untouched_and_out_of_its_state():
    seq = norms(120, seed=3)
    with_bad = [*seq[:10], math.inf, *seq[10:60], math.nan, *seq[60:]]
    # the warmup ends on the 25th step, whatever its values (a host decision, the same on
    # every rank): with one of them inf, its statistics are those of the other 24
    ours, ref = ZClip(max_grad_norm=None), ReferenceZClip(max_grad_norm=None, warmup_steps=24)
    for norm in with_bad:
        got = ours.step(np.array([norm]), comm=MPI.COMM_SELF)
        if not math.isfinite(norm):
            assert got.scale == 1.0  # the step is for the caller to skip
            continue
        limit, _ = ref.step(norm)  # the reference, never shown the bad steps
        assert got.clipped == (limit is not None)
        if limit is not None:
            assert math.isclose(got.limit, limit, rel_tol=4e-16)


def test_zclip_state_round_trips_through_json_and_continues_with_the_same_decisions():
    seq = norms(160, seed=5)
    whole, first = ZClip(max_grad_norm=None), ZClip(max_grad_norm=None)
    for norm in seq[:20]:  # inside the warmup
        whole.step(np.array([norm]), comm=MPI.COMM_SELF)
        first.step(np.array([norm]), comm=MPI.COMM_SELF)
    resumed = ZClip(max_grad_norm=None)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for norm in seq[20:90]:
        a = whole.step(np.array([norm]), comm=MPI.COMM_SELF)
        b = resumed.step(np.array([norm]), comm=MPI.COMM_SELF)
        assert (a.limit, a.scale) == (b.limit, b.scale)
    again = ZClip(max_grad_norm=None)
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))  # after the warmup
    for norm in seq[90:]:
        a = whole.step(np.array([norm]), comm=MPI.COMM_SELF)
        b = again.step(np.array([norm]), comm=MPI.COMM_SELF)
        assert (a.limit, a.scale) == (b.limit, b.scale)


@pytest.mark.parametrize("window", [None, 17])
def test_autoclip_clips_at_the_percentile_of_the_norms_seen(window):
    seq = norms(150, seed=1)
    ours, history, clipped = AutoClip(25.0, window=window), [], 0
    for norm in seq:
        history.append(norm)
        kept = history if window is None else history[-window:]
        limit = float(np.percentile(kept, 25.0))  # the paper's code
        got = ours.step(np.array([norm]), comm=MPI.COMM_SELF)
        assert got.limit == limit and got.clipped == (norm > limit)
        clipped += got.clipped
    assert 0 < clipped < len(seq)
    resumed = AutoClip(25.0, window=window)
    resumed.load_state_dict(json.loads(json.dumps(ours.state_dict())))
    assert resumed.step(np.array([3.0]), comm=MPI.COMM_SELF) == ours.step(np.array([3.0]), comm=MPI.COMM_SELF)


def optax_agc(params, grads, clipping, eps=1e-3):
    """optax.adaptive_grad_clip's update_fn (unitwise_norm, unitwise_clip), in numpy."""

    def unitwise_norm(x):
        if np.squeeze(x).ndim <= 1:
            sq = np.sum(x * x, keepdims=True)
        elif x.ndim in (2, 3):
            sq = np.sum(x * x, axis=0, keepdims=True)
        else:
            sq = np.sum(x * x, axis=(0, 1, 2), keepdims=True)
        return np.broadcast_to(np.sqrt(sq), x.shape)

    out = []
    for p, g in zip(params, grads):
        g_norm, p_norm = unitwise_norm(g), unitwise_norm(p)
        max_norm = clipping * np.maximum(p_norm, eps)
        clipped = g * (max_norm / np.maximum(g_norm, 1e-6))
        out.append(np.where(g_norm < max_norm, g, clipped))
    return out


def timm_agc(params, grads, clipping, eps=1e-3):
    """timm's adaptive_clip_grad (unitwise_norm over dims 1..n), in numpy float64."""

    def unitwise_norm(x):
        return (
            np.linalg.norm(x)
            if x.ndim <= 1
            else np.sqrt(np.sum(x * x, axis=tuple(range(1, x.ndim)), keepdims=True))
        )

    out = []
    for p, g in zip(params, grads):
        max_norm = np.maximum(unitwise_norm(p), eps) * clipping
        grad_norm = unitwise_norm(g)
        out.append(np.where(grad_norm < max_norm, g, g * (max_norm / np.maximum(grad_norm, 1e-6))))
    return out


SHAPES = [(6, 5), (4,), (3, 2, 2, 2), (5, 1), ()]


@pytest.mark.parametrize("layout,oracle", [("out-first", timm_agc), ("in-first", optax_agc)])
def test_agc_clips_each_unit_as_the_reference_does(layout, oracle):
    rng = np.random.default_rng(2)
    shapes = [s for s in SHAPES if layout == "out-first" or len(s) <= 4]
    params = [np.asarray(rng.normal(size=s)) for s in shapes]
    params.append(np.zeros((3, 4)))  # zero-initialised: the eps floor
    # the gradients' scales differ by array, so some units are within their limit and some not
    grads = [
        np.asarray(rng.normal(size=p.shape) * scale)
        for p, scale in zip(params, [1e-4, 1.0, 1e-2, 1e-3, 1.0, 1e-2])
    ]
    got = AGC(0.05, layout=layout).step(params, grads)
    want = oracle(params, grads, 0.05)
    changed = kept = 0
    for g0, a, b in zip(grads, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)
        changed, kept = changed + int(np.sum(a != g0)), kept + int(np.sum(a == g0))
    assert changed > 0 and kept > 0  # both sides of the rule were exercised
    inplace = [g.copy() for g in grads]
    AGC(0.05, layout=layout).step(params, inplace, inplace=True)
    for a, b in zip(inplace, got):
        np.testing.assert_array_equal(a, b)


def test_agc_leaves_a_non_finite_unit_alone_and_the_others_clipped():
    p, g = np.ones((2, 3)), np.array([[np.inf, 1.0, 1.0], [10.0, 10.0, 10.0]])
    out = AGC(0.1).step([p], [g])[0]
    np.testing.assert_array_equal(out[0], g[0])
    np.testing.assert_allclose(out[1], g[1] * (0.1 * math.sqrt(3) / math.sqrt(300)), rtol=1e-15)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: ZClip(alpha=1.0), "alpha must be in (0, 1)"),
        (lambda: ZClip(mode="median"), "mode must be 'zscore' or 'percentile'"),
        (lambda: ZClip(clip_option="max"), "clip_option must be"),
        (lambda: ZClip(warmup_steps=0), "warmup_steps must be an int >= 1"),
        (lambda: ZClip(max_grad_norm=math.inf), "max_grad_norm must be in (0, inf)"),
        (lambda: AutoClip(101), "percentile must be in [0, 100"),
        (lambda: AutoClip(window=0), "window must be an int >= 1"),
        (lambda: AGC(clipping=-1), "clipping must be in (0, inf)"),
        (lambda: AGC(layout="io"), "layout must be one of"),
        (lambda: AGC().step([np.ones(3)], [np.ones(4)]), "params[0] has shape (3,) but grads[0] has (4,)"),
        (
            lambda: AGC().step([np.ones(2)], [np.float64(1.0)], inplace=True),
            "inplace=True needs writable numpy",
        ),
        (lambda: AGC(layout="in-first").step([np.ones((2,) * 5)], [np.ones((2,) * 5)]), "1 to 4 dimensions"),
    ],
)
def test_bad_arguments_get_one_line(make, needle):
    with pytest.raises(GclipValueError) as err:
        make()
    assert needle in str(err.value) and "\n" not in str(err.value)
