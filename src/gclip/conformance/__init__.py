"""The conformance judge: does someone's gradient clipping keep the contract?

usage:: python -m gclip.conformance FILE.py:FUNC [--random 200] [--seed 0] [--timeout 5] [--json]
        python -m gclip.conformance FILE.py:FUNC --ranks R [--torch]
        python -m gclip.conformance FILE.py:FUNC --layout pp=2,dp=2,tp=2

Single process (no ``--ranks``): ``FUNC(shards, limit) -> shards`` runs in a
worker process, one call at a time under ``--timeout``, on the contract's
seven checks for N = 1..5, edge cases and seeded random layouts, against
``gclip.clip_shards``.

Distributed (``--ranks R``): ``FUNC(grads, max_norm, comm)`` runs on every rank
of an MPI job the judge starts and watches itself (``job``, ``rank``), on
cases spread over the ranks (``spread``), with a communicator that records
every collective entered (``recorder``); a case that does not finish names
its ranks (``hangs``) and the judge goes on with a fresh job. ``--torch``
passes torch parameters and a gloo group; ``--layout`` the lab's model over a
mesh (``layout_cases``). The expected outputs, and each gallery bug's, come
from gclip on simulated ranks holding the very same inputs (``dist_verdict``).

Both verdicts name the gallery bug an implementation reproduces (its
*fingerprint*), grade near misses (torch's epsilon, float32 arithmetic) with
their size, and show the scale each shard or rank applied and the norm that
implies (``implied``). ``gclip.testing`` runs the distributed checks inside a
user's own MPI tests (``inprocess``) and diagnoses a real training step
(``diagnosis``).

Exit status: 0 pass, 1 fail (a near miss too), 2 usage error (bad spec,
missing file or function, a file that cannot be loaded, started under
mpirun), 3 an internal error of the judge.
"""

from .cases import Case, make_cases
from .command import main
from .target import parse_target
from .verdict import MAX_LOST, Verdict, judge
from .worker import Outcome

__all__ = ["MAX_LOST", "Case", "Outcome", "Verdict", "judge", "main", "make_cases", "parse_target"]
