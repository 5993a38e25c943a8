"""Several cases of the check scripts in one torchrun job: one launch and one set of imports.

    python -m torch.distributed.run --nproc-per-node N tests/torch_batch.py CASE [CASE ...]

CASE is ``SCRIPT:ARG:ARG...``: a check script of tests/ (its module name) and the arguments its
``case`` function takes, as its own command line takes them. Every rank runs the cases in order,
in one process group, with a barrier between them, so no case starts while a peer is still in the
one before. A 4-rank job's start (5 processes, each importing torch and FSDP) costs about as much
CPU as its cases, and the test suite runs on 2 cores. Run by ``torch_jobs.Batch``.

A case that raises writes its rank, the case and its traceback to BATCH_ERRORS (a file named by the launcher)
and ends its rank (exit 1): the ranks may be inside different collectives by then, so no later
case runs, and their tests fail on the verdicts they lack, with that traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist

from torch_jobs import teardown, watchdog


def main(cases: list[str]) -> None:
    watchdog()
    dist.init_process_group("gloo")
    for spec in cases:
        script, *args = spec.split(":")
        try:
            importlib.import_module(script).case(*args)
        except BaseException:  # noqa: BLE001 - reported, then the job ends
            with open(os.environ["BATCH_ERRORS"], "a") as f:
                f.write(f"rank {dist.get_rank()}, case {spec}:\n{traceback.format_exc()}\n")
            os._exit(1)  # not teardown: a peer may wait in another collective
        dist.barrier()
    teardown(dist)  # after every verdict: an abort at teardown cannot take one away


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
