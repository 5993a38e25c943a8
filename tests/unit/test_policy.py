"""gclip.policy: the scale rule, min(1, max_norm / norm), against exact arithmetic (fractions)."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gclip import policy

finite = st.floats(min_value=0.0, max_value=sys.float_info.max, allow_nan=False, allow_infinity=False)


@given(norm=finite.filter(lambda x: x > 0), limit=finite)
def test_the_factor_is_the_quotient_rounded_once_never_up_where_subnormal(norm, limit):
    factor = policy.scale(norm, limit)
    exact = Fraction(limit) / Fraction(norm)
    assert 0.0 <= factor <= 1.0
    if exact >= 1:
        assert factor == 1.0
    elif exact < Fraction(sys.float_info.min):  # subnormal: toward zero, so factor * norm <= limit
        assert Fraction(factor) <= exact < Fraction(math.nextafter(factor, 1.0))
    else:  # normal: the plain quotient, rounded to nearest (at most half an ulp off, either way)
        assert abs(Fraction(factor) - exact) <= Fraction(math.ulp(factor)) / 2


@pytest.mark.parametrize("norm", [0.0, math.inf, math.nan])
def test_a_zero_or_non_finite_norm_leaves_the_gradient_alone(norm):
    assert policy.scale(norm, 1.0) == 1.0


def test_a_subnormal_quotient_is_rounded_toward_zero():
    norm, limit = 3.0, 2.0**-1073  # the quotient, 2/3 of the smallest subnormal, rounds up to it
    assert Fraction(limit / norm) > Fraction(limit) / Fraction(norm)
    assert policy.scale(norm, limit) == 0.0
    norm, limit = 3.0, 2.0**-1060  # a subnormal quotient that rounds down to nearest: the same
    assert policy.scale(norm, limit) == limit / norm
