"""Property tests on simulated ranks: any layout, the answer of the contract computed exactly."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gclip
from gclip.contract import rounded
from oracles import contract_values, follows_contract

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def layouts(draw, elements=finite, max_size=40, max_ranks=6):
    """A vector and a random cut of it into shards (empty shards included)."""
    values = draw(st.lists(elements, min_size=0, max_size=max_size))
    ranks = draw(st.integers(1, max_ranks))
    cuts = sorted(draw(st.lists(st.integers(0, len(values)), min_size=ranks - 1, max_size=ranks - 1)))
    bounds = [0, *cuts, len(values)]
    shards = [values[bounds[i] : bounds[i + 1]] for i in range(ranks)]
    limit = draw(st.one_of(st.just(0.0), st.floats(0, 1e7, allow_nan=False, allow_infinity=False)))
    return values, shards, limit


def exact_norm(values) -> float:
    """The L2 norm from the exact (Fraction) sum of squares, scaled to stay in range."""
    total = sum((Fraction(v) ** 2 for v in values), Fraction(0))
    if total == 0:
        return 0.0
    k = (total.numerator.bit_length() - total.denominator.bit_length()) // 2
    try:
        return math.ldexp(math.sqrt(float(total / Fraction(4) ** k)), k)
    except OverflowError:
        return math.inf  # the true norm is beyond the largest float


@SETTINGS
@given(layouts(), st.booleans())
def test_simulated_ranks_follow_the_contract_computed_exactly(case, reproducible):
    """Rounded to 12 decimals, every clipped value is the contract's (exact arithmetic, the
    rule written in tests/oracles.py, not gclip's code), in both modes."""
    _, shards, limit = case
    ranks = [np.array(s, dtype=float) for s in shards]
    results = gclip.clip_simulated(ranks, limit, reproducible=reproducible)
    why = follows_contract([rounded(r.grads) for r in results], contract_values(shards, limit))
    assert not why, why


@SETTINGS
@given(layouts())
def test_the_seed_contract_follows_the_contract_computed_exactly(case):
    _, shards, limit = case
    why = follows_contract(gclip.clip_shards(shards, limit), contract_values(shards, limit))
    assert not why, why


@SETTINGS
@given(layouts())
def test_every_rank_gets_the_same_scale_and_the_right_norm(case):
    values, shards, limit = case
    results = gclip.clip_simulated([np.array(s, dtype=float) for s in shards], limit)
    assert len({(r.total_norm, r.scale) for r in results}) == 1
    norm = exact_norm(values)
    assert math.isclose(results[0].total_norm, norm, rel_tol=1e-13, abs_tol=0.0)
    clipped = np.concatenate([np.asarray(r.grads, dtype=float).ravel() for r in results] + [np.zeros(0)])
    if norm > limit:
        assert math.isclose(exact_norm(clipped.tolist()), limit, rel_tol=1e-12, abs_tol=1e-290)
    else:
        assert np.array_equal(clipped, np.array(values, dtype=float).ravel())


@SETTINGS
@given(layouts(max_ranks=5), st.randoms(use_true_random=False))
def test_reproducible_bits_do_not_depend_on_layout(case, rnd):
    values, shards, _ = case
    one = gclip.clip_simulated([np.array(values, dtype=float)], 1.0, reproducible=True)[0].total_norm
    many = gclip.clip_simulated([np.array(s, dtype=float) for s in shards], 1.0, reproducible=True)
    shuffled = list(values)
    rnd.shuffle(shuffled)
    other = gclip.clip_simulated([np.array(shuffled, dtype=float)], 1.0, reproducible=True)[0].total_norm
    assert {one.hex(), other.hex()} == {r.total_norm.hex() for r in many}
    assert one == exact_norm(values) or math.isclose(one, exact_norm(values), rel_tol=2.3e-16)


wide = st.floats(allow_nan=False, allow_infinity=False, width=64)


@SETTINGS
@given(layouts(elements=wide, max_size=12, max_ranks=4), st.sampled_from([False, True]))
def test_any_magnitude_norm_is_right(case, reproducible):
    """Values from subnormal to 1.8e308: no overflow, no underflow, 1e-12 relative."""
    values, shards, _ = case
    got = gclip.clip_simulated([np.array(s, dtype=float) for s in shards], 1.0, reproducible=reproducible)
    ref = exact_norm(values)
    if ref == 0.0:
        assert got[0].total_norm == 0.0
        return
    assert math.isclose(got[0].total_norm, ref, rel_tol=1e-12), (got[0].total_norm, ref)
