"""The scale rule: the one factor every rank applies, min(1, max_norm / norm).

A zero norm scales by 1 (nothing to clip), and so does an inf or NaN norm: the
gradient is left untouched and the caller can skip the step. The factor is the
plain quotient, rounded to nearest: at most half an ulp (2**-53, relative) from
the exact one, either way. A subnormal quotient has fewer bits, and rounded to
nearest it could lift the clipped norm by up to 1e-11 relative, so it is rounded
toward zero instead (factor * norm <= max_norm exactly). The backends multiply
float32 values by the factor rounded toward zero to float32
(``partials.float32_toward_zero``), so that rounding never lifts a value.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

__all__ = ["scale"]

_SMALLEST_NORMAL = sys.float_info.min


def scale(norm: float, max_norm: float) -> float:
    """min(1, max_norm / norm); 1 for a zero norm; 1 (untouched) for inf/NaN."""
    if norm == 0.0 or not norm < math.inf:  # a norm is >= 0: NaN and inf fail the test
        return 1.0
    factor = max_norm / norm
    if 0.0 < factor < _SMALLEST_NORMAL:  # fewer bits: rounded to nearest, it may lift the norm
        factor = _down_to_quotient(factor, max_norm, norm)
    return factor if factor < 1.0 else 1.0


def _down_to_quotient(factor: float, num: float, den: float) -> float:
    """A subnormal ``num / den`` rounded toward zero instead, so that factor * den <= num exactly
    (a normal quotient is within 2**-53 of it; a subnormal one can be 1e-11 above)."""
    while Fraction(factor) * Fraction(den) > Fraction(num):
        factor = math.nextafter(factor, 0.0)
    return factor
