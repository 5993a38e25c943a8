"""Helpers the lab commands (demo, train, conformance, bench) share, each written once.

``cli`` flags, one-line errors and the entry point; ``plots`` the figures;
``jsonout`` strict JSON; ``vectors`` the p-norm and the cosine of a whole
vector; ``mpirun`` launching mpirun under a timeout; ``transformer`` the lab's
model laid out over pp x dp x tp x ep ranks, and ``layout_run`` clipping it
correctly or with a gallery bug. Private: the library's core never imports
from here.
"""

__all__: list[str] = []
