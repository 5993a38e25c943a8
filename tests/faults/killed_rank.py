"""A rank killed by SIGKILL in the middle of a run of clips, and named.

usage:: mpiexec -n N python killed_rank.py [--victim R] [--after K] [--clips C]

Every rank runs C clips; rank R kills itself with SIGKILL (uncatchable, as the
kernel's OOM killer would) after K of them. The others are left in the next
clip's all-reduce, which can never complete: only the launcher can end the job.

Nothing can run in a process after SIGKILL, and Hydra names a dead process by
pid only, and not reliably the first to die: its cleanup kills the survivors
with the same signal, and it reports the lowest-ranked of them. So each rank
here is a small supervisor (as torchrun's agent is) that forks the MPI worker
before MPI starts and waits for it: if the worker dies by a signal, the
supervisor, still alive, prints one line naming the rank, then dies of the
same signal so the launcher sees what it would have seen. A worker whose
supervisor is killed (the launcher's cleanup) dies with it: a thread of the
worker watches its parent pid and kills the worker when the supervisor is
gone (portable: Linux and macOS), so nothing is left behind.

With ``--victim -1`` nobody dies and rank 0 prints ``finished``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

ORPHAN_POLL = 0.05  # seconds between the worker's looks at its parent


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victim", type=int, default=1, help="the rank that dies (-1: none)")
    parser.add_argument("--after", type=int, default=5, help="clips before it dies")
    parser.add_argument("--clips", type=int, default=20000, help="clips every rank runs")
    return parser.parse_args()


def _work(args: argparse.Namespace) -> int:
    """The MPI rank proper (runs in the forked worker)."""
    import numpy as np
    from mpi4py import MPI

    import gclip

    comm = MPI.COMM_WORLD
    grads = np.full(1000, comm.rank + 1.0)
    for done in range(1, args.clips + 1):
        gclip.clip_by_global_norm(grads, 1.0, comm=comm)
        if comm.rank == args.victim and done == args.after:
            os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank == 0:
        print(f"finished {args.clips} clips", flush=True)
    return 0


def _die_with(parent: int) -> None:
    """Be killed when the supervisor is: once it is gone the worker is re-parented
    (its parent pid changes), which a daemon thread notices within ORPHAN_POLL.
    mpi4py releases the GIL inside MPI calls, so the thread runs even while the
    worker waits in an all-reduce that can never complete."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main() -> int:
    args = _args()
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    supervisor = os.getpid()
    sys.stdout.flush()
    worker = os.fork()  # before MPI starts in any process: the worker alone is the rank
    if worker == 0:
        _die_with(supervisor)
        sys.exit(_work(args))  # a normal exit: MPI's exit handlers tell the launcher we finalized
    # The supervisor keeps its copy of the launcher's channel (PMI_FD) open: the launcher
    # learns of the death only when the supervisor exits, after it has named the rank.
    _, status = os.waitpid(worker, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name
        print(f"killed_rank: rank {rank} (pid {worker}) died of {name}", file=sys.stderr, flush=True)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)  # so that re-raising it is fatal
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    raise SystemExit(main())
