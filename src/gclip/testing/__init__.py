"""Check your own distributed clip from inside your own tests and training jobs.

- :func:`assert_conforms` runs the distributed judge's checks on the ranks
  your test runs on (under ``mpirun -n R python -m pytest --with-mpi``):
  every rank passes, or every rank raises the same AssertionError naming the
  bug. A case that hangs (a rank skipping the collective) never hangs your
  suite: a watchdog prints which ranks did what and aborts the job.
- :func:`diagnose` takes one step of your real training code, the gradients
  before and after its clip, and says which scale each rank applied, whether
  they agree, the norm that implies, and the gallery bug it matches; it grades
  the step as the command grades a case (pass, near miss, fail).
- :func:`audit` (torch) watches the real steps of a block of your own code, as
  ``python -m gclip.audit`` watches a script: the gradients backward left and
  those the optimizer received, graded per step (docs/frameworks.md).

See docs/judge.md for a test file to copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..conformance.diagnosis import Diagnosis, diagnose

__all__ = ["ONE_RANK", "Diagnosis", "assert_conforms", "audit", "diagnose"]

ONE_RANK = (
    "gclip.testing.assert_conforms on 1 rank: a per-rank clip is the global clip there, so it would pass; "
    "run the test on 2 ranks or more (mpirun -n 2 python -m pytest --with-mpi ...)"
)


def assert_conforms(
    fn: Callable[..., Any],
    comm: Any = None,
    *,
    random: int = 50,
    seed: int = 0,
    timeout: float = 10.0,
    dtype: str | None = None,
    nonempty_ranks: bool = False,
    positive_max_norm: bool = False,
) -> None:
    """Assert that ``fn(grads, max_norm, comm)`` clips like gclip on the ranks of ``comm``.

    Collective: call it on every rank of ``comm`` (default ``COMM_WORLD``).
    ``fn`` gets this rank's list of float arrays, the limit and a
    communicator (a recording duplicate of ``comm``), and returns the
    clipped list, or None after clipping in place. The cases are the
    command's (``python -m gclip.conformance FILE.py:FUNC --ranks R``): the
    contract's checks spread over the ranks, ranks holding several, no or
    only empty arrays, float32 and float64, edge cases and ``random`` seeded
    layouts. ``timeout``: seconds one case may take before the watchdog
    aborts the job (with a message naming the ranks that hung). ``dtype``,
    ``nonempty_ranks`` and ``positive_max_norm`` keep only the cases of one
    family (every array in that dtype, every rank holding values, a limit above
    0), as the command's ``--dtype``, ``--nonempty-ranks`` and
    ``--positive-max-norm`` do, for code that assumes them.

    Raises AssertionError, with the same message on every rank, naming the
    gallery bug ``fn`` reproduces when it is one. On one rank it warns
    (``UserWarning``): a per-rank clip cannot be told from the global one there.
    """
    from ..conformance.families import DTYPES, Family
    from ..conformance.inprocess import conforms
    from ..conformance.target import form_error
    from ..drivers import communicator

    comm = communicator(comm)
    if comm.Get_size() == 1:
        warnings.warn(ONE_RANK, stacklevel=2)
    if isinstance(random, bool) or not isinstance(random, int) or random < 0:
        raise ValueError(f"random must be a whole number >= 0, got {random!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    misfit = form_error(fn, "numpy", getattr(fn, "__qualname__", repr(fn)))
    if misfit is not None:  # a TypeError on every rank alike, before any case runs
        misfit = misfit.split(": for a ")[0]
        raise TypeError(f"gclip.testing.assert_conforms: {misfit}; it calls fn(grads, max_norm, comm)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    family = Family(dtype, bool(nonempty_ranks), bool(positive_max_norm))
    verdict, message = conforms(fn, comm, count=random, seed=seed, timeout=float(timeout), family=family)
    if not verdict.passed:
        raise AssertionError(message)


def audit(
    *, max_norm: float | None = None, optimizers: Any = None, plain: str = "auto", check: bool = True
) -> Any:
    """A context manager that audits every optimizer step inside it (torch; collective).

    ``with gclip.testing.audit(max_norm=1.0) as a: ...`` runs the block with the hooks
    of ``python -m gclip.audit``; ``a.reports`` holds one ``gclip.audit.StepReport`` per
    step. With ``check=True`` (default) it raises AssertionError, the same on every rank,
    unless a step was audited and every one passed. See :func:`gclip.audit.context.audit`.
    """
    from ..audit.context import audit as audit_block

    return audit_block(max_norm=max_norm, optimizers=optimizers, plain=plain, check=check)
