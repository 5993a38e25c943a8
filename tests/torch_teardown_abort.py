"""A torchrun job whose rank 1 ends as gloo's teardown abort does (run by test_torch_launch.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/torch_teardown_abort.py OUTDIR WHEN

Each rank writes OUTDIR/rank<R>.json, then tears down; rank 1 prints the abort's line and
aborts (SIGABRT), after its verdict (WHEN=after) or before it (WHEN=before), or raises a
Python error after it (WHEN=error): what assert_finished must tell apart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist

from torch_jobs import TEARDOWN_ABORT, teardown, watchdog


def main(outdir: str, when: str) -> None:
    watchdog()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1 and when == "before":
        os.abort()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
    teardown(dist)
    if rank == 1 and when == "error":
        raise RuntimeError("a real failure after the verdict")
    if rank == 1:
        print(TEARDOWN_ABORT, file=sys.stderr, flush=True)
        os.abort()
    time.sleep(2)  # rank 0 still running when rank 1 aborts: torchrun ends it (SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
