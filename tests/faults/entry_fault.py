"""Faults inside an entry point built with ``gclip._lab.cli.entry``.

usage:: mpiexec -n N python entry_fault.py {raise,bad-input,none} [--rank R]

- ``raise``: rank R raises RuntimeError in ``main`` while the others wait in a
  clip's all-reduce. The entry point must print one line naming rank R and
  abort the whole job (no traceback, nobody left waiting).
- ``bad-input``: rank R passes an integer array to the clip. gclip agrees on
  the error, so every rank exits 2 and rank 0 alone prints one line.
- ``none``: every rank clips; rank 0 prints the norm; exit 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

import gclip
from gclip._lab import cli


def _main(argv: Sequence[str] | None) -> int:
    parser = cli.ArgParser(prog="entry_fault", description=__doc__.splitlines()[0])
    parser.add_argument("fault", choices=["raise", "bad-input", "none"])
    parser.add_argument("--rank", type=int, default=1, help="the rank at fault")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    grads = np.full(10, comm.rank + 1.0)
    if comm.rank == args.rank:
        if args.fault == "raise":
            raise RuntimeError("injected fault")
        if args.fault == "bad-input":
            grads = np.arange(10)
    result = gclip.clip_by_global_norm(grads, 1.0, comm=comm)
    cli.say(f"norm {result.total_norm!r}")
    return 0


main = cli.entry("entry_fault", _main)

if __name__ == "__main__":
    main()
