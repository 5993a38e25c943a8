"""The conformance judge: does a third-party ``(shards, limit) -> shards`` keep the seed contract?

usage:: python -m gclip.conformance FILE.py:FUNC [--random 200] [--seed 0] [--timeout 5] [--json]
        python -m gclip.conformance package.module:func ...

It runs the seed record's seven checks for N = 1..5, a few edge cases and many
seeded random layouts (empty shards, uneven widths, zero limits, gradients
below and above the limit, 0 to 8 shards) against gclip's reference
``gclip.clip_shards``, and prints a verdict. When the implementation fails,
the judge names the gallery bug whose outputs it reproduces (its
*fingerprint*), by running every bug of ``gclip.strategies`` on the same
cases with one simulated rank per shard.

The implementation runs in a worker process, one call at a time, each under
``--timeout``: a call that raises, hangs, crashes the process or calls
``sys.exit`` is judged as a failure, never taken for the judge's own. The
judge is a single process and needs no MPI. Its entry point is the lab's
(``gclip._lab.cli.entry``) with one difference: its exit 1 means "fails the
contract", so its own faults exit 3 instead of aborting an MPI job.

Exit status: 0 pass, 1 fail, 2 usage error (bad spec, missing file or
function, a file that cannot be loaded), 3 an internal error of the judge.

The parts: ``cases`` (what is tried), ``target`` (what is judged),
``worker`` (the process the implementation runs in), ``verdict`` (the
checks and the fingerprint), ``report`` (text and JSON), ``command``.
"""

from .cases import Case, make_cases
from .command import main
from .target import parse_target
from .verdict import MAX_LOST, Verdict, judge
from .worker import Outcome

__all__ = ["MAX_LOST", "Case", "Outcome", "Verdict", "judge", "main", "make_cases", "parse_target"]
