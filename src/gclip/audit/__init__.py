"""``gclip.audit``: an unmodified training script, and whether its clipping is right.

::

    torchrun --nproc-per-node 4 -m gclip.audit [--max-norm X] [--steps K] [--json FILE] train.py [ARGS...]

runs ``train.py`` as ``python train.py ARGS`` would (``runpy``: its ``__main__``, its
``sys.argv``), with hooks on every optimizer step and on what backward leaves
(:mod:`gclip.audit.auditor`). At each step it compares the gradients the optimizer
receives with the gradients backward produced, each rank reduced to a few numbers per
tensor (:mod:`gclip.audit.capture`: no copy of the gradients), and reports, on rank 0:
the true global norm (from the DTensor placements, DDP's replicas, or ``--replicated`` /
``--sharded`` for plain tensors), the scale each rank applied and the norm it implies, and
the grade and gallery bug that explain them (:mod:`gclip.audit.verdict`).

From Python, for a test suite: ``gclip.testing.audit``, the same as a context manager. An
optimizer that clips inside its own step (DeepSpeed's ZeRO) is read from its update instead:
:func:`gclip.audit.update.grade_update`.
See docs/frameworks.md.
"""

from __future__ import annotations

from .auditor import Auditor
from .verdict import NEVER_SCALED, StepReport

__all__ = ["NEVER_SCALED", "Auditor", "StepReport"]
