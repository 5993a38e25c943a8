"""What the reproducible mode's result reads of its digits: the counts of the K bins it keeps.

Shared by the tests that compare the compiled folds with numpy's (tests/test_kernels.py) and
torch's digits with numpy's (tests/test_torch.py): the bins below the kept ones may differ
between paths, and no result reads them.
"""

from __future__ import annotations

import numpy as np

from gclip import partials


def kept_bins(binned: partials.BinnedPowerSum, combined: np.ndarray) -> list[int]:
    """The digit counts of the K bins the result keeps (from the top non-zero bin)."""
    digits = combined[2:].reshape(binned.nbins, binned._DIGITS)
    counts = [sum(int(d) << (binned._DIGIT_BITS * j) for j, d in enumerate(row)) for row in digits]
    top = max((i for i, c in enumerate(counts) if c), default=binned.K - 1)
    return counts[top - binned.K + 1 : top + 1]
