"""Every JSON the lab writes: strict, with non-finite floats as strings.

Strict JSON has no NaN or Infinity, and many readers refuse Python's
``NaN`` token. So ``inf``, ``-inf`` and ``nan`` are written as the strings
"inf", "-inf" and "nan" (Python's ``float()`` reads them back), and
:func:`dumps` always passes ``allow_nan=False``: a non-finite float that
slipped through is an error here, not a broken file for the reader.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

__all__ = ["dumps", "jsonable"]


def jsonable(x: Any) -> Any:
    """``x`` with numpy scalars as Python ones and non-finite floats as strings, at any depth."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        value = float(x)
        return value if math.isfinite(value) else str(value)
    return x


def dumps(x: Any, **kwargs: Any) -> str:
    """``json.dumps(jsonable(x))``, strict; keyword arguments (indent, separators) pass through."""
    return json.dumps(jsonable(x), allow_nan=False, **kwargs)
